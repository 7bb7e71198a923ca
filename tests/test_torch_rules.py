"""The model of torch's allocator-settings parser against torch's own parsers.

Two recordings of what the parsers of torch 2.4.1 ... 2.15.0 (each CUDA wheel's
libc10, driven by ``tests/torch_parser/probe.cpp``, no GPU) answered: for the
curated and random cases of ``tests/torch_parser/corpus.py`` (``recorded.json``) and
for 7,000 cases of the generator ``tests/torch_parser/generate.py``
(``recorded_generated.json.gz``): whether each env string was taken, refused or
aborted the process, whether each setter string was taken, and torch's state after
each, refused strings included (torch keeps the part it had read). Every answer
must be the model's. The installed torch is checked live too, on a fresh seed.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem import _torch
from hybridmem.allocator.cparse import C_SPACE, FLOAT_PREFIX
from hybridmem.allocator.parsers import IGNORED_RESERVE
from hybridmem.allocator.rules import (
    ALLOC_CONF,
    CUDA_ALLOC_CONF,
    RECORDED_VERSIONS,
    TorchRules,
    default_state,
)
from tests.torch_parser.corpus import CURATED_STRINGS, corpus
from tests.torch_parser.generate import cases as generated_cases
from tests.torch_parser.generate import settings_strings
from tests.torch_parser.record import GENERATED, cases_digest

RECORDED = Path(__file__).parent / "torch_parser" / "recorded.json"
_UNLIMITED_UNTIL_SET = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")


@cache
def recorded() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDED.read_text())
    return data


def _version(text: str) -> tuple[int, int]:
    major, minor, *_ = text.split(".")
    return int(major), int(minor)


def _as_probe(state: dict[str, Any]) -> dict[str, str | float]:
    """The model's state in the probe's words (roundup as 16 numbers, bools as 0/1)."""
    out: dict[str, str | float] = {}
    for key, value in state.items():
        if key == "roundup_power2_divisions":
            out["roundup"] = ",".join(str(v) for v in value)
        elif key in ("max_split_size_mb", *_UNLIMITED_UNTIL_SET):
            out[key] = "inf" if value is None else str(value)
        elif isinstance(value, bool):
            out[key] = "1" if value else "0"
        elif isinstance(value, float):
            out[key] = value
        else:
            out[key] = str(value)
    return out


def _differences(model: dict[str, Any], base: dict[str, str], diff: dict[str, str]) -> list[str]:
    expected = {**base, **diff}
    ours = _as_probe(model)
    wrong = []
    for key, value in expected.items():
        mine = ours.get(key)
        if isinstance(mine, float):
            theirs = float(value)
            both_nan = math.isnan(mine) and math.isnan(theirs)
            if not (both_nan or math.isclose(mine, theirs, rel_tol=1e-5, abs_tol=1e-12)):
                wrong.append(f"{key}: model {mine}, torch {value}")
        elif mine != value:
            wrong.append(f"{key}: model {mine}, torch {value}")
    return wrong


def test_the_recording_covers_the_corpus_and_every_family() -> None:
    data = recorded()
    assert data["cases"] == corpus(), "corpus.py changed: re-record (tests/torch_parser/record.py)"
    versions = sorted(data["results"], key=_version)
    assert versions == list(RECORDED_VERSIONS)  # what the model says it was checked against
    taken = sum(
        1
        for _, rows in data["results"].values()
        for row in rows
        if row["env"] not in ("refused", "abort")
        for verdict, _ in row["sets"]
        if verdict == "ok"
    )
    refused = sum(
        1
        for _, rows in data["results"].values()
        for row in rows
        if row["env"] not in ("refused", "abort")
        for verdict, _ in row["sets"]
        if verdict != "ok"
    )
    assert taken > 1500
    assert refused > 1500


CORPUS_VERSIONS: list[str] = sorted(json.loads(RECORDED.read_text())["results"], key=_version)


def _replay(
    version: str,
    cases: list[dict[str, Any]],
    base: dict[str, str],
    rows: list[Any],
) -> list[str]:
    """Every way the model's answers for ``cases`` differ from torch's recorded ``rows``.

    An env torch aborted on at start-up is recorded as "abort", one it refused as
    "refused": the model must tell them apart too.
    """
    rules = TorchRules(_version(version))
    at_start = TorchRules(rules.version, backend=None)
    mismatches: list[str] = []
    for case, row in zip(cases, rows, strict=True):
        env, sets = case["env"], case["sets"]
        name, _ = rules.env_variable(env)
        state = default_state(rules.version)
        if name is not None:
            outcome = at_start.run(env[name], state)
            model = "abort" if outcome.aborts else ("ok" if outcome.accepted else "refused")
            torch_says = row["env"] if row["env"] in ("abort", "refused") else "ok"
            if model != torch_says:
                mismatches.append(f"env {env}: torch {torch_says}, model {outcome.error or model}")
                continue
            state = outcome.state
        elif row["env"] in ("refused", "abort"):
            mismatches.append(f"env {env}: model reads nothing, torch {row['env']}")
            continue
        if row["env"] in ("refused", "abort"):
            continue
        wrong = _differences(state, base, row["env"])
        if wrong:
            mismatches.append(f"env {env}: {wrong}")
            continue
        for text, (verdict, after) in zip(sets, row["sets"]):
            outcome = rules.run(text, state)
            if verdict == "crash":  # torch's undefined behaviour: it never takes these
                if outcome.accepted:
                    mismatches.append(f"{text!r}: torch crashed, the model takes it")
                break
            if outcome.accepted != (verdict == "ok"):
                mismatches.append(f"{text!r}: torch {verdict}, model {outcome.error or 'ok'}")
                break
            wrong = _differences(outcome.state, base, after)
            if wrong:
                mismatches.append(f"{text!r} ({verdict}): {wrong}")
                break
            state = outcome.state
    return mismatches


@pytest.mark.parametrize("version", CORPUS_VERSIONS)
def test_the_model_answers_as_torch_did(version: str) -> None:
    data = recorded()
    base, rows = data["results"][version]
    mismatches = _replay(version, data["cases"], base, rows)
    assert not mismatches, "\n".join(mismatches[:20])


@cache
def generated() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(gzip.decompress(GENERATED.read_bytes()))
    return data


GENERATED_VERSIONS: list[str] = sorted(generated()["results"], key=_version)


def test_the_generated_recording_is_of_the_generator_as_it_is() -> None:
    data = generated()
    cases = generated_cases(data["seed"], data["count"])
    assert cases_digest(cases) == data["digest"] == cases_digest(data["cases"]), (
        "generate.py changed: re-record (python -m tests.torch_parser.record WORK --generated ...)"
    )
    strings = sum(len(c["sets"]) + len(c["env"]) for c in cases)
    assert strings >= 20_000
    assert list(RECORDED_VERSIONS) == GENERATED_VERSIONS


@pytest.mark.parametrize("version", GENERATED_VERSIONS)
def test_the_model_answers_generated_strings_as_torch_did(version: str) -> None:
    data = generated()
    base, rows = data["results"][version]
    mismatches = _replay(version, data["cases"], base, rows)
    assert not mismatches, f"{len(mismatches)} cases differ:\n" + "\n".join(mismatches[:25])


@pytest.mark.parametrize(
    ("version", "env", "reads", "ignored"),
    [
        ((2, 9), {CUDA_ALLOC_CONF: "a", ALLOC_CONF: "b"}, CUDA_ALLOC_CONF, [ALLOC_CONF]),
        ((2, 9), {ALLOC_CONF: "b"}, None, [ALLOC_CONF]),
        ((2, 10), {CUDA_ALLOC_CONF: "a", ALLOC_CONF: "b"}, CUDA_ALLOC_CONF, [ALLOC_CONF]),
        ((2, 11), {CUDA_ALLOC_CONF: "", ALLOC_CONF: "b"}, CUDA_ALLOC_CONF, [ALLOC_CONF]),
        ((2, 13), {ALLOC_CONF: "b"}, ALLOC_CONF, []),
        ((2, 13), {}, None, []),
    ],
)
def test_which_variable_torch_reads(
    version: tuple[int, int], env: dict[str, str], reads: str | None, ignored: list[str]
) -> None:
    assert TorchRules(version).env_variable(env) == (reads, ignored)


def test_documented_rules_by_example() -> None:
    # What the issue reports, as the model says it (each also in the recording).
    r211 = TorchRules((2, 11))
    assert r211.run("roundup_power2_divisions:[256:4,>:1,]").accepted  # trailing comma in a list
    refused = r211.run("large_segment_size_mb:64,max_split_size_mb:32")
    assert refused.error == (
        "torch 2.11 refuses max_split_size_mb:32: must be >= 64 (large_segment_size_mb)"
    )
    assert not r211.run("pinned_reserve_segment_size_mb:0").accepted
    assert r211.default_text("pinned_reserve_segment_size_mb") is None  # cannot be put back
    assert TorchRules((2, 9)).default_text("max_non_split_rounding_mb") is None  # must be > 20
    assert not r211.run("a:b,,c:d").accepted  # empty items are refused with a CUDA parser
    half = r211.run("garbage_collection_threshold:0.5,expandable_segments:True,max_split_size_mb:5")
    assert not half.accepted
    assert half.state["expandable_segments"] is True
    lenient = r211.run("expandable_segments,True")  # separators are counted, not checked
    assert lenient.accepted
    assert lenient.state["expandable_segments"] is True
    assert lenient.notes
    assert r211.run("max_split_size_mb:25.5").state["max_split_size_mb"] == 25


def test_the_cpu_build_here_agrees_with_the_model() -> None:
    """This torch's real setter (CPU build: the generic parser, no CUDA parser)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None or _torch.cuda_built():
        pytest.skip("needs a CPU-only build of torch 2.10 or newer")
    rules = TorchRules(_torch.torch_version(), device=False)
    strings = list(CURATED_STRINGS) + [t for case in corpus() for t in case["sets"]]
    wrong, _ = _judge_live(setter, rules, strings)
    assert not wrong, "\n".join(wrong[:20])


