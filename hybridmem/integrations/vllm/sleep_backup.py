"""Level-1 sleep of vLLM's pool with the tagged memory kept in host memory pinned once.

vLLM's level-1 sleep (``CuMemAllocator.sleep(offload_tags=("weights",))``) copies each
tagged allocation into host memory it allocates right then with ``pin_memory=True``:
the first sleep pins that memory (torch's caching host allocator, each block rounded
up to a power of two), later sleeps reuse torch's cached pinned blocks.
:class:`PoolBackup` pins exact-size host memory once, when asked (:meth:`reserve`, at
start-up, not in a sleep), copies the tagged allocations there, then lets vLLM's
sleep discard the whole pool; after vLLM's ``wake_up`` has mapped them again, it
copies them back. The bytes that come back are the bytes that went.

It reads the allocator's own records (``pointer_to_data``: each allocation's handle
``(device, size, address, ...)``, its tag and ``is_asleep``; vLLM 0.33's
``vllm/device_allocator/__init__.py``) and calls only ``sleep`` and ``wake_up``.

Scope: the process of one vLLM worker (the pool is process-global); not thread-safe
(vLLM's worker sleeps and wakes from one thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._log import logger
from hybridmem.integrations.vllm.host_places import HostPlaces

__all__ = ["PoolBackup"]


def _records(allocator: Any) -> dict[int, Any]:
    records = getattr(allocator, "pointer_to_data", None)
    if not isinstance(records, dict):
        raise TypeError(
            f"expected vLLM's CuMemAllocator (CuMemAllocator.get_instance()), got "
            f"{type(allocator).__name__}: it has no pointer_to_data records"
        )
    return records


class PoolBackup:
    """Keep the ``tags`` of vLLM's sleep-mode pool in host memory pinned once across sleeps.

    Args:
        allocator: vLLM's ``CuMemAllocator.get_instance()``.
        tags: the tags whose memory is kept (vLLM's level 1 keeps ``"weights"``); the
            rest is discarded by the sleep, as vLLM's level 1 does.

    Raises:
        TypeError: ``allocator`` is not vLLM's allocator, or ``tags`` is a string.
        ValueError: ``tags`` is empty (that is vLLM's level 2: ``allocator.sleep(())``).

    Example:
        >>> backup = PoolBackup(CuMemAllocator.get_instance())  # doctest: +SKIP
        >>> backup.reserve()  # at start-up: pins host memory  # doctest: +SKIP
        >>> backup.sleep()  # for allocator.sleep(offload_tags=("weights",))  # doctest: +SKIP
        >>> backup.wake_up(["weights"]); backup.wake_up(["kv_cache"])  # doctest: +SKIP

    Scope: one process's pool; not thread-safe.
    """

    def __init__(self, allocator: Any, tags: Sequence[str] = ("weights",)) -> None:
        _records(allocator)
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise TypeError(f"tags must be a sequence of tag names, got {tags!r}")
        if not tags:
            raise ValueError(
                "tags is empty: nothing would be kept (that is vLLM's level 2: "
                "allocator.sleep(offload_tags=()))"
            )
        self.allocator = allocator
        self.tags = tuple(tags)
        self._places = HostPlaces(pin_memory=True)
        self._kept: set[int] = set()  # addresses whose bytes are in host memory now

    @property
    def host_bytes(self) -> int:
        """Host memory pinned for the tags so far."""
        return self._places.nbytes

    def _tagged(self) -> list[tuple[int, Any]]:
        tagged = [
            (address, data)
            for address, data in _records(self.allocator).items()
            if data.tag in self.tags
        ]
        if tagged and not hasattr(tagged[0][1], "is_asleep"):
            raise TypeError(
                "this vLLM's sleep-mode pool keeps no is_asleep flag on its records (vLLM "
                "before 0.25): PoolBackup cannot tell what sleeps. It needs vLLM 0.25 or "
                "later; use vLLM's own level-1 sleep here"
            )
        return tagged

    def reserve(self) -> int:
        """Pin host memory for every tagged allocation that has none yet; return its bytes.

        Call it once the engine has made its weights (vLLM's model load), so that no
        sleep pins; it also makes the first copy into what it pinned, which pays a
        first use (:mod:`~hybridmem.integrations.vllm.host_places`). An allocation
        freed since its place was made gives the place up to a later one of its size or
        less; one made since gets a place (reused, or in a chunk of its own, pinned
        then).
        """
        pinned = self._reserve()
        # the first copy into the places pays a first use: make it here, not in a sleep
        self._places.warm(self._tagged())
        return pinned

    def _reserve(self) -> int:
        records = _records(self.allocator)
        for address in [a for a in self._kept if a not in records]:
            self._kept.discard(address)  # freed while asleep: nothing to put back
        return self._places.reserve(self._tagged(), live=records)

    def sleep(self) -> None:
        """Copy the tags' memory to host memory, then vLLM's sleep discards the whole pool.

        If a copy fails, vLLM's sleep is not called: the pool is as it was.
        """
        self._reserve()
        awake = [(a, d) for a, d in self._tagged() if not d.is_asleep]
        self._places.copy_in(awake)
        self._kept.update(address for address, _ in awake)
        self.allocator.sleep(offload_tags=())

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``wake_up(tags)``, then the kept bytes copied back into what it mapped."""
        self.allocator.wake_up(tags)
        records = _records(self.allocator)
        back = []
        for address in list(self._kept):
            data = records.get(address)
            if data is None:  # freed while asleep: nothing to put back
                self._kept.discard(address)
                continue
            if data.is_asleep:
                continue
            host = self._places[address]
            device = _torch.tensor_from_memory(
                address, host.numel(), int(data.handle[0]), lambda: None
            )
            device.copy_(host, non_blocking=True)
            back.append(device)
            self._kept.discard(address)
        torch.cuda.synchronize()

    def close(self) -> None:
        """Unpin and free the host memory (what it keeps now is lost; idempotent)."""
        if self._kept:
            logger.warning(
                "vLLM pool backup closed with %d allocations asleep: their bytes are lost",
                len(self._kept),
            )
        self._places.close()
        self._kept.clear()
