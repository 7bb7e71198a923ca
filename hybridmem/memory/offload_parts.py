"""What an offload moves: its report, and the slot of each storage in the host pool.

Split out of :mod:`hybridmem.memory.offload` (issue #27).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridmem import _torch
from hybridmem._checks import check_number
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem.memory.targets import GROUPS, Group, StorageEntry, Target, flatten
from hybridmem.scopes.profiles import RELOAD_WAYS

__all__ = [
    "RELOAD_WAYS",
    "CopyClock",
    "OffloadReport",
    "Slot",
    "allocate",
    "check_freeable",
    "check_refillable",
    "check_reload_way",
    "collect_slots",
    "drop_grads",
    "first_slots",
    "groups_of",
    "kernel_split",
    "reload_need",
    "unallocate",
]

# How the CUDA caching allocator rounds requests (c10/cuda/CUDACachingAllocator):
# small ones (<= 1 MiB) to 512 B inside 2 MiB blocks, large ones to 2 MiB.
_SMALL_SIZE, _SMALL_ROUND, _LARGE_ROUND = 1 << 20, 512, 2 << 20
_HEADROOM = 20 << 20  # one large block for what rounding misses

#: How :meth:`Offloader.reload` may copy: by the copy engines, or by kernels reading
#: the pool's device mapping (decision 80).


@dataclass(frozen=True)
class OffloadReport:
    """What one :meth:`Offloader.offload` or :meth:`Offloader.reload` moved.

    Attributes:
        direction: ``"offload"`` (device to host) or ``"reload"``.
        groups: the groups moved.
        nbytes: bytes copied.
        tensors: storages copied (views and tied weights share one).
        seconds: wall-clock time, including the wait for the copies (a
            non-blocking reload only counts the time to queue them).
        host_pool_bytes: size of the pinned pool.
        device: the CUDA device.
        dropped_grad_bytes: gradient bytes freed without copying (``grads="drop"``).
        copy_seconds: the copies' own time on the device, between timed CUDA events
            recorded around them on their stream (:class:`CopyClock`); None where
            not measured (a reload, or no CUDA stream). Unlike ``seconds`` it leaves
            out the host's walk and frees, and, for an offload whose copies ran under
            other work (:meth:`Offloader.start_offload`), the time that work took
            after they landed.
    """

    direction: Literal["offload", "reload"]
    groups: tuple[str, ...]
    nbytes: int
    tensors: int
    seconds: float
    host_pool_bytes: int
    device: str
    dropped_grad_bytes: int = 0
    copy_seconds: float | None = None

    @classmethod
    def of(
        cls,
        direction: Literal["offload", "reload"],
        slots: Sequence[Slot],
        start: float,
        host_pool_bytes: int,
        device: torch.device | None,
        dropped: int = 0,
        copy_seconds: float | None = None,
    ) -> OffloadReport:
        """The report of ``slots`` moved since ``start`` (a ``time.perf_counter()``)."""
        return cls(
            direction=direction,
            groups=groups_of(slots),
            nbytes=sum(s.nbytes for s in slots),
            tensors=len(slots),
            seconds=time.perf_counter() - start,
            host_pool_bytes=host_pool_bytes,
            device=str(device) if device is not None else "none",
            dropped_grad_bytes=dropped,
            copy_seconds=copy_seconds,
        )

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def copy_or_wall_seconds(self) -> float:
        """``copy_seconds`` where measured (and not 0), else the wall-clock ``seconds``.

        What a rate is best read over: the switch sizes its early reload's tail by it,
        and the bench its offload rate (decision 90).
        """
        return self.copy_seconds or self.seconds

    @property
    def copy_gbps(self) -> float:
        """The copies' own rate in GB/s: over ``copy_seconds`` where measured, else ``gbps``."""
        return self.nbytes / self.copy_or_wall_seconds / 1e9 if self.copy_seconds else self.gbps

    def __str__(self) -> str:
        dropped = (
            f", dropped {fmt_bytes(self.dropped_grad_bytes)} of gradients"
            if self.dropped_grad_bytes
            else ""
        )
        copies = (
            f", copies {self.copy_seconds * 1e3:.1f} ms ({self.copy_gbps:.1f} GB/s)"
            if self.copy_seconds
            else ""
        )
        return (
            f"{self.direction} {','.join(self.groups) or 'nothing'} on {self.device}: "
            f"{fmt_bytes(self.nbytes)} in {self.tensors} storages, {self.seconds * 1e3:.1f} ms "
            f"({self.gbps:.1f} GB/s){copies}, pinned pool {fmt_bytes(self.host_pool_bytes)}"
            f"{dropped}"
        )


