"""vLLM's sleep state as hybridmem reads it: a stand-in for vLLM's allocator module."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest

from hybridmem.integrations.vllm.sleep_state import (
    EngineAsleepError,
    asleep_tags,
    refuse_while_asleep,
)


@dataclass
class _Record:  # what vLLM's AllocationData holds that hybridmem reads
    tag: str
    is_asleep: bool = False


def _pool(monkeypatch: pytest.MonkeyPatch, records: dict[int, _Record]) -> None:
    allocator = types.SimpleNamespace(pointer_to_data=records)
    module = types.ModuleType("vllm.device_allocator.cumem")
    module.CuMemAllocator = types.SimpleNamespace(instance=allocator)  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "vllm.device_allocator.cumem", module)


def test_no_pool_means_nothing_asleep_and_nothing_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(__import__("sys").modules, "vllm.device_allocator.cumem", raising=False)
    assert asleep_tags() == frozenset()
    refuse_while_asleep("weights", "a weight update")


def test_a_weight_update_into_sleeping_weights_is_refused_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = {1: _Record("weights", True), 2: _Record("kv_cache", True)}
    _pool(monkeypatch, records)
    assert asleep_tags() == {"weights", "kv_cache"}
    with pytest.raises(EngineAsleepError, match=r"wake_up\(tags=\['weights'\]\)") as info:
        refuse_while_asleep("weights", "a weight update")
    assert "nothing was received or written" in str(info.value)
    records[1].is_asleep = False  # the weights woke, the KV cache sleeps on
    refuse_while_asleep("weights", "a weight update")
    with pytest.raises(EngineAsleepError, match="'kv_cache' memory sleeps"):
        refuse_while_asleep("kv_cache", "generation")
