"""A stand-in for vLLM 0.33's sleep-mode pool, for the tests of what hybridmem does to it.

It keeps vLLM's records (``pointer_to_data``: ``AllocationData`` with its handle
``(device, size, address, handle)``, tag, ``cpu_backup_tensor``, ``is_asleep``); its
"device" memory is host tensors by address. It stands in for vLLM's C extension
(``unmap_and_release`` fills the allocation with :data:`GARBAGE`: the memory is gone;
``create_and_map`` leaves it so: fresh memory) and for ``CuMemAllocator.sleep`` and
``wake_up`` in miniature (their record handling: a sleep backs up ``offload_tags`` into
``cpu_backup_tensor``, a wake maps the tags asked and every tag but ``weights`` and
``kv_cache``, copies a backup back and drops it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from hybridmem import _torch

__all__ = ["GARBAGE", "FakePool", "OldRecord", "Record", "break_copies", "fake_device"]

GARBAGE = 0xEE
DEFERRABLE = ("weights", "kv_cache")


@dataclass
class Record:
    """vLLM 0.25+'s ``AllocationData``."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None
    is_asleep: bool = False


@dataclass
class OldRecord:
    """vLLM 0.22-0.24's ``AllocationData``: no ``is_asleep`` flag."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None


@dataclass
class FakePool:
    memory: dict[int, torch.Tensor] = field(default_factory=dict)
    pointer_to_data: dict[int, Record] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    fail_unmap_at: int | None = None  # the n-th unmap raises
    fail_map: list[str] = field(default_factory=list)  # messages the next maps raise
    viewed: list[int] = field(default_factory=list)  # addresses hybridmem viewed, in order

    def make(self, address: int, size: int, tag: str, fill: int) -> None:
        self.memory[address] = torch.full((size,), fill, dtype=torch.uint8)
        self.pointer_to_data[address] = Record((0, size, address, 0), tag)

    # vLLM's C extension
    def unmap_and_release(self, handle: tuple[int, int, int, int]) -> None:
        self.calls.append(f"unmap:{handle[2]:#x}")
        unmaps = sum(c.startswith("unmap") for c in self.calls)
        if self.fail_unmap_at is not None and unmaps == self.fail_unmap_at:
            raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:155")
        self.memory[handle[2]].fill_(GARBAGE)

    def create_and_map(self, handle: tuple[int, int, int, int]) -> None:
        self.calls.append(f"map:{handle[2]:#x}")
        if self.fail_map:
            raise RuntimeError(self.fail_map.pop(0))

    # CuMemAllocator's sleep and wake_up, their record handling
    def sleep(self, offload_tags: tuple[str, ...] = ()) -> None:
        self.calls.append(f"sleep:{offload_tags!r}")
        for address, data in self.pointer_to_data.items():
            if data.is_asleep:
                continue
            if data.tag in offload_tags:
                data.cpu_backup_tensor = self.memory[address].clone()
            self.memory[address].fill_(GARBAGE)
            data.is_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up:{tags!r}")
        for address, data in self.pointer_to_data.items():
            if not data.is_asleep:
                continue
            if tags is None or data.tag in tags or data.tag not in DEFERRABLE:
                data.is_asleep = False
                if data.cpu_backup_tensor is not None:
                    self.memory[address].copy_(data.cpu_backup_tensor)
                    data.cpu_backup_tensor = None


def fake_device(monkeypatch: pytest.MonkeyPatch, pool: FakePool) -> list[int]:
    """Views of the pool's memory for its addresses, pinning that records each size, no CUDA.

    Returns:
        The sizes asked to be pinned, in order (pageable here: there is no CUDA).
    """
    pinned: list[int] = []

    def view(address: int, nbytes: int, device: int | None, on_free: Any) -> torch.Tensor:
        assert device == 0
        pool.viewed.append(address)
        return pool.memory[address][:nbytes]

    def pin(tensor: torch.Tensor, mapped: bool = False) -> bool:
        pinned.append(tensor.nbytes)
        return False

    monkeypatch.setattr(_torch, "tensor_from_memory", view)
    monkeypatch.setattr(_torch, "pin_host_tensor", pin)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return pinned


def break_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every view of device memory fails, as a copy from a faulted device would."""

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(_torch, "tensor_from_memory", broken)
