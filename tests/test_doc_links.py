"""Every relative link in the docs and the results' READMEs reaches a file and a heading.

A figure in docs/benchmarks.md is worth what its link to the raw results is worth: a
link to a moved file or to a section that was renamed (or lives in another run's
README) leaves the reader without the evidence. Anchors are GitHub's: the heading
lowercased, characters other than letters, digits, ``_``, ``-`` and spaces dropped,
spaces made ``-``, a repeated heading suffixed ``-1``, ``-2``; headings inside fenced
code are not headings.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
    *sorted((REPO / "benchmarks" / "results").glob("*/README.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


@functools.cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors GitHub gives ``page``'s headings (fenced code skipped; read once a run)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        base = slug(line.lstrip("#"))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def _shown(path: Path) -> str:
    """``path`` from the repository's root where it is inside it."""
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file or heading is not there, each as written."""
    broken = []
    for match in LINK.finditer(page.read_text()):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        reached = (page.parent / path).resolve() if path else page
        if not reached.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and reached.suffix == ".md" and anchor not in anchors(reached):
            broken.append(f"{target} (no such heading in {_shown(reached)})")
    return broken


def test_the_pages_are_found() -> None:
    names = {page.relative_to(REPO).as_posix() for page in PAGES}
    assert {"README.md", "docs/benchmarks.md", "docs/backends/vllm.md"} <= names
    assert sum(name.startswith("benchmarks/results/") for name in names) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_reaches_its_file_and_heading(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_file_or_heading_is_named(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Other\n## Twice\n## Twice\n```bash\n# not a heading\n```\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md#other) [b](other.md#twice-1) [c](#mine) [d](https://x.org/#no)\n"
        "# Mine\n"
        "[e](gone.md) [f](other.md#not-a-heading) [g](other.md#twice-2)\n"
    )
    assert broken_links(page) == [
        "gone.md (no such file)",
        f"other.md#not-a-heading (no such heading in {tmp_path.resolve() / 'other.md'})",
        f"other.md#twice-2 (no such heading in {tmp_path.resolve() / 'other.md'})",
    ]


def test_the_anchor_is_githubs() -> None:
    assert slug(" `hybridmem bench [--quick] [--cycles N]`") == "hybridmem-bench---quick---cycles-n"
    assert slug("vLLM's sleep-mode engine beside torch_memory_saver's") == (
        "vllms-sleep-mode-engine-beside-torch_memory_savers"
    )
    assert slug("Level-1 sleep (`vllm_level1.json`)") == "level-1-sleep-vllm_level1json"
