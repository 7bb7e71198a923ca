"""Observability: what torch and the device say about memory right now."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from hybridmem import _torch
from hybridmem._devices import DeviceArg, resolve_devices
from hybridmem._format import fmt_bytes
from hybridmem._names import suggests_keywords
from hybridmem.observe.communicators import (
    CommunicatorMemory,
    communicator_memory,
    describe_communicators,
)

__all__ = ["MemoryInfo", "memory_info", "read_memory"]


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one CUDA device as torch's allocator and the driver see it.

    Attributes:
        device: the device index, or None when no device was initialised.
        available: False when the device has no CUDA context in this process
            (or CUDA is absent): counters are then zero and free/total None,
            because reading them would create a context.
        allocated: bytes held by live tensors.
        reserved: bytes held by torch's caching allocator (allocated + cached).
        active: bytes in active blocks (allocated, plus blocks freed on a
            stream whose work has not finished).
        inactive_split: bytes in free blocks that cannot be returned because
            their segment is partly used: the fragmentation figure.
        peak_allocated, peak_reserved: high-water marks since start or the
            last ``torch.cuda.reset_peak_memory_stats``.
        free, total: device-wide free and total bytes (``cudaMemGetInfo``),
            which count other processes too.
        communicators: this process's process groups on this device and what their
            NCCL communicators hold (:func:`hybridmem.communicator_memory`): part of
            :attr:`non_torch`. Filled by :func:`memory_info`; empty in the readings
            of a release or a switch (their hot path).
    """

    device: int | None
    available: bool
    allocated: int = 0
    reserved: int = 0
    active: int = 0
    inactive_split: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    free: int | None = None
    total: int | None = None
    communicators: tuple[CommunicatorMemory, ...] = ()

    @property
    def nccl(self) -> int | None:
        """Device bytes this process's NCCL communicators hold (None: NCCL cannot say).

        0 with no NCCL communicator on this device. Where NCCL is older than 2.29.7
        the bytes are in :attr:`non_torch` and :attr:`communicators` names the groups.
        """
        totals = [c.total for c in self.communicators]
        if any(t is None for t in totals):
            return None
        return sum(t for t in totals if t is not None)

    @property
    def cached(self) -> int:
        """Reserved bytes no tensor uses (what :func:`release_cache` can return)."""
        return self.reserved - self.allocated

    @property
    def non_torch(self) -> int | None:
        """Bytes used on the device but not by torch's allocator here.

        ``total - free - reserved``: the CUDA context, NCCL communicators (:attr:`nccl`)
        and cuBLAS workspaces, other allocators in this process, and other processes.
        """
        if self.free is None or self.total is None:
            return None
        return self.total - self.free - self.reserved

    @property
    def fragmentation(self) -> float:
        """``inactive_split / reserved`` (0.0 when nothing is reserved)."""
        return self.inactive_split / self.reserved if self.reserved else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Return the fields and derived figures as a JSON-ready dict."""
        data = asdict(self)
        data.update(
            cached=self.cached,
            non_torch=self.non_torch,
            fragmentation=self.fragmentation,
            nccl=self.nccl,
        )
        return data

    def __str__(self) -> str:
        if not self.available:
            where = "no CUDA device" if self.device is None else f"cuda:{self.device}"
            return f"{where}: not initialised in this process (no memory figures)"
        lines = [
            f"cuda:{self.device}",
            f"  allocated       {fmt_bytes(self.allocated):>12}  "
            f"(peak {fmt_bytes(self.peak_allocated)})",
            f"  reserved        {fmt_bytes(self.reserved):>12}  "
            f"(peak {fmt_bytes(self.peak_reserved)})",
            f"  cached          {fmt_bytes(self.cached):>12}",
            f"  active          {fmt_bytes(self.active):>12}",
            f"  inactive split  {fmt_bytes(self.inactive_split):>12}  "
            f"({self.fragmentation:.1%} of reserved)",
            f"  device free     {fmt_bytes(self.free):>12}  of {fmt_bytes(self.total)}",
            f"  not torch's     {fmt_bytes(self.non_torch):>12}  (context, NCCL, other "
            "allocators, other processes)",
        ]
        lines.extend(f"  {line}" for line in describe_communicators(self.communicators))
        return "\n".join(lines)


@suggests_keywords
def memory_info(device: DeviceArg = None) -> MemoryInfo:
    """Return torch's allocator counters and the device's free/total memory.

    Scope: the current device by default. Never creates a CUDA context: a device
    without one in this process is reported as not available. Thread-safe. In a
    ``torch.distributed`` process it also reads what each process group's NCCL
    communicator holds on the device (:attr:`MemoryInfo.communicators`).

    Args:
        device: None (current device), an index, ``"cuda:N"`` or a ``torch.device``.

    Returns:
        A :class:`MemoryInfo`; ``print()`` it for a readable table.

    Raises:
        TypeError, ValueError: ``device`` is malformed or out of range.

    Example:
        >>> print(hm.memory_info())   # doctest: +SKIP
    """
    devices = resolve_devices(device)
    if not devices:
        index = device if isinstance(device, int) else None
        return MemoryInfo(device=index, available=False)
    info = read_memory(devices[0])
    found = communicator_memory(devices[0])
    return replace(info, communicators=found) if found else info


def read_memory(index: int) -> MemoryInfo:
    """Read device ``index``, which must already have a CUDA context (no checks: hot path).

    What :func:`memory_info` returns once it has resolved its device; the reports
    of a release and of a switch's stages are made of these readings.

    Example:
        >>> read_memory(0).allocated   # doctest: +SKIP
    """
    stats = _torch.memory_stats(index)
    free, total = _torch.mem_get_info(index)

    def stat(name: str) -> int:
        return int(stats.get(name, 0))

    return MemoryInfo(
        device=index,
        available=True,
        allocated=stat("allocated_bytes.all.current"),
        reserved=stat("reserved_bytes.all.current"),
        active=stat("active_bytes.all.current"),
        inactive_split=stat("inactive_split_bytes.all.current"),
        peak_allocated=stat("allocated_bytes.all.peak"),
        peak_reserved=stat("reserved_bytes.all.peak"),
        free=free,
        total=total,
    )
