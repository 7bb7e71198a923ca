"""What an offload or reload reports: what moved, how fast, and the copies' own time.

Scope: a report is a value; :class:`CopyClock` times one transfer's copies on their
stream (CUDA events), never blocking the host until it is read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridmem import _torch
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem.memory.slots import Slot, groups_of

__all__ = ["CopyClock", "OffloadReport"]


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
        and the bench its offload rate.
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