def _judge_live(setter: Any, rules: TorchRules, strings: Iterable[str]) -> tuple[list[str], int]:
    """Give ``strings`` to torch's own setter and to the model in turn; their disagreements.

    In one process, from torch's defaults (whatever earlier tests left), so what a call
    keeps from the one before counts; torch's defaults are put back at the end.
    """
    reset = "expandable_segments:False,pinned_use_background_threads:False"
    if "large_segment_size_mb" in rules.keys:
        reset += ",large_segment_size_mb:20"
    state = rules.run(reset, default_state(rules.version, device=rules.device)).state
    setter(reset)
    wrong: list[str] = []
    checked = 0
    try:
        for text in strings:
            try:
                setter(text)
                took = True
            except (ValueError, RuntimeError, IndexError):  # IndexError: std::out_of_range
                took = False
            outcome = rules.run(text, state)
            checked += 1
            if took != outcome.accepted:
                verdict = "takes" if took else "refuses"
                wrong.append(f"{text!r}: torch {verdict} it; model: {outcome.error or 'takes it'}")
            state = outcome.state
    finally:
        setter(reset)
    return wrong, checked


def test_a_live_oracle_the_installed_torch_judges_generated_strings() -> None:
    """The installed torch's own parser against the model, on a fresh seed each run.

    Chains of generated strings go to torch's setter in this process (what a call
    keeps from the one before counts) and to the model; they must agree on every
    one. The seed is new each run and printed on failure (set HYBRIDMEM_ORACLE_SEED
    to replay one), so a new torch is checked the day CI installs it.
    """
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        pytest.skip("needs torch 2.10 or newer (its settings setter)")
    seed = int(os.environ.get("HYBRIDMEM_ORACLE_SEED") or secrets.randbits(32))
    rules = TorchRules(_torch.torch_version(), device=_torch.cuda_built())
    strings = [text for case in generated_cases(seed, 1000) for text in case["sets"]]
    wrong, checked = _judge_live(setter, rules, strings)
    assert checked > 2500
    assert not wrong, (
        f"torch {torch.__version__} and the model disagree on {len(wrong)} of {checked} strings "
        f"(HYBRIDMEM_ORACLE_SEED={seed} replays them):\n" + "\n".join(wrong[:20])
    )


