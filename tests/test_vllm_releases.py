"""What each vLLM release's sleep-mode pool does with the settings, as the doctor says it."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from hybridmem.integrations.vllm import releases
from hybridmem.integrations.vllm.sleep_state import asleep_bytes

ON = "expandable_segments:True,max_split_size_mb:256"


@pytest.mark.parametrize(
    ("version", "band", "expandable", "flag"),
    [
        ("0.10.1", "0.8-0.19", "asserts", False),
        ("0.22.0", "0.22-0.24", "bare toggle", False),
        ("0.24.0", "0.22-0.24", "bare toggle", False),  # verl 0.9.1's vllm extra
        ("0.29.0", "0.25-0.30", "bare toggle", True),  # OpenRLHF 0.11.2's pin
        ("0.31.0", "0.31+", "keeping toggle", True),  # TRL 1.16.0's newest
        ("0.33.0", "0.31+", "keeping toggle", True),
    ],
)
def test_each_release_falls_in_the_band_its_wheel_was_read_in(
    version: str, band: str, expandable: str, flag: bool
) -> None:
    found = releases.release_of(version)
    assert found is not None
    assert (found.name(), found.expandable, found.asleep_flag) == (band, expandable, flag)


def test_releases_not_read_are_said_so() -> None:
    assert releases.release_of("0.20.1") is None
    assert releases.release_of("nightly") is None
    (said,) = releases.pool_notes("0.21.0", {})
    assert "a release hybridmem has not read" in said


def test_what_applies_follows_the_release() -> None:
    old, new = releases.pool_notes("0.22.0", {})[0], releases.pool_notes("0.33.0", {})[0]
    assert "weight-transfer backend needs vLLM 0.32+" in old
    assert "PoolBackup needs vLLM 0.25+" in old
    assert "the weight-transfer backend applies; PoolBackup applies" in new
    assert "--sleep-mode-backend hybridmem applies" in new
    assert "--sleep-mode-backend hybridmem needs vLLM 0.33" in old


@pytest.mark.parametrize(
    ("version", "env", "says"),
    [
        ("0.19.0", {"PYTORCH_CUDA_ALLOC_CONF": ON}, "asserts 'Expandable segments are not"),
        ("0.29.0", {"PYTORCH_CUDA_ALLOC_CONF": ON}, "writes expandable_segments:False alone"),
        ("0.29.0", {"PYTORCH_ALLOC_CONF": ON}, "reads only PYTORCH_CUDA_ALLOC_CONF"),
        ("0.19.0", {"PYTORCH_ALLOC_CONF": ON}, "reads only PYTORCH_CUDA_ALLOC_CONF"),
        ("0.31.0", {"PYTORCH_ALLOC_CONF": ON}, "keeping your other settings"),
    ],
)
def test_expandable_segments_in_the_env_get_the_releases_own_note(
    version: str, env: dict[str, str], says: str
) -> None:
    notes = releases.pool_notes(version, env)
    assert len(notes) == 2
    assert says in notes[1]


def test_nothing_in_the_env_is_no_problem() -> None:
    assert (
        len(releases.pool_notes("0.29.0", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})) == 1
    )


@dataclass
class Record:
    handle: tuple[int, int, int, int]
    tag: str


@dataclass
class Flagged(Record):
    is_asleep: bool = True


@pytest.mark.parametrize("flagged", [True, False], ids=["0.25+", "0.22-0.24"])
def test_asleep_bytes_reads_the_pools_records(
    monkeypatch: pytest.MonkeyPatch, flagged: bool
) -> None:
    make = Flagged if flagged else Record
    records = {
        1: make((0, 100, 1, 0), "kv_cache"),
        2: make((0, 50, 2, 0), "kv_cache"),
        3: make((0, 70, 3, 0), "weights"),
    }
    if flagged:
        records[2].is_asleep = False  # type: ignore[attr-defined]  # awake: a wake maps nothing
    allocator = types.SimpleNamespace(pointer_to_data=records)
    module = types.ModuleType("vllm.device_allocator.cumem")
    module.CuMemAllocator = types.SimpleNamespace(instance=allocator)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", module)
    assert asleep_bytes("kv_cache") == (100 if flagged else 150)
    assert asleep_bytes("weights") == 70
    records[4] = make(("?",), "kv_cache")  # type: ignore[arg-type]
    assert asleep_bytes("kv_cache") is None  # a record it cannot read: it says nothing


def test_asleep_bytes_without_a_pool_is_none() -> None:
    if "vllm.device_allocator.cumem" in sys.modules:
        pytest.skip("vLLM's pool is loaded in this process")
    assert asleep_bytes("kv_cache") is None