class CopyClock:
    """Two timed CUDA events around an offload's copies on their stream: their own time.

    The start is recorded once the stream has waited for the work that made the data,
    so the time is the copies' alone. :meth:`seconds` reads it once the caller has
    waited for the stream (the offload's frees do).

    Example:
        >>> clock = CopyClock()
        >>> clock.start(None)  # no stream (not CUDA): nothing recorded
        >>> clock.stop(None)
        >>> clock.seconds() is None
        True

    Scope: one offload, on the thread that queues its copies.
    """

    __slots__ = ("_end", "_start")

    def __init__(self) -> None:
        self._start: Any = None
        self._end: Any = None

    def start(self, stream: Any) -> None:
        """Record the start on ``stream`` before its first copy (again: a restart)."""
        self._end = None
        if stream is None:
            self._start = None
            return
        self._start = _torch.new_timed_event()
        _torch.record_event(self._start, stream)

    def stop(self, stream: Any) -> None:
        """Record the end on ``stream`` after its last copy (nothing if never started)."""
        if self._start is not None and stream is not None:
            self._end = _torch.new_timed_event()
            _torch.record_event(self._end, stream)

    def seconds(self) -> float | None:
        """The copies' seconds on the device, once their stream has been waited for.

        None where not recorded, or where the events cannot be read: a measurement
        never fails the offload it measures (the reason is logged at DEBUG).
        """
        if self._start is None or self._end is None:
            return None
        try:
            return _torch.event_seconds(self._start, self._end)
        except Exception as exc:  # e.g. a sticky CUDA error: the frees already ran
            logger.debug("CopyClock: the copies' time could not be read (%s)", exc)
            return None


class Slot:
    """One device storage and its place in the pinned pool."""

    __slots__ = ("group", "key", "name", "nbytes", "offloaded", "offset", "refill", "storage")

    def __init__(self, storage: torch.UntypedStorage, name: str, group: Group) -> None:
        self.storage = storage
        self.key = _torch.storage_key(storage)
        self.nbytes = storage.nbytes()
        self.name = name
        self.group = group
        self.offset = 0
        # The pool holds its only good copy: its device storage is freed, or refill.
        self.offloaded = False
        # This Offloader reallocated the storage and has not filled it yet: a retry
        # may fill it, where a storage someone else reallocated is refused.
        self.refill = False


def groups_of(slots: Sequence[Slot]) -> tuple[str, ...]:
    """The groups ``slots`` belong to, each once, in :data:`~.targets.GROUPS` order."""
    return tuple(sorted({slot.group for slot in slots}, key=GROUPS.index))


def check_freeable(slots: Sequence[Slot]) -> None:
    """Refuse, before anything is freed, storages torch cannot free in place."""
    for slot in slots:
        if not _torch.storage_resizable(slot.storage):
            raise ValueError(
                f"Offloader cannot free {slot.name}: its memory is not this process's "
                "to free (imported through CUDA IPC or DLPack, or wrapping an external "
                "buffer), so torch cannot resize its storage. Leave it out of the "
                "targets, or clone it into memory this process owns; nothing was offloaded"
            )


def check_refillable(slots: Sequence[Slot]) -> None:
    """Refuse to reload over a storage someone else reallocated while it was offloaded."""
    for slot in slots:
        if slot.storage.nbytes() != 0 and not slot.refill:
            raise RuntimeError(
                f"{slot.name} was reallocated while offloaded ({slot.storage.nbytes()} bytes); "
                "refusing to overwrite it. Do not touch offloaded tensors before reload()."
            )


def allocate(slot: Slot) -> None:
    """Reallocate a freed storage, to be refilled (current stream)."""
    if slot.storage.nbytes() == 0:
        slot.refill = True  # before: a failing resize may have allocated already
        _torch.resize_storage(slot.storage, slot.nbytes)


def collect_slots(
    storages: Iterable[StorageEntry],
    device: torch.device | None,
) -> tuple[list[Slot], torch.device | None]:
    """One slot per storage of the walk, and the one device they are all on.

    Args:
        storages: the walk of an Offloader's targets.
        device: the device the Offloader was made for (None: the targets').

    Returns:
        ``(slots, device)``: ``device`` as given, or the storages' where None.

    Raises:
        ValueError: the storages span several devices, or lie on another than ``device``.
    """
    slots: list[Slot] = []
    devices: dict[torch.device, str] = {}
    for name, storage, group, on in storages:
        devices.setdefault(on, name)
        slots.append(Slot(storage, name, group))
    if len(devices) > 1:
        listed = ", ".join(f"{d} ({n})" for d, n in devices.items())
        raise ValueError(
            f"Offloader targets span several devices: {listed}. Use one Offloader per device."
        )
    if devices:
        (found,) = devices
        if device is not None and found != device:
            raise ValueError(f"Offloader was made for {device}, but {devices[found]} is on {found}")
        device = found
    return slots, device