@settings(max_examples=200, deadline=None)
@given(
    text=settings_strings,
    version=st.sampled_from([_version(v) for v in RECORDED_VERSIONS] + [(2, 16)]),
    device=st.booleans(),
    start_up=st.booleans(),
)
def test_the_model_answers_every_generated_string_without_raising(
    text: str, version: tuple[int, int], device: bool, start_up: bool
) -> None:
    """Taken, refused or an abort at import: never an exception from the model itself."""
    rules = TorchRules(version, device, None if start_up else "native")
    outcome = rules.run(text)
    assert outcome.accepted == (outcome.error is None)
    assert not outcome.aborts or (start_up and device and not outcome.accepted)


@pytest.mark.parametrize("version", [(2, 4), (2, 11), (2, 15)])
def test_an_unknown_key_close_to_a_known_one_is_named_in_the_refusal(
    version: tuple[int, int],
) -> None:
    error = TorchRules(version).run("expandable_segment:True").error
    assert error is not None
    assert "does not know the setting 'expandable_segment'" in error
    assert error.endswith("(did you mean 'expandable_segments'?)")
    assert "did you mean" not in (TorchRules(version).run("foo:1").error or "")


def _near_the_subnormal_edge(seed: int, count: int) -> list[str]:
    """Decimal and hexadecimal numbers around the smallest normal double, and below it."""
    import random

    rnd = random.Random(seed)
    numbers = ["0x1p-1030", "0x1p-1074", "0x1.fffffffffffffp-1023", "0x1.00000000000008p-1023"]
    for _ in range(count):
        exponent = rnd.randint(-1080, -1018)
        digits = "".join(rnd.choice("0123456789abcdef") for _ in range(rnd.randint(0, 16)))
        lead = rnd.choice("1111" + "0123456789abcdef")
        numbers.append(f"0x{lead}.{digits}p{exponent}")
        mantissa = f"{rnd.randint(1, 9)}.{rnd.randint(0, 10 ** rnd.randint(0, 17))}"
        numbers.append(f"{mantissa}e-{rnd.randint(305, 330)}")
    return [f"garbage_collection_threshold:{number}" for number in numbers]


