"""Real CUDA behaviour on a GPU (run on the H200: ``pytest -m gpu tests/gpu``).

Each scenario runs in a fresh interpreter because allocator state is
process-global; the scenario prints its facts as JSON and the test asserts on them.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.gpu.runner import run_scenario

pytestmark = pytest.mark.gpu

USER_ENV = "max_split_size_mb:256,garbage_collection_threshold:0.6,roundup_power2_divisions:4"
MiB = 1 << 20


def test_a_segment_kind_follows_the_toggle() -> None:
    facts = run_scenario("segments")
    assert facts["on"] is True
    assert facts["nested_off"] is False
    assert facts["back_on"] is True
    assert facts["off"] is False
    # the scenario is real: without the release, the cached classic block is reused
    assert facts["without_release"] is False
    assert facts["with_release"] is True
    assert facts["decorated"] is True
    assert facts["after_decorated"] is False


def _roundup_all(value: Any, expected: int) -> bool:
    """torch reports the divisions per size interval (a list or a dict) or as one int."""
    if isinstance(value, dict):
        values = list(value.values())
    elif isinstance(value, (list, tuple)):
        values = list(value)
    else:
        values = [value]
    return bool(values) and all(int(v) == expected for v in values)


def _user_settings_kept(snap: dict[str, Any]) -> bool:
    return (
        int(snap["max_split_size"]) == 256 * MiB
        and abs(float(snap["garbage_collection_threshold"]) - 0.6) < 1e-9
        and _roundup_all(snap["roundup_power2_divisions"], 4)
    )


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_b_user_settings_survive_toggle_and_exit(var: str) -> None:
    facts = run_scenario("settings", **{var: USER_ENV})
    for phase, expandable in (
        ("start", False),
        ("inside_true", True),
        ("inside_false", False),
        ("after", False),
    ):
        snap = facts[phase]
        assert _user_settings_kept(snap), (phase, snap)
        assert bool(snap["expandable_segments"]) is expandable, (phase, snap)
    # the negative control: torch's own setter drops all three
    assert not _user_settings_kept(facts["raw_setter"])


@pytest.mark.parametrize(
    "scenario",
    ["release_training_expandable", "release_training_classic", "release_scattered_expandable"],
)
def test_c_release_hands_back_what_is_not_live(scenario: str) -> None:
    facts = run_scenario(scenario)
    print(
        f"\n{scenario}: free/(total-live-context) = {facts['ratio']:.4f} "
        f"(plain empty_cache: {facts['plain_ratio']:.4f}); {facts['report']}"
    )
    assert facts["kept"] > 100  # live tensors really are spread over many segments
    assert facts["gc_rounds"] >= 1
    # the tensor held only by a reference cycle is freed by release_cache, not empty_cache
    assert facts["ratio"] > facts["plain_ratio"]
    # the 1 GiB held by the cycle comes back (less its edge pages under expandable
    # segments, which it shares with live neighbours: at most two 20 MiB pages)
    assert facts["returned"] >= (1 << 30) - 2 * 20 * MiB
    # Every byte not pinned by a live tensor's block goes back: reserved after the
    # release exceeds allocated only by the unused parts of blocks and pages that
    # live tensors share (classic blocks are rounded to 2 MiB; expandable segments
    # map 20 MiB pages, so with ~600 live tensors of odd sizes up to ~3 GiB stays
    # mapped, which no release can return without moving live tensors).
    # So what stays reserved is bounded by one 20 MiB page or block per live tensor.
    after = facts["after"]
    assert after["reserved"] - after["allocated"] <= facts["kept"] * 20 * MiB
    if scenario == "release_training_classic":
        assert facts["ratio"] >= 0.99


@pytest.mark.multi_gpu
def test_d_release_on_device_1_creates_no_context_on_device_0() -> None:
    facts = run_scenario("devices")
    assert facts["count"] >= 2
    assert facts["ctx1_before"] is True
    assert facts["ctx0_before"] is False
    assert facts["released_devices"] == [1]
    assert facts["all_devices"] == [1]
    assert facts["info_device"] == 1
    assert facts["ctx0_after"] is False