def unallocate(slots: Sequence[Slot], stream: Any) -> None:
    """Free again the slots reallocated but not refilled, so a retry starts from freed.

    One that cannot be freed stays marked ``refill``: a retry fills it. It runs while
    a failure is handled, and its callers raise an ``OffloadError`` saying what stays
    offloaded right after; so nothing here may escape, an interrupt included, or that
    error (and, in ``hm.compact``, the pool's only reference) would be lost.

    Args:
        slots: the slots of the failed reload.
        stream: where their copies were queued: those must land first.
    """
    with contextlib.suppress(BaseException):  # copies queued before the failure must land
        _torch.synchronize_stream(stream)
    for slot in slots:
        if slot.refill:
            with contextlib.suppress(BaseException):
                _torch.resize_storage(slot.storage, 0)
                slot.refill = False
    with contextlib.suppress(BaseException):
        _torch.empty_cache()  # give the partial allocations back to the driver


def drop_grads(targets: Sequence[Target]) -> int:
    """Free the gradients of the modules among ``targets`` (``grads="drop"``); their bytes."""
    dropped = 0
    for index, item in enumerate(targets):
        for _, target in flatten(item, f"targets[{index}]"):
            if not isinstance(target, torch.nn.Module):
                continue
            for param in target.parameters():
                if param.grad is None:
                    continue
                local = _torch.local_tensor(param.grad)
                if _torch.is_device_tensor(local):
                    with contextlib.suppress(TypeError):  # counted where it can be
                        dropped += sum(
                            _torch.storage_of(part).nbytes() for part in _torch.dense_parts(local)
                        )
                param.grad = None
    return dropped


def reload_need(slots: Sequence[Slot]) -> int:
    """Device memory reallocating ``slots`` needs, about (bytes; 0 for none).

    Each storage rounded as the caching allocator rounds it, plus one 20 MiB block
    (:meth:`~hybridmem.memory.offload.Offloader.reload_bytes`). Storages allocated
    already, to be refilled (a reload feed's, decision 94), need nothing more.
    """
    total = 0
    for slot in slots:
        if slot.refill and slot.storage.nbytes():  # a reload feed's, allocated already
            continue
        unit = _SMALL_ROUND if slot.nbytes <= _SMALL_SIZE else _LARGE_ROUND
        total += -(-slot.nbytes // unit) * unit
    return total + _HEADROOM if total else 0


def check_reload_way(by: object, copy_engine_first: object) -> int | None:
    """Check a reload's ``by`` and ``copy_engine_first``; the bytes after which kernels copy.

    Returns:
        None for ``by="copy_engine"`` (no kernel), else ``copy_engine_first``.

    Raises:
        ValueError: ``by`` is not one of :data:`RELOAD_WAYS`, or ``copy_engine_first``
            is negative.
        TypeError: ``copy_engine_first`` is not an int.
    """
    if by not in RELOAD_WAYS:
        raise ValueError(f"by must be one of {', '.join(map(repr, RELOAD_WAYS))}, got {by!r}")
    first = check_number("copy_engine_first", copy_engine_first, integer=True, minimum=0)
    return int(first) if by == "kernel" else None


def first_slots(slots: list[Slot], max_bytes: object) -> list[Slot]:
    """The first ``slots`` within ``max_bytes`` (at least one), or all for None.

    Raises:
        TypeError: ``max_bytes`` is not an int or None.
        ValueError: ``max_bytes`` is below 1.
    """
    if max_bytes is None:
        return slots
    limit = check_number(
        "max_bytes", max_bytes, integer=True, minimum=1, expected="a positive int or None"
    )
    taken: list[Slot] = []
    total = 0
    for slot in slots:
        if taken and total + slot.nbytes > limit:
            break
        taken.append(slot)
        total += slot.nbytes
    return taken


def kernel_split(slots: Sequence[Slot], kernel_after: int | None) -> int:
    """The index of the first slot a reload copies by kernel (``len(slots)``: none).

    That slot is the first to start at or past ``kernel_after`` bytes; None: no kernel.
    """
    done = 0
    for index, slot in enumerate(slots):
        if kernel_after is not None and done >= kernel_after:
            return index
        done += slot.nbytes
    return len(slots)