def _listen(setter: Any, text: str) -> tuple[bool, bool]:
    """Give ``text`` to torch's setter: (taken, a reserve value ignored with a warning).

    torch 2.15 takes a bad reserve and warns on stderr (its C++ log, not Python's
    warnings), keeping its default: the warning is read from file descriptor 2.
    """
    with tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            try:
                setter(text)
                took = True
            except (ValueError, RuntimeError, IndexError):
                took = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        return took, TORCH_IGNORES in caught.read()


TORCH_IGNORES = b"Ignoring invalid expandable-segment reserve value"


def _ignored_reserve(notes: Iterable[str]) -> bool:
    return any(IGNORED_RESERVE in note for note in notes)


# What torch 2.15.0+cu132's own setter answered (taken, warned that it ignores a reserve
# value), from a default state: the reserve keys' reader (parseExpandableSegmentsReserve
# and ...ByClass) reads over a missing ":" or "[", runs a list to its "]" and warns on a
# value that is not a positive finite number (a trailing G: GiB).
RESERVE_VERDICTS = [
    ("expandable_segments_reserve:0.5", True, False),
    ("expandable_segments_reserve:40G", True, False),
    ("expandable_segments_reserve:40g", True, False),
    ("expandable_segments_reserve:2", True, False),
    ("expandable_segments_reserve:.5", True, False),
    ("expandable_segments_reserve:5.", True, False),
    ("expandable_segments_reserve:1.e5", True, False),
    ("expandable_segments_reserve:1e-320", True, False),
    ("expandable_segments_reserve:1e-400", True, True),
    ("expandable_segments_reserve:1e400", True, True),
    ("expandable_segments_reserve:-1", True, True),
    ("expandable_segments_reserve:0", True, True),
    ("expandable_segments_reserve:0x10", True, True),
    ("expandable_segments_reserve:inf", True, True),
    ("expandable_segments_reserve:nan", True, True),
    ("expandable_segments_reserve:G", True, True),
    ("expandable_segments_reserve:0.5gG", True, True),
    ("expandable_segments_reserve:abc", True, True),
    ("expandable_segments_reserve:[]", True, True),
    ("expandable_segments_reserve:[64:4]", False, True),
    ("expandable_segments_reserve:", False, False),
    ("expandable_segments_reserve:0.5,expandable_segments:True", True, False),
    ("expandable_segments_reserve:0.5x,max_split_size_mb:64", True, True),
    ("expandable_segments_reserve_by_class:[a:0.5,b:8G]", True, False),
    ("expandable_segments_reserve_by_class:[]", True, False),
    ("expandable_segments_reserve_by_class:[a:0.5,]", True, False),
    ("expandable_segments_reserve_by_class:[a:bad]", True, True),
    ("expandable_segments_reserve_by_class:[a]", False, False),
    ("expandable_segments_reserve_by_class:[a:0.5", False, False),
    ("expandable_segments_reserve_by_class:[:]", False, False),
    ("expandable_segments_reserve_by_class:[,]", False, False),
    ("expandable_segments_reserve_by_class:[a:0.5b:1]", False, True),
    ("expandable_segments_reserve_by_class:64", False, False),
    ("expandable_segments_reserve_by_class:64,[a:1]", False, False),
    ("expandable_segments_reserve_by_class:[a:0.5,,b:1]", False, True),
    ("expandable_segments_reserve_by_class:[a:0.5],expandable_segments:True", True, False),
    ("expandable_segments_reserve_by_class:", False, False),
    ("expandable_segments_reserve_by_class[a:1]", False, False),
]


