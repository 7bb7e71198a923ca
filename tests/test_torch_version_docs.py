"""What the docs say torch's setter does, per version, held to the model of torch's parser.

``hybridmem/allocator/rules.py`` is checked against every recorded release's own parser
(``tests/test_torch_rules.py``); these tests hold the prose to it: the table of setting
families in docs/torch-versions.md row by row, and every sentence in the README, the
docs and the docstrings that bounds the setter's reset of a setting by a torch version
("drops it on torch 2.13 and older" was one, while every version drops it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from hybridmem.allocator.rules import RECORDED_VERSIONS, TorchRules
from tests.helpers import REPO

DOC = REPO / "docs" / "torch-versions.md"
HEADING = "## What a setter call does to each setting"
MINORS = sorted({int(v.split(".")[1]) for v in RECORDED_VERSIONS})
# the reset family, and the words a sentence about it uses
RESET_WORDS = re.compile(
    r"max_split_size_mb|garbage_collection_threshold|roundup_power2_divisions|"
    r"max_non_split_rounding_mb|\bdrops?\b|\bdropping\b|\bresets?\b"
)
# "torch 2.13 and older", "torch ≤ 2.13", "torch <= 2.13", "up to 2.13", "until 2.13"
UPPER_BOUND = re.compile(
    r"(?:torch\s+2\.(\d+)\s+and\s+(?:older|earlier|before)|torch\s*(?:≤|<=)\s*2\.(\d+)|"
    r"(?:up\s+to|until|through)\s+(?:torch\s+)?2\.(\d+))"
)


def _table() -> list[tuple[list[int], set[str], set[str], set[str]]]:
    text = DOC.read_text()
    assert HEADING in text, f"{DOC} lost its section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"2\.(\d+)(?:\s*\u2013\s*2\.(\d+))?", cells[0]) if cells else None
        if match is None:
            continue
        first, last = int(match[1]), int(match[2] or match[1])
        keys = [set(re.findall(r"`(\w+)`\s*(?:\([^)]*\))?", cell)) for cell in cells[1:4]]
        # a parenthesis names what a key resets to (`large_segment_size_mb`): not a member
        keys[0] = set(re.findall(r"`(\w+)`(?!\))", cells[1])) - {"large_segment_size_mb"}
        rows.append((list(range(first, last + 1)), keys[0], keys[1], keys[2]))
    return rows


def test_the_table_of_setting_families_is_torchs_own_rules_version_by_version() -> None:
    rows = _table()
    covered = [minor for versions, *_ in rows for minor in versions]
    assert covered == MINORS, f"the table covers 2.{covered}, the recorded releases 2.{MINORS}"
    for versions, reset, kept, start_up in rows:
        for minor in versions:
            rules = TorchRules((2, minor))
            assert reset == set(rules.reset_keys), (minor, reset ^ set(rules.reset_keys))
            assert kept == set(rules.kept_keys), (minor, kept ^ set(rules.kept_keys))
            assert start_up == rules.keys - rules.reset_keys - rules.kept_keys, minor


def _sentences() -> Iterator[tuple[str, str]]:
    """(where, sentence) over the README, the docs and hybridmem's docstrings and comments."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    files += sorted((REPO / "hybridmem").rglob("*.py"))
    for path in files:
        # a table's cell, a paragraph's sentence: never one run across rows
        units = []
        for block in re.split(r"\n\s*\n", path.read_text()):
            lines = block.splitlines()
            if lines and all(line.lstrip().startswith("|") for line in lines):
                units += [cell for line in lines for cell in line.split("|")]
            else:
                units.append(" ".join(lines))
        for unit in units:
            text = re.sub(r"\s+", " ", unit)
            for sentence in re.split(r"(?<=[.;!?])\s+(?=[A-Z(`*])", text):
                yield str(path.relative_to(REPO)), sentence


def false_bounds(sentences: Iterator[tuple[str, str]]) -> list[str]:
    """Sentences that bound the reset family by a version below which torch still resets it."""
    wrong = []
    for where, sentence in sentences:
        named = set(RESET_WORDS.findall(sentence)) & set(TorchRules((2, 15)).reset_keys)
        if not named and not (RESET_WORDS.search(sentence) and "setter" in sentence):
            continue
        for match in UPPER_BOUND.finditer(sentence):
            bound = int(next(g for g in match.groups() if g is not None))
            after = [m for m in MINORS if m > bound]
            if not after:
                continue
            # true only where torch changed at that bound: the family reset on both
            # sides of it (or on neither) makes the bound a false difference
            before, beyond = TorchRules((2, bound)).reset_keys, TorchRules((2, after[0])).reset_keys
            keys = named or set(before)
            if all((k in before) == (k in beyond) for k in keys):
                wrong.append(f"{where}: {match[0]!r} in {sentence[:200]!r}")
    return wrong


def test_no_sentence_bounds_the_setters_reset_below_the_versions_that_still_reset() -> None:
    assert false_bounds(_sentences()) == []


@pytest.mark.parametrize(
    "sentence",
    [
        "your setting kept in both (torch's own setter drops it on torch 2.13 and older).",
        "verl's writes `expandable_segments:{enable}` alone through torch's setter, dropping "
        "`max_split_size_mb` on torch ≤ 2.13.",
        "torch's setter, which on torch up to 2.13 resets ``max_split_size_mb``.",
    ],
)
def test_the_check_finds_the_sentences_it_exists_for(sentence: str) -> None:
    assert false_bounds(iter([("doc", sentence)])) != []


def test_a_true_bound_passes() -> None:
    sentence = "torch's setter resets `max_split_size_mb` on every torch from 2.4 to 2.15."
    assert false_bounds(iter([("doc", sentence)])) == []
