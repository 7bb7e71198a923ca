"""The Offloader's host pool: exact-size chunks, each pinned once, unpinned before it is freed.

Each chunk is an anonymous mapping advised ``MADV_HUGEPAGE``
(:func:`hybridmem._platform.host_memory.huge_page_region`), registered with
``cudaHostRegister`` through the seam: exactly the bytes asked (torch's pinned
allocator would round up to a power of two), pinned twice as fast as 4 KiB pages
(``benchmarks/pinning.py``), and mapped, so that a reload can be done by kernels
reading it (:meth:`HostPool.copy_one`).

The pool grows by a chunk from its end, never by a new allocation of the whole: an
offload planned by need that must move a little more than the last one pins only the
difference (a 2 GiB pool allocated and pinned anew cost a planned switch 0.35 s on an
H100), and what the pool holds stays where it is. Its owner grows it to the end of a
place (a storage's span), so no place straddles two chunks.

Scope: host memory of this process; not thread-safe (its Offloader is not).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem._platform.host_memory import huge_page_region
from hybridmem.memory.slots import Slot

__all__ = ["HostChunk", "HostPool"]


def _unpin(pool: torch.Tensor) -> None:
    _torch.unpin_host_tensor(pool.data_ptr())


@dataclass(eq=False)
class HostChunk:
    """One allocation of the pool: bytes ``[start, start + tensor.numel())``.

    Attributes:
        start: its first byte's offset in the pool.
        tensor: the bytes (uint8).
        finalizer: unpins it before it is freed (None: not pinned).
        views: its mapping as each device's kernels read it (None: none to be had;
            absent: not looked for yet).
    """

    start: int
    tensor: torch.Tensor
    finalizer: weakref.finalize[Any, Any] | None
    views: dict[torch.device, torch.Tensor | None] = field(default_factory=dict)

    @property
    def end(self) -> int:
        """The offset just past its last byte."""
        return self.start + self.tensor.numel()

    def device_view(self, device: torch.device) -> torch.Tensor | None:
        """The chunk as ``device``'s kernels read it (pinned and mapped), or None.

        None for a pageable chunk, or where the driver gives no device address: the
        copy engines then do the copies (logged once).
        """
        if device not in self.views:
            view = None
            if self.finalizer is not None:  # pinned
                view = _torch.host_device_view(self.tensor, device)
            if view is None:
                info_once(
                    "offload-no-mapping",
                    "Offloader: the host pool has no device mapping (pageable, or the driver "
                    "refused); reloads by kernel use the copy engines",
                )
            self.views[device] = view
        return self.views[device]

    def release(self) -> None:
        """Drop its views, then unpin it (idempotent); the memory goes with the tensor."""
        self.views.clear()  # before the unpinning: no view may outlive the mapping
        if self.finalizer is not None:
            self.finalizer()
            self.finalizer = None


class HostPool:
    """A host buffer that grows, by exact-size chunks each pinned once, to what is asked.

    Args:
        pin_memory: pin it (False: pageable, slower copies).

    Example:
        >>> pool = HostPool(pin_memory=False)
        >>> pool.grow(1 << 20, None)
        >>> pool.grow(3 << 20, None)  # one more chunk, of 2 MiB
        >>> pool.nbytes, len(pool.chunks)
        (3145728, 2)
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.chunks: list[HostChunk] = []

    @property
    def nbytes(self) -> int:
        """Its size (0 before the first :meth:`grow` and after :meth:`close`)."""
        return self.chunks[-1].end if self.chunks else 0

    def check(self, nbytes: int, max_host_bytes: int | None) -> None:
        """Refuse a pool of ``nbytes`` over ``max_host_bytes`` (before anything changes).

        Raises:
            ValueError: ``nbytes`` over ``max_host_bytes`` (the message says how to fix it).
        """
        if max_host_bytes is not None and nbytes > max_host_bytes:
            raise ValueError(
                f"offloading these targets needs {fmt_bytes(nbytes)} of host memory, over "
                f"max_host_bytes={max_host_bytes} ({fmt_bytes(max_host_bytes)}); "
                "raise the limit, offload fewer targets, or use grads='drop'"
            )

    def grow(self, nbytes: int, max_host_bytes: int | None) -> None:
        """Make the pool hold at least ``nbytes``: one more chunk from its end.

        What it holds stays where it is. The caller grows it to the end of a place,
        so that no place straddles two chunks (:meth:`copy_one` checks).

        Raises:
            ValueError: ``nbytes`` over ``max_host_bytes`` (nothing changed).
        """
        if nbytes <= self.nbytes:
            return
        self.check(nbytes, max_host_bytes)
        size = nbytes - self.nbytes
        start = time.perf_counter()
        region = huge_page_region(size)
        chunk_bytes = (
            torch.frombuffer(region, dtype=torch.uint8)
            if region is not None
            else torch.empty(size, dtype=torch.uint8)
        )
        # Mapped too (flags 3): kernels can then read it (a reload by kernels); it
        # costs the device no more than pinning alone (``_torch.pin_host_tensor``).
        registered = self.pin_memory and _torch.pin_host_tensor(chunk_bytes, mapped=True)
        if self.pin_memory and not registered:
            info_once(
                "offload-unpinned",
                "Offloader: could not pin host memory; using a pageable pool (slower copies)",
            )
        # The finalizer holds the chunk, so the memory is unpinned before it is freed
        # (unmapped), whether close() runs or the pool is collected.
        finalizer = weakref.finalize(self, _unpin, chunk_bytes) if registered else None
        self.chunks.append(HostChunk(self.nbytes, chunk_bytes, finalizer))
        logger.info(
            "Offloader: %s host pool grew by %s to %s in %.2f s",
            "pinned" if registered else "pageable",
            fmt_bytes(size),
            fmt_bytes(self.nbytes),
            time.perf_counter() - start,
        )

    def close(self) -> None:
        """Unpin and free it (idempotent)."""
        for chunk in self.chunks:
            chunk.release()
        self.chunks = []

    def place(self, slot: Slot) -> tuple[HostChunk, slice]:
        """The chunk that holds ``slot``'s place, and the place within it.

        Raises:
            RuntimeError: no single chunk holds the place (a pool grown to the middle
                of a place: a defect of its owner).
        """
        for chunk in self.chunks:
            if chunk.start <= slot.offset < chunk.end:
                begin = slot.offset - chunk.start
                if begin + slot.nbytes > chunk.tensor.numel():
                    break
                return chunk, slice(begin, begin + slot.nbytes)
        raise RuntimeError(
            f"the host pool ({len(self.chunks)} chunks, {fmt_bytes(self.nbytes)}) has no "
            f"chunk holding bytes [{slot.offset}, {slot.offset + slot.nbytes})"
        )

    def copy_one(
        self, slot: Slot, device: torch.device | None, *, to_host: bool, by_kernel: bool = False
    ) -> None:
        """Queue one copy between a storage and its place in the pool (current stream).

        ``by_kernel``: a reload done by kernels reading the chunk's device mapping
        (:func:`hybridmem._torch.mapped.copy_by_kernel`), where it has one.
        """
        assert device is not None, "planned before copying"
        chunk, span = self.place(slot)
        device_bytes = _torch.storage_bytes(slot.storage, device)
        view = chunk.device_view(device) if by_kernel and not to_host else None
        if view is not None:
            _torch.copy_by_kernel(device_bytes, view[span])
        elif to_host:
            chunk.tensor[span].copy_(device_bytes, non_blocking=True)
        else:
            device_bytes.copy_(chunk.tensor[span], non_blocking=True)