@pytest.mark.parametrize(("text", "takes", "ignored"), RESERVE_VERDICTS)
def test_the_model_reads_the_reserve_keys_as_torch_215_did(
    text: str, takes: bool, ignored: bool
) -> None:
    outcome = TorchRules((2, 15), device=True).run(text)
    assert (outcome.accepted, _ignored_reserve(outcome.notes)) == (takes, ignored), outcome


def _reserve_strings(seed: int, count: int) -> list[str]:
    """Settings strings around the 2.15 reserve keys: values, lists and broken lists."""
    import random

    rnd = random.Random(seed)
    values = ["0.5", "40G", "8g", "2", ".5", "1e-320", "1e-400", "-1", "0", "inf", "0x10"]
    values += ["abc", "G", "", "[", "]", ":", ","]
    names = ["a", "serving", "64", ">", ""]
    out = []
    for _ in range(count):
        if rnd.random() < 0.5:
            text = f"expandable_segments_reserve:{rnd.choice(values)}"
        else:
            items = [
                rnd.choice(names) + rnd.choice([":", ":", ""]) + rnd.choice(values)
                for _ in range(rnd.randrange(4))
            ]
            body = rnd.choice([",", ",", ",,", ""]).join(items)
            text = "expandable_segments_reserve_by_class:" + rnd.choice(["[", "[", ""]) + body
            text += rnd.choice(["]", "]", "", ",]"])
        text += rnd.choice(["", "", ",expandable_segments:False", ",max_split_size_mb:64"])
        out.append(text)
    return out


def test_a_live_oracle_judges_the_reserve_keys() -> None:
    """The installed torch's reserve keys against the model: taken, and ignored with a warning."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    rules = TorchRules(_torch.torch_version(), device=_torch.cuda_built())
    if setter is None or "expandable_segments_reserve" not in rules.keys:
        pytest.skip("needs a CUDA build of torch 2.15 or newer (its reserve keys)")
    seed = int(os.environ.get("HYBRIDMEM_ORACLE_SEED") or secrets.randbits(32))
    wrong = []
    try:
        for text in _reserve_strings(seed, 600):
            setter("expandable_segments:False")
            outcome = rules.run(text)
            seen = _listen(setter, text)
            if seen != (outcome.accepted, _ignored_reserve(outcome.notes)):
                wrong.append(f"{text!r}: torch (taken, ignored)={seen}; model {outcome}")
    finally:
        setter("expandable_segments:False")
    assert not wrong, f"HYBRIDMEM_ORACLE_SEED={seed}:\n" + "\n".join(wrong[:20])


def test_a_live_oracle_judges_numbers_at_the_subnormal_edge() -> None:
    """Tiny and inexact is refused, exactly representable is taken, as this torch's stod."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        pytest.skip("needs torch 2.10 or newer (its settings setter)")
    seed = int(os.environ.get("HYBRIDMEM_ORACLE_SEED") or secrets.randbits(32))
    rules = TorchRules(_torch.torch_version(), device=_torch.cuda_built())
    wrong, checked = _judge_live(setter, rules, _near_the_subnormal_edge(seed, 1500))
    assert checked > 3000
    assert not wrong, f"HYBRIDMEM_ORACLE_SEED={seed}:\n" + "\n".join(wrong[:20])


