"""Every rename in CHANGELOG.md: the old spelling fails with a message naming the new one.

The tables are read from CHANGELOG.md itself, so a rename recorded there and not
answered by the package (``hybridmem/_moved.py``) fails here.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

import hybridmem as hm
from tests.helpers import REPO

_TABLE_HEADINGS = ("### Renamed", "### No longer on the face")


@dataclass(frozen=True)
class Row:
    was: str  # dotted, hybridmem.x
    now: str  # as written (hm.x(), hybridmem.a.b, or "removed")
    line: int


def _dotted(spelling: str) -> str:
    """`hm.x(...)` -> `hybridmem.x`: the name up to its first call."""
    spelling = spelling.strip().split("(")[0]
    return "hybridmem." + spelling[3:] if spelling.startswith("hm.") else spelling


def _rows() -> list[Row]:
    rows: list[Row] = []
    in_table = False
    for number, line in enumerate((REPO / "CHANGELOG.md").read_text().splitlines(), 1):
        if line.startswith("#"):
            in_table = line.startswith(_TABLE_HEADINGS)
            continue
        if not in_table or not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        was = re.match(r"`([^`]+)`", cells[0])
        now = re.match(r"`([^`]+)`", cells[1])
        assert was, f"CHANGELOG.md:{number}: no old spelling in {line!r}"
        rows.append(Row(_dotted(was.group(1)), now.group(1) if now else cells[1], number))
    return rows


ROWS = _rows()


def _resolve(path: str) -> object:
    """Import the longest module prefix of ``path`` and get the rest as attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part)
        return value
    raise ModuleNotFoundError(path)


def _exists(path: str) -> bool:
    try:
        _resolve(path)
    except (AttributeError, ImportError):
        return False
    return True


def test_the_changelog_has_rename_tables() -> None:
    assert len(ROWS) >= 40
    assert any(row.was == "hybridmem.cache_released" for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row.was for row in ROWS])
def test_an_old_spelling_says_where_it_went(row: Row) -> None:
    now = row.now
    if now != "removed":
        # The new spelling exists, or was renamed again by a later row.
        later = {r.was: r.now for r in ROWS}
        seen = {row.was}
        while not _exists(_dotted(now)) and _dotted(now) in later and _dotted(now) not in seen:
            seen.add(_dotted(now))
            now = later[_dotted(now)]
        assert _exists(_dotted(now)), f"CHANGELOG.md:{row.line}: {now} does not exist"
    if _exists(row.was):
        # Still there: a module that became a package, a name renamed back, or the
        # old module still re-exporting the very object that moved.
        if now != "removed" and _dotted(now) != row.was and "(" not in row.now:
            old, new = _resolve(row.was), _resolve(_dotted(now))
            assert old is new or isinstance(old, type(sys)), f"CHANGELOG.md:{row.line}"
        return
    with pytest.raises((AttributeError, ImportError)) as caught:
        _resolve(row.was)
    message = str(caught.value)
    expected = "removed" if now == "removed" else re.sub(r"\([^()]*\)$", "", now)
    assert expected in message, f"CHANGELOG.md:{row.line}: {message!r} does not name {expected!r}"


def test_a_renamed_face_name_gets_no_misleading_hint() -> None:
    # Python's "Did you mean" would suggest allocator_settings for allocator_config.
    result = subprocess.run(
        [sys.executable, "-c", "import hybridmem as hm; hm.allocator_config"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "use hm.allocator_state()" in result.stderr
    assert "Did you mean" not in result.stderr


def test_an_unknown_name_is_a_plain_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'hybridmem' has no attribute 'nope'"):
        hm.nope  # noqa: B018


def test_a_moved_module_names_its_new_home_on_import() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"moved to hybridmem\.observe\.memory"):
        importlib.import_module("hybridmem.telemetry")
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'hybridmem\.nothing_here'"):
        importlib.import_module("hybridmem.nothing_here")


def test_the_cards_names_are_on_the_face() -> None:
    for name in (
        "expandable_segments",
        "aggressive_cache_release",
        "ipc_safe",
        "register_backend",
        "get_backend",
        "list_backends",
    ):
        assert name in hm.__all__
        assert callable(getattr(hm, name))
    assert "cache_released" not in hm.__all__
