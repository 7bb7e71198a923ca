"""Host memory pinned once for allocations of vLLM's sleep-mode pool, a place per address.

A level-1 sleep keeps some allocations' bytes in host memory. Pinning runs at a few
GB/s and copies into pinned memory at tens, so the places are pinned ahead of the
sleeps (:meth:`HostPlaces.reserve`), in exact-size chunks of a
:class:`~hybridmem.memory.host_pool.HostPool`, and reused by every sleep after. A
place whose allocation was freed goes to the next allocation of its size or less, so
host memory stays flat while the engine remakes allocations of the same sizes.

A process's first copies into its places take longer than the ones after (an H100, 1
GiB: about 1.8 ms more, 0.75-0.96 of the pinned rate against 0.99-1.08;
``benchmarks/vllm_level1.py``): a first use paid once, of the copy path (the seam's
view of device memory) and perhaps of the pages just registered
(``benchmarks/first_copy.py``). So the pool's owners make the first copy into fresh
places where they reserve them (:meth:`HostPlaces.warm`, at load), not in the first
sleep.

Scope: one process's pool; not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem.memory.host_pool import HostPool

__all__ = ["HostPlaces"]


def _noop() -> None:
    return None


class HostPlaces:
    """Places in pinned host memory for pool allocations, by address.

    Example:
        >>> places = HostPlaces(pin_memory=False)
        >>> rec = type("Rec", (), {"handle": (0, 4096, 0x1000, 0)})()
        >>> places.reserve([(0x1000, rec)], live={0x1000})
        4096
        >>> places[0x1000].numel(), places.nbytes
        (4096, 4096)
    """

    def __init__(self, pin_memory: bool = True) -> None:
        self._host = HostPool(pin_memory=pin_memory)
        self._places: dict[int, torch.Tensor] = {}
        self._spare: list[torch.Tensor] = []  # places of allocations since freed
        self._cold: set[int] = set()  # addresses whose place is fresh, never copied into

    @property
    def nbytes(self) -> int:
        """Host memory pinned for places so far."""
        return self._host.nbytes

    def __contains__(self, address: object) -> bool:
        return address in self._places

    def __getitem__(self, address: int) -> torch.Tensor:
        """The place of the allocation at ``address`` (a view of its size)."""
        return self._places[address]

    def reserve(self, records: Sequence[tuple[int, Any]], live: Collection[int]) -> int:
        """Give each of ``records`` (``(address, record)``) a place; return the bytes pinned now.

        Places of addresses not in ``live`` (the pool's records now) go spare first; a
        record takes a spare place of its size or more, else a place in one new chunk
        pinned now for all that need one.
        """
        for address in [a for a in self._places if a not in live]:
            self._spare.append(self._places.pop(address))
            self._cold.discard(address)
        fresh = []
        for address, data in records:
            size = int(data.handle[1])
            place = self._places.get(address)
            if place is not None and place.numel() == size:
                continue
            spare = next((i for i, s in enumerate(self._spare) if s.numel() >= size), None)
            if spare is None:
                fresh.append((address, size))
            else:
                self._places[address] = self._spare.pop(spare)[:size]
        total = sum(size for _, size in fresh)
        if not total:
            return 0
        began = time.perf_counter()
        self._host.grow(self._host.nbytes + total, None)
        chunk = self._host.chunks[-1].tensor  # one chunk holds exactly these places
        offset = 0
        for address, size in fresh:
            self._places[address] = chunk[offset : offset + size]
            self._cold.add(address)
            offset += size
        logger.info(
            "vLLM sleep pool: pinned %s of host memory for %d allocations in %.2f s",
            fmt_bytes(total),
            len(fresh),
            time.perf_counter() - began,
        )
        return total

    def warm(self, records: Sequence[tuple[int, Any]]) -> int:
        """Make the first copy into the places of ``records`` that have had none; return bytes.

        Only mapped records are copied (a sleeping one's place may hold its bytes), only
        into places pinned fresh and never copied into since (:meth:`copy_in`).
        """
        return self.copy_in(
            [(a, data) for a, data in records if a in self._cold and not data.is_asleep]
        )

    def copy_in(self, records: Sequence[tuple[int, Any]]) -> int:
        """Copy each of ``records`` (``(address, record)``, mapped) into its place; return bytes.

        The copies are queued together and waited for once, on every device they read.
        Each record needs a place (:meth:`reserve`); a record's handle is vLLM's
        ``(device, size, address, ...)``.

        Raises:
            KeyError: a record has no place (reserve it first); nothing is copied.
        """
        missing = [address for address, _ in records if address not in self._places]
        if missing:
            raise KeyError(f"no place reserved for the allocation at {missing[0]:#x}")
        copied, devices = 0, set()
        for address, data in records:
            device, size = int(data.handle[0]), int(data.handle[1])
            view = _torch.tensor_from_memory(address, size, device, _noop)
            self._places[address].copy_(view, non_blocking=True)
            copied += size
            devices.add(device)
        for device in devices:
            torch.cuda.synchronize(device)
        self._cold.difference_update(address for address, _ in records)
        return copied

    def forget(self, address: int) -> None:
        """Give the place of ``address`` up to later allocations (its allocation was freed)."""
        place = self._places.pop(address, None)
        self._cold.discard(address)
        if place is not None:
            self._spare.append(place)

    def close(self) -> None:
        """Unpin and free the host memory (idempotent); every place is gone."""
        self._host.close()
        self._places.clear()
        self._spare.clear()
        self._cold.clear()