def _typed_values(seed: int, count: int) -> list[tuple[str, object]]:
    """(key, Python value) pairs as a user passes them to hm.allocator_settings."""
    import random

    from hybridmem.allocator.grammar import KEYS

    rnd = random.Random(seed)
    odd = ["", " ", "\t", "\x1c", "\x1f", "\xa0", "\u3000", "\n"]
    strings = ["True", "False", "true", "1", "0", "20", "64", "512", "-5", "0.5", "25.5"]
    strings += [
        "0x10",
        "\uff16\uff14",
        "1e3",
        "inf",
        "nan",
        "0x1p-1030",
        "1e-320",
        "[1:2]",
        "[>:4]",
    ]
    values: list[object] = [True, False, 0, 1, -5, 10, 20, 21, 64, 2**40, 2**70, 0.5, 1.5, 1e-320]
    values += [math.nan, math.inf, -0.0, float.fromhex("0x1p-1030"), {64: 4, ">": 2}, None]
    keys = [key for key, spec in KEYS.items() if spec.runtime]
    pairs: list[tuple[str, object]] = []
    for _ in range(count):
        key = rnd.choice(keys)
        if rnd.random() < 0.5:
            pairs.append((key, rnd.choice(odd) + rnd.choice(strings) + rnd.choice(odd)))
        else:
            pairs.append((key, rnd.choice(values)))
    return pairs


def test_a_live_oracle_judges_the_typed_path() -> None:
    """hm.allocator_settings(key=value): what it takes, the installed torch takes too.

    A string goes to torch as written: hybridmem takes it exactly when torch does,
    but for a number with more after it than C's whitespace, which torch reads as
    something else ("-5" wraps around 2**64, "25.5" is cut to 25, "0.5\x1c" is 0.5)
    and the typed path refuses. Nothing is taken that torch refuses.
    """
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        pytest.skip("needs torch 2.10 or newer (its settings setter)")
    from hybridmem.allocator.grammar import KEYS, normalize_value

    seed = int(os.environ.get("HYBRIDMEM_ORACLE_SEED") or secrets.randbits(32))
    rules = TorchRules(_torch.torch_version(), device=_torch.cuda_built())
    reset = "expandable_segments:False,pinned_use_background_threads:False"
    if "large_segment_size_mb" in rules.keys:
        reset += ",large_segment_size_mb:20"
    kinds = {key: spec.kind for key, spec in KEYS.items()}
    whole = {"int": re.compile("[0-9]+"), "float": FLOAT_PREFIX}
    wrong: list[str] = []
    checked = 0
    setter(reset)
    for key, value in _typed_values(seed, 3000):
        if key not in rules.keys:
            continue
        try:
            text: str | None = normalize_value(key, value, rules)
        except (TypeError, ValueError):
            text = None
        written = value if isinstance(value, str) else text
        if written is None:
            continue  # refused before any string: a typed value torch has no words for
        try:
            took, ignored = _listen(setter, f"{key}:{written}")
            took = took and not ignored  # a reserve torch ignores (with a warning) is not set
        finally:
            setter(reset)
        checked += 1
        if text is not None and not took:
            wrong.append(f"{key}={value!r}: hybridmem takes it as {text!r}; torch refuses")
        elif text is None and took and isinstance(value, str):
            number = whole.get(kinds[key])
            bare = "".join(ch for ch in value if ch not in C_SPACE)
            if number is None or number.fullmatch(bare):
                wrong.append(f"{key}={value!r}: torch takes it; hybridmem refuses")
    assert checked > 500
    assert not wrong, f"HYBRIDMEM_ORACLE_SEED={seed}:\n" + "\n".join(wrong[:20])


@pytest.mark.parametrize(
    ("key", "value", "torch_takes"),
    [
        ("expandable_segments", "True\x1f", False),
        ("expandable_segments", "True\xa0", False),
        ("pinned_use_background_threads", "True\x1f", False),
        ("expandable_segments", " True\t", True),
    ],
)
def test_the_typed_path_strips_only_cs_whitespace(key: str, value: str, torch_takes: bool) -> None:
    from hybridmem.allocator.grammar import normalize_value

    rules = TorchRules((2, 13))
    if torch_takes:
        assert normalize_value(key, value, rules) == "True"
    else:
        with pytest.raises(ValueError, match="refuses"):
            normalize_value(key, value, rules)


