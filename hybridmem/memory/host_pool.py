"""The Offloader's host pool: one exact-size allocation, pinned once, unpinned before it is freed.

The pool is an anonymous
mapping advised ``MADV_HUGEPAGE`` (:func:`hybridmem._platform.host_memory.huge_page_region`),
registered with ``cudaHostRegister`` through the seam: exactly the bytes asked (torch's
pinned allocator would round up to a power of two), pinned twice as fast as 4 KiB pages
(``benchmarks/pinning.py``), and mapped, so that a reload can be done by
kernels reading it (:meth:`HostPool.device_view`).

Scope: host memory of this process; not thread-safe (its Offloader is not).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem._platform.host_memory import huge_page_region
from hybridmem.memory.slots import Slot

__all__ = ["HostPool"]


def _unpin(pool: torch.Tensor) -> None:
    _torch.unpin_host_tensor(pool.data_ptr())


class HostPool:
    """A host buffer that grows to what is asked and is pinned once per allocation.

    Args:
        pin_memory: pin it (False: pageable, slower copies).

    Example:
        >>> pool = HostPool(pin_memory=False)
        >>> pool.ensure(1 << 20, None, release=pool.close)
        >>> pool.nbytes
        1048576
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.tensor: torch.Tensor | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # The pool's device mapping, for reloads by kernels: found at the first such
        # reload (None: none to be had; absent: not looked for yet).
        self._views: dict[torch.device, torch.Tensor | None] = {}

    @property
    def nbytes(self) -> int:
        """Its size (0 before the first :meth:`ensure` and after :meth:`close`)."""
        return 0 if self.tensor is None else self.tensor.numel()

    def grow(self, nbytes: int, max_host_bytes: int | None) -> None:
        """Make the pool hold at least ``nbytes``, keeping what it holds.

        A larger pool is allocated, the old one's bytes copied into it, and only then
        is the old one freed: for a pool that holds offloaded state (the host holds
        both for that moment).

        Raises:
            ValueError: ``nbytes`` over ``max_host_bytes`` (nothing changed).
        """
        if self.tensor is not None and self.tensor.numel() >= nbytes:
            return
        old, old_finalizer = self.tensor, self._finalizer
        self.tensor, self._finalizer = None, None
        try:
            self.ensure(nbytes, max_host_bytes, release=lambda: None)
        except BaseException:
            self.tensor, self._finalizer = old, old_finalizer
            raise
        if old is not None:
            assert self.tensor is not None
            self.tensor[: old.numel()].copy_(old)
            if old_finalizer is not None:
                old_finalizer()  # unpinned before it is freed
            del old

    def ensure(
        self, nbytes: int, max_host_bytes: int | None, *, release: Callable[[], None]
    ) -> None:
        """Make the pool hold at least ``nbytes``, replacing a smaller one.

        Args:
            nbytes: the bytes needed.
            max_host_bytes: refuse (ValueError) before allocating anything over this.
            release: called before a smaller pool is replaced (the Offloader's
                ``close``, which refuses while anything is offloaded into it).

        Raises:
            ValueError: ``nbytes`` over ``max_host_bytes`` (the message says how to fix it).
        """
        if nbytes == 0 or (self.tensor is not None and self.tensor.numel() >= nbytes):
            return
        if max_host_bytes is not None and nbytes > max_host_bytes:
            raise ValueError(
                f"offloading these targets needs {fmt_bytes(nbytes)} of host memory, over "
                f"max_host_bytes={max_host_bytes} ({fmt_bytes(max_host_bytes)}); "
                "raise the limit, offload fewer targets, or use grads='drop'"
            )
        release()
        start = time.perf_counter()
        region = huge_page_region(nbytes)
        pool = (
            torch.frombuffer(region, dtype=torch.uint8)
            if region is not None
            else torch.empty(nbytes, dtype=torch.uint8)
        )
        # Mapped too (flags 3): kernels can then read it (a reload by kernels); it
        # costs the device no more than pinning alone (``_torch.pin_host_tensor``).
        registered = self.pin_memory and _torch.pin_host_tensor(pool, mapped=True)
        if self.pin_memory and not registered:
            info_once(
                "offload-unpinned",
                "Offloader: could not pin host memory; using a pageable pool (slower copies)",
            )
        if registered:
            # The finalizer holds the pool, so the memory is unpinned before it is
            # freed (unmapped), whether close() runs or the pool is collected.
            self._finalizer = weakref.finalize(self, _unpin, pool)
        self.tensor = pool
        self._views.clear()
        logger.info(
            "Offloader: %s host pool of %s allocated in %.2f s",
            "pinned" if registered else "pageable",
            fmt_bytes(pool.numel()),
            time.perf_counter() - start,
        )

    def close(self) -> None:
        """Unpin and free it (idempotent)."""
        self._views.clear()  # before the unpinning: no view may outlive the mapping
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.tensor = None

    def device_view(self, device: torch.device) -> torch.Tensor | None:
        """The pool as ``device``'s kernels read it (pinned and mapped), or None.

        None for a pageable pool, or where the driver gives no device address: the
        copy engines then do the copies (logged once).
        """
        if device not in self._views:
            view = None
            if self.tensor is not None and self._finalizer is not None:  # pinned
                view = _torch.host_device_view(self.tensor, device)
            if view is None:
                info_once(
                    "offload-no-mapping",
                    "Offloader: the host pool has no device mapping (pageable, or the driver "
                    "refused); reloads by kernel use the copy engines",
                )
            self._views[device] = view
        return self._views[device]

    def copy_one(
        self, slot: Slot, device: torch.device | None, *, to_host: bool, by_kernel: bool = False
    ) -> None:
        """Queue one copy between a storage and its place in the pool (current stream).

        ``by_kernel``: a reload done by kernels reading the pool's device mapping
        (:func:`hybridmem._torch.mapped.copy_by_kernel`), where the pool has one.
        """
        assert self.tensor is not None, "planned before copying"
        assert device is not None, "planned before copying"
        device_bytes = _torch.storage_bytes(slot.storage, device)
        host_bytes = self.tensor[slot.offset : slot.offset + slot.nbytes]
        view = self.device_view(device) if by_kernel and not to_host else None
        if view is not None:
            _torch.copy_by_kernel(device_bytes, view[slot.offset : slot.offset + slot.nbytes])
        elif to_host:
            host_bytes.copy_(device_bytes, non_blocking=True)
        else:
            device_bytes.copy_(host_bytes, non_blocking=True)
