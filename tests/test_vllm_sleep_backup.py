"""PoolBackup: vLLM's pool's tagged memory kept in host memory pinned once (a fake pool here).

The fake allocator keeps vLLM 0.33's records (``pointer_to_data``: handle, tag,
``is_asleep``); its "device" memory is host tensors by address, which a sleep fills with
garbage (discarded) and a wake leaves as it is (vLLM maps fresh memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from hybridmem import _torch
from hybridmem.integrations.vllm.sleep_backup import PoolBackup


@dataclass
class Record:
    handle: tuple[int, int, int, int]
    tag: str
    is_asleep: bool = False
    cpu_backup_tensor: Any = None


@dataclass
class FakePool:
    memory: dict[int, torch.Tensor] = field(default_factory=dict)
    pointer_to_data: dict[int, Record] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def make(self, address: int, size: int, tag: str, fill: int) -> None:
        self.memory[address] = torch.full((size,), fill, dtype=torch.uint8)
        self.pointer_to_data[address] = Record((0, size, address, 0), tag)

    def sleep(self, offload_tags: tuple[str, ...] = ()) -> None:
        self.calls.append(f"sleep:{offload_tags!r}")
        for address, data in self.pointer_to_data.items():
            if not data.is_asleep:
                self.memory[address].fill_(0xEE)  # unmapped: the bytes are gone
                data.is_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up:{tags!r}")
        for data in self.pointer_to_data.values():
            if tags is None or data.tag in tags:
                data.is_asleep = False


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> FakePool:
    fake = FakePool()
    fake.make(0x1000, 4096, "weights", 1)
    fake.make(0x9000, 8192, "weights", 2)
    fake.make(0x20000, 65536, "kv_cache", 3)

    def view(address: int, nbytes: int, device: int | None, on_free: Any) -> torch.Tensor:
        assert device == 0
        return fake.memory[address][:nbytes]

    monkeypatch.setattr(_torch, "tensor_from_memory", view)
    # pinning asked once per reservation; pageable here (no CUDA)
    fake.pinned = []  # type: ignore[attr-defined]
    monkeypatch.setattr(
        _torch,
        "pin_host_tensor",
        lambda tensor, mapped=False: fake.pinned.append(tensor.nbytes) or False,  # type: ignore[attr-defined]
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return fake


def test_the_tags_memory_comes_back_byte_for_byte_and_the_rest_is_discarded(
    pool: FakePool,
) -> None:
    backup = PoolBackup(pool)
    assert backup.reserve() == 4096 + 8192  # the weights, exactly, at start-up
    assert backup.reserve() == 0  # once
    for _ in range(3):
        backup.sleep()
        assert pool.calls[-1] == "sleep:()"  # vLLM discards the whole pool
        backup.wake_up(["weights"])
        assert bool((pool.memory[0x1000] == 1).all())
        assert bool((pool.memory[0x9000] == 2).all())
        assert pool.pointer_to_data[0x20000].is_asleep  # the KV cache still sleeps
        backup.wake_up(["kv_cache"])
        assert bool((pool.memory[0x20000] == 0xEE).all())  # level 1: the KV cache is not kept
    assert backup.host_bytes == 4096 + 8192
    assert pool.pinned == [4096 + 8192]  # type: ignore[attr-defined]  # pinned once, exactly


def test_allocations_made_or_freed_between_sleeps_are_placed_or_given_up(
    pool: FakePool,
) -> None:
    backup = PoolBackup(pool)
    backup.reserve()
    pool.make(0x40000, 2048, "weights", 7)  # an adapter loaded later
    backup.sleep()  # pins the new one's place then (it was not reserved)
    assert backup.host_bytes == 4096 + 8192 + 2048
    del pool.pointer_to_data[0x9000]  # freed while asleep
    backup.wake_up(None)
    assert bool((pool.memory[0x40000] == 7).all())
    assert bool((pool.memory[0x1000] == 1).all())
    assert backup.reserve() == 0


def test_a_failed_copy_leaves_the_pool_awake_and_untouched(
    pool: FakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    backup = PoolBackup(pool)

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(_torch, "tensor_from_memory", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backup.sleep()
    assert pool.calls == []  # vLLM's sleep never ran
    assert not any(data.is_asleep for data in pool.pointer_to_data.values())


def test_close_says_what_it_loses(pool: FakePool, caplog: pytest.LogCaptureFixture) -> None:
    backup = PoolBackup(pool)
    backup.sleep()
    with caplog.at_level("WARNING", logger="hybridmem"):
        backup.close()
    assert "closed with 2 allocations asleep: their bytes are lost" in caplog.text
    assert backup.host_bytes == 0
    backup.close()


def test_misuse_is_refused_with_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"expected vLLM's CuMemAllocator.*got object"):
        PoolBackup(object())
    with pytest.raises(TypeError, match="tags must be a sequence of tag names, got 'weights'"):
        PoolBackup(FakePool(), tags="weights")
    with pytest.raises(ValueError, match="that is vLLM's level 2"):
        PoolBackup(FakePool(), tags=())


@dataclass
class OldRecord:
    """vLLM 0.22-0.24's AllocationData: no is_asleep flag."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None


def test_a_pool_without_the_asleep_flag_is_refused_before_anything_moves(pool: FakePool) -> None:
    pool.pointer_to_data = {0x1000: OldRecord((0, 4096, 0x1000, 0), "weights")}  # type: ignore[dict-item]
    backup = PoolBackup(pool)
    with pytest.raises(TypeError, match=r"needs vLLM 0\.25 or later"):
        backup.sleep()
    assert pool.calls == []
