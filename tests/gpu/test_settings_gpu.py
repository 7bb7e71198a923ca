"""torch's allocator-settings rules on a real GPU (issue #11; run on the H200).

The CUDA parser of the torch on the GPU machine is asked directly (its snapshot
says what it applied), against the model in :mod:`hybridmem._torch_rules` and
against what hybridmem's scopes do with it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.gpu.runner import run_scenario
from tests.gpu.test_allocator_gpu import MiB

pytestmark = pytest.mark.gpu

MODULE = "tests.gpu.settings_scenarios"
# snapshot name (torch 2.11) -> (model key, how the model's value reads in the snapshot)
_SNAPSHOT: dict[str, tuple[str, Any]] = {
    "max_split_size": ("max_split_size_mb", lambda v: -1 if v is None else v * MiB),
    "garbage_collection_threshold": ("garbage_collection_threshold", float),
    "expandable_segments": ("expandable_segments", bool),
    "release_lock_on_cudamalloc": ("release_lock_on_cudamalloc", bool),
    "pinned_use_cuda_host_register": ("pinned_use_cuda_host_register", bool),
    "pinned_num_register_threads": ("pinned_num_register_threads", int),
    "graph_capture_record_stream_reuse": ("graph_capture_record_stream_reuse", bool),
    # {"1": d, "2": d, ..., "32768": d}: the division of each interval, by MB
    "roundup_power2_divisions": (
        "roundup_power2_divisions",
        lambda v: {str(1 << i): d for i, d in enumerate(v)},
    ),
}


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(ours, dict):
        return {str(k): int(v) for k, v in theirs.items()} == ours
    if isinstance(ours, float) or isinstance(theirs, float):
        return math.isclose(float(theirs), float(ours), rel_tol=1e-6)
    if isinstance(ours, bool):
        return bool(theirs) is ours
    return bool(int(theirs) == int(ours))


def test_torch_cuda_parser_agrees_with_the_model_string_by_string() -> None:
    facts = run_scenario("parser", MODULE)
    rows = facts["rows"]
    verdicts = [r for r in rows if r["torch"] != r["model"]]
    assert not verdicts, verdicts[:5]
    compared = 0
    wrong = []
    for row in rows:
        snap = row["snapshot"]
        for name, (key, convert) in _SNAPSHOT.items():
            if name in snap and key in row["state"]:
                value = row["state"][key]
                if name == "max_split_size" and value is not None and value >= 1 << 40:
                    continue  # "unlimited" either way; torch shows SIZE_MAX rounded to MB
                compared += 1
                if not _same(snap[name], convert(value)):
                    wrong.append((row["text"], name, snap[name], value))
    accepted = sum(r["torch"] for r in rows)
    print(
        f"\ntorch {facts['torch']}: {len(rows)} strings, {accepted} taken, "
        f"{len(rows) - accepted} refused, all as the model says; {compared} settings "
        f"read back from the snapshot, {len(wrong)} differ"
    )
    assert compared > len(rows)
    assert not wrong, wrong[:5]


def test_both_variables_set_follow_torch_not_a_merge() -> None:
    facts = run_scenario(
        "env_both",
        MODULE,
        PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512,garbage_collection_threshold:0.6",
        PYTORCH_ALLOC_CONF="expandable_segments:True",
    )
    start = facts["torch_at_start"]
    assert start["expandable_segments"] is False  # what torch read: the CUDA variable only
    for phase in ("torch_at_start", "inside_false", "after_false", "inside_true", "after_true"):
        snap = facts[phase]
        assert int(snap["max_split_size"]) == 512 * MiB, (phase, snap)
        assert abs(float(snap["garbage_collection_threshold"]) - 0.6) < 1e-9, (phase, snap)
    assert facts["after_false"]["expandable_segments"] is False
    assert facts["inside_true"]["expandable_segments"] is True
    assert facts["tensor_inside_true"] is True
    assert facts["after_true"]["expandable_segments"] is False  # torch never had them on
    assert facts["tensor_after"] is False
    assert facts["variable"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert facts["ignored"] == ["PYTORCH_ALLOC_CONF"]


def test_a_default_torch_refuses_is_never_written_back() -> None:
    facts = run_scenario("unrestorable", MODULE)
    assert "entered" not in facts
    assert "cannot go back to its default" in facts["refused"]
    assert facts["torch_takes_zero"] is False  # the evidence: torch refuses its own default
    assert facts["inside_true"] is True
    assert facts["after_true"] is False
    assert facts["scoped_over_default"] is True
    assert facts["toggle_after_defaults"] is True


def test_a_half_applied_refused_string_is_rolled_back() -> None:
    facts = run_scenario(
        "rollback",
        MODULE,
        PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:256,roundup_power2_divisions:4",
    )
    assert "entered" not in facts
    assert "put the settings before it back" in facts["error"]
    start, after = facts["start"], facts["after"]
    for key in ("max_split_size", "garbage_collection_threshold", "expandable_segments"):
        assert after[key] == start[key], (key, start, after)
    assert after["expandable_segments"] is False  # torch had taken expandable_segments:True
    assert facts["next_inside"]["expandable_segments"] is True
    assert int(facts["next_inside"]["max_split_size"]) == 256 * MiB
    assert facts["next_after"]["expandable_segments"] is False


def test_a_malformed_env_value_is_one_clear_error() -> None:
    facts = run_scenario("malformed", MODULE, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:abc")
    for key in ("error", "scope_error"):
        assert facts[key].startswith("PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:abc': "), facts
        assert "fix it or unset PYTORCH_CUDA_ALLOC_CONF" in facts[key]


def test_the_write_watch_starts_on_this_torch_build() -> None:
    """torch 2.10 - 2.11: nothing on a real CUDA build keeps the watch from starting.

    CPython 3.12 keeps an init-time copy of ``torch._C``'s namespace that holds torch's
    setter; taken for a caller that bypasses the watch, it kept every scope on the
    snapshot (a walk of every live block).
    """
    facts = run_scenario("watch_starts", MODULE)
    major, minor = (int(p) for p in facts["torch"].split(".")[:2])
    if not (2, 10) <= (major, minor) < (2, 12):
        pytest.skip(f"torch {facts['torch']} reads the string without a watch")
    assert facts["watched"] is True, facts["captured"]
    assert facts["captured"] == []