@pytest.mark.parametrize(
    ("number", "takes"),
    [
        ("0x1p-1030", True),  # exactly representable: strtod sets no ERANGE
        ("0x1p-1074", True),
        ("0x1p-1075", False),  # underflows to zero
        ("0x1.fffffffffffffp-1023", False),  # tiny after rounding, and inexact
        ("0x1.fffffffffffff8p-1023", True),  # rounds up to the smallest normal
        ("1e-320", False),
    ],
)
def test_subnormal_numbers_as_strtod_reads_them(number: str, takes: bool) -> None:
    outcome = TorchRules((2, 13)).run(f"garbage_collection_threshold:{number}")
    assert outcome.accepted is takes, outcome.error


def test_a_negative_size_names_the_real_bound() -> None:
    from hybridmem.allocator.grammar import normalize_value

    with pytest.raises(ValueError, match=r"which must be >= 20 .*got -5"):
        normalize_value("max_split_size_mb", -5, TorchRules((2, 13)))


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("expandable_segments_reserve", 0.5, "0.5"),
        ("expandable_segments_reserve", 2, "2"),
        ("expandable_segments_reserve", " 40G\t", "40G"),
        (
            "expandable_segments_reserve_by_class",
            {"capture": 0.25, "ws": "8G"},
            "[capture:0.25,ws:8G]",
        ),
        ("expandable_segments_reserve_by_class", {}, "[]"),
        ("expandable_segments_reserve_by_class", "[a:0.5]", "[a:0.5]"),
    ],
)
def test_the_typed_path_writes_a_reserve_torch_215_reads(
    key: str, value: object, text: str
) -> None:
    from hybridmem.allocator.grammar import normalize_value

    assert normalize_value(key, value, TorchRules((2, 15), device=True)) == text


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        # torch would take these and ignore them with a warning: a typed call refuses
        ("expandable_segments_reserve", "abc", ValueError, r"ignored by torch.*e\.g\."),
        ("expandable_segments_reserve", -1.0, ValueError, "positive fraction"),
        ("expandable_segments_reserve", math.nan, ValueError, "ignored by torch"),
        ("expandable_segments_reserve", "[a:1]", ValueError, "does not know the setting ':'"),
        ("expandable_segments_reserve", True, TypeError, "fraction of the device"),
        ("expandable_segments_reserve_by_class", {"a": "x"}, ValueError, r"\[a\]:x is ignored"),
        ("expandable_segments_reserve_by_class", {"a:b": 1}, ValueError, "class names without"),
        ("expandable_segments_reserve_by_class", {7: 1}, ValueError, "class names without"),
        ("expandable_segments_reserve_by_class", {"a": [1]}, TypeError, "fraction of the device"),
        ("expandable_segments_reserve_by_class", " 64", ValueError, "ran out of tokens"),
        ("expandable_segments_reserve_by_class", 0.5, TypeError, "mapping of class name"),
    ],
)
def test_the_typed_path_refuses_a_reserve_torch_would_ignore_or_refuse(
    key: str, value: object, error: type[Exception], match: str
) -> None:
    from hybridmem.allocator.grammar import normalize_value

    with pytest.raises(error, match=match):
        normalize_value(key, value, TorchRules((2, 15), device=True))


def test_a_reserve_key_on_a_torch_before_215_names_the_version() -> None:
    from hybridmem.allocator.grammar import normalize_value

    with pytest.raises(ValueError, match=r"torch 2\.15 added it"):
        normalize_value("expandable_segments_reserve", 0.5, TorchRules((2, 14), device=True))


@pytest.mark.parametrize(
    ("token", "spec"),
    [
        ("0.5", (True, 0.5)),
        ("40G", (False, 40.0)),
        ("8g", (False, 8.0)),
        ("+.5", (True, 0.5)),
        ("1.e2", (True, 100.0)),
        ("1e-320", (True, 1e-320)),  # a subnormal: libstdc++'s num_get keeps it
        ("1e-400", None),  # underflows to 0, not > 0
        ("1e400", None),  # overflows
        ("0x10", None),  # num_get reads no hex
        ("inf", None),
        ("-1", None),
        ("G", None),
        ("0.5gG", None),
        ("", None),
    ],
)
def test_a_reserve_value_as_torch_215_reads_it(token: str, spec: tuple[bool, float] | None) -> None:
    from hybridmem.allocator.cparse import reserve_spec

    assert reserve_spec(token) == spec
