"""Hand cached device memory back to the driver: ``release_cache`` and its scoped form.

Memory that torch's caching allocator holds but no tensor uses is invisible to a
rollout engine in another process (verl #5384: vLLM failed its start-up free
memory check because of the trainer's cache). :func:`release_cache` returns it, in
the order that frees the most: synchronise, collect garbage, collect CUDA IPC
leftovers, empty the cache.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

from hybridmem import _torch
from hybridmem._checks import check_bool
from hybridmem._devices import DeviceArg, resolve_devices
from hybridmem._env import disabled
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem._names import suggests_keywords
from hybridmem._scope import ScopedContext
from hybridmem.observe import timeline as _timeline
from hybridmem.observe.memory import MemoryInfo, read_memory

__all__ = [
    "STUCK_CACHE_BYTES",
    "CacheRelease",
    "DeviceRelease",
    "Garbage",
    "ReleaseReport",
    "aggressive_cache_release",
    "check_garbage",
    "check_release_args",
    "release_cache",
    "release_seconds",
]

#: A garbage-collection pass is repeated only while the previous one freed device
#: memory, and never more than this (verl's helper ran 3 full passes every time).
MAX_GC_ROUNDS = 3
#: ``collect_garbage="young"``: generations 0 and 1 (``gc.collect(1)``).
_YOUNG = 1
_FULL = 2

#: What one release collects: ``True`` a full ``gc.collect()`` (repeated while it frees
#: device memory), ``False`` none, ``"young"`` generations 0 and 1 only.
Garbage = bool | Literal["young"]
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class DeviceRelease:
    """Memory of one device before and after a release: two readings.

    Attributes:
        device: the CUDA device index.
        before, after: the :class:`~hybridmem.observe.memory.MemoryInfo` readings.
    """

    device: int
    before: MemoryInfo
    after: MemoryInfo

    @property
    def allocated_before(self) -> int:
        """Bytes held by live tensors before."""
        return self.before.allocated

    @property
    def allocated_after(self) -> int:
        """Bytes held by live tensors after."""
        return self.after.allocated

    @property
    def reserved_before(self) -> int:
        """Bytes torch's caching allocator held before."""
        return self.before.reserved

    @property
    def reserved_after(self) -> int:
        """Bytes torch's caching allocator holds after."""
        return self.after.reserved

    @property
    def free_before(self) -> int:
        """Device-wide free bytes before (all processes)."""
        return self.before.free or 0

    @property
    def free_after(self) -> int:
        """Device-wide free bytes after (all processes)."""
        return self.after.free or 0

    @property
    def total(self) -> int:
        """Device memory in bytes."""
        return self.after.total or 0

    @property
    def returned(self) -> int:
        """Bytes of reserved memory handed back to the driver."""
        return self.reserved_before - self.reserved_after


@dataclass(frozen=True)
class ReleaseReport:
    """What :func:`release_cache` did and what it achieved.

    Attributes:
        devices: one :class:`DeviceRelease` per device acted on (empty when no
            device was initialised, or with ``HYBRIDMEM_DISABLE=1``).
        synchronized: whether the devices were synchronised first.
        gc_rounds: garbage-collection passes run.
        gc_collected: unreachable objects those passes found.
        ipc_collected: whether CUDA IPC leftovers were collected.
        duration_s: wall-clock seconds the release took.
    """

    devices: tuple[DeviceRelease, ...]
    synchronized: bool
    gc_rounds: int
    gc_collected: int
    ipc_collected: bool
    duration_s: float

    @property
    def bytes_returned(self) -> int:
        """Reserved bytes handed back to the driver, summed over devices."""
        return sum(d.returned for d in self.devices)

    @property
    def reserved_before(self) -> int:
        """Reserved bytes before, summed over devices."""
        return sum(d.reserved_before for d in self.devices)

    @property
    def reserved_after(self) -> int:
        """Reserved bytes after, summed over devices."""
        return sum(d.reserved_after for d in self.devices)

    @property
    def allocated_before(self) -> int:
        """Allocated bytes before, summed over devices."""
        return sum(d.allocated_before for d in self.devices)

    @property
    def allocated_after(self) -> int:
        """Allocated bytes after, summed over devices."""
        return sum(d.allocated_after for d in self.devices)

    @property
    def free_before(self) -> int:
        """Device-wide free bytes before, summed over devices."""
        return sum(d.free_before for d in self.devices)

    @property
    def free_after(self) -> int:
        """Device-wide free bytes after, summed over devices."""
        return sum(d.free_after for d in self.devices)

    def __str__(self) -> str:
        if not self.devices:
            return f"release_cache: no initialised CUDA device, nothing to do ({self._how()})"
        names = ",".join(str(d.device) for d in self.devices)
        return (
            f"release_cache(cuda:{names}): returned {fmt_bytes(self.bytes_returned)}; "
            f"reserved {fmt_bytes(self.reserved_before)} -> {fmt_bytes(self.reserved_after)}, "
            f"allocated {fmt_bytes(self.allocated_before)} -> {fmt_bytes(self.allocated_after)}, "
            f"device free {fmt_bytes(self.free_before)} -> {fmt_bytes(self.free_after)} "
            f"({self._how()})"
        )

    def _how(self) -> str:
        return (
            f"sync={self.synchronized}, gc rounds={self.gc_rounds} "
            f"(collected {self.gc_collected}), ipc_collect={self.ipc_collected}, "
            f"{self.duration_s * 1e3:.2f} ms"
        )


def check_garbage(collect_garbage: object) -> Garbage:
    """Return ``collect_garbage`` if one release takes it (:data:`Garbage`), else raise.

    Raises:
        TypeError: any other value (a series' ``"once"``/``"adaptive"`` included:
            :class:`~hybridmem.scopes.garbage.GarbagePolicy` takes those).
    """
    if isinstance(collect_garbage, bool) or collect_garbage == "young":
        return collect_garbage
    raise TypeError(f"collect_garbage must be True, False or 'young', got {collect_garbage!r}")


def check_release_args(sync: object, collect_garbage: object, ipc_collect: object) -> None:
    """Refuse what :func:`release_cache` refuses (its own checker: a phase's step uses it too)."""
    check_bool("sync", sync)
    check_garbage(collect_garbage)
    check_bool("ipc_collect", ipc_collect)


def _allocated(devices: list[int]) -> int:
    return sum(int(_torch.memory_stats(d).get("allocated_bytes.all.current", 0)) for d in devices)


@suggests_keywords
@_timeline.traced("release_cache", lambda r: {"returned": r.bytes_returned})
def release_cache(
    device: DeviceArg = None,
    *,
    sync: bool = True,
    collect_garbage: Garbage = True,
    ipc_collect: bool = True,
) -> ReleaseReport:
    """Return cached-but-free device memory to the driver, and say what it freed.

    Order: synchronise the devices (frees wait on pending kernels), collect
    garbage (tensors kept alive only by reference cycles), collect CUDA IPC
    leftovers (blocks that consumers released), free torch's cuBLAS workspaces
    (after a synchronise only: one left in a large segment keeps the whole segment
    cached; the next matmul makes a new one), then empty the cache. One
    garbage-collection pass; another only while the previous one freed device
    memory (at most :data:`MAX_GC_ROUNDS`).

    Scope: acts only on devices that already have a CUDA context in this process
    and never creates one. ``torch.cuda.empty_cache`` empties the cache of every
    initialised device, whichever ``device`` names; ``device`` selects what is
    synchronised and measured. Thread-safe as far as torch's calls are.

    Cost: a full ``gc.collect()`` dominates when ``collect_garbage`` is true
    (tens of ms in a process that imported torch; see docs/concepts.md); the rest
    is well under a millisecond when there is nothing to free.

    Args:
        device: None for the current device, an index, ``"cuda:N"``, a
            ``torch.device``, or ``"all"`` for every initialised device.
        sync: synchronise the devices first.
        collect_garbage: run Python's garbage collector: ``True`` a full pass,
            ``"young"`` generations 0 and 1 only (``gc.collect(1)``: milliseconds,
            but a cycle that has aged into generation 2 stays; see
            :class:`~hybridmem.scopes.garbage.GarbageGate`), ``False`` none.
        ipc_collect: call ``torch.cuda.ipc_collect()``.

    Returns:
        A :class:`ReleaseReport`; it is also logged at INFO on ``hybridmem``.

    Example:
        >>> report = hm.release_cache()          # doctest: +SKIP
        >>> print(report.bytes_returned)         # doctest: +SKIP
    """
    check_release_args(sync, collect_garbage, ipc_collect)
    return _release(
        resolve_devices(device, allow_all=True),
        sync=sync,
        collect_garbage=collect_garbage,
        ipc_collect=ipc_collect,
    )


_spent_lock = threading.Lock()
_spent = [0.0]  # seconds this process spent in release_cache, all threads


def release_seconds() -> float:
    """Seconds this process has spent in :func:`release_cache` so far, all threads together.

    A running total to take differences of: what a step spent handing memory back
    (its synchronise, garbage passes and ``empty_cache``), apart from its other work.

    Returns:
        The total since the process started (0.0 before any release).

    Example:
        >>> before = release_seconds()
        >>> _ = release_cache()  # no device here: returns at once, still counted
        >>> release_seconds() >= before
        True

    Scope: process-global; thread-safe.
    """
    with _spent_lock:
        return _spent[0]


def _count(report: ReleaseReport) -> ReleaseReport:
    with _spent_lock:
        _spent[0] += report.duration_s
    return report


def _release(
    devices: list[int],
    *,
    sync: bool,
    collect_garbage: Garbage,
    ipc_collect: bool,
) -> ReleaseReport:
    start = time.perf_counter()
    if not devices or disabled():
        report = ReleaseReport((), False, 0, 0, False, time.perf_counter() - start)
        logger.debug("%s", report)
        return _count(report)
    before = [read_memory(d) for d in devices]
    if sync:
        for d in devices:
            _torch.synchronize(d)
    rounds = collected = 0
    generation = _YOUNG if collect_garbage == "young" else _FULL
    if collect_garbage:
        while rounds < MAX_GC_ROUNDS:
            allocated = _allocated(devices)
            found = gc.collect(generation)
            rounds += 1
            collected += found
            if found == 0 or _allocated(devices) >= allocated:
                break
    if ipc_collect:
        _torch.ipc_collect()
    if sync:  # nothing queued uses them now: the next matmul makes a new one
        _torch.clear_blas_workspaces()
    _torch.empty_cache()
    after = [read_memory(d) for d in devices]
    report = ReleaseReport(
        devices=tuple(DeviceRelease(d, b, a) for d, b, a in zip(devices, before, after)),
        synchronized=sync,
        gc_rounds=rounds,
        gc_collected=collected,
        ipc_collected=ipc_collect,
        duration_s=time.perf_counter() - start,
    )
    logger.info("%s", report)
    _hint_stuck_cache(after)
    return _count(report)


#: Cache left after a release above which the log says what keeps it (once).
STUCK_CACHE_BYTES = 64 << 20


def _hint_stuck_cache(after: list[MemoryInfo]) -> None:
    """Say once what a cache that no release returns is, and what frees it."""
    stuck = max((m.reserved - m.allocated for m in after), default=0)
    if stuck > STUCK_CACHE_BYTES:
        info_once(
            "stuck-cache",
            f"release_cache: {fmt_bytes(stuck)} stayed cached: free parts of segments that "
            "still hold live tensors, which no release can return. Classic segments round "
            "every tensor over 1 MiB up to 2 MiB, so a model built outside "
            "hm.expandable_segments(True) keeps about 1 MiB per large weight: hm.compact(model) "
            "moves resident tensors into expandable segments once (docs/offload.md)",
        )


_When = Literal["enter", "exit", "both"]
_WHEN_VALUES = ("enter", "exit", "both")


class CacheRelease(ScopedContext):
    """Scoped :func:`release_cache` on entry, exit or both.

    See :func:`aggressive_cache_release`, which builds it.
    """

    def __init__(
        self,
        *,
        on: _When = "exit",
        device: DeviceArg = None,
        sync: bool = True,
        collect_garbage: bool = True,
        ipc_collect: bool = True,
    ) -> None:
        super().__init__()
        if on not in _WHEN_VALUES:
            raise ValueError(f"on must be one of {_WHEN_VALUES}, got {on!r}")
        check_release_args(sync, collect_garbage, ipc_collect)
        resolve_devices(device, allow_all=True)  # validate now, resolve at use
        self.on = on
        self.device = device
        self._kwargs = {
            "sync": sync,
            "collect_garbage": collect_garbage,
            "ipc_collect": ipc_collect,
        }
        self.last_report: ReleaseReport | None = None

    def __repr__(self) -> str:
        return f"aggressive_cache_release(on={self.on!r}, device={self.device!r})"

    def _spans_with_block(self) -> bool:
        return False  # a release is an action at a moment: on __enter__, that call's

    def _release_now(self) -> None:
        self.last_report = release_cache(self.device, **self._kwargs)

    def _enter(self) -> object:
        if self.on in ("enter", "both"):
            self._release_now()
        return None

    def _exit(self, token: object, exc: BaseException | None) -> None:
        if self.on not in ("exit", "both"):
            return
        if exc is None:
            self._release_now()
            return
        try:
            self._release_now()
        except Exception:  # never mask the exception already in flight
            logger.exception("release_cache failed while %r was exiting on an error", self)


@overload
def aggressive_cache_release(func: _F, /) -> _F: ...


@overload
def aggressive_cache_release(
    func: None = None,
    /,
    *,
    on: _When = "exit",
    device: DeviceArg = None,
    sync: bool = True,
    collect_garbage: bool = True,
    ipc_collect: bool = True,
) -> CacheRelease: ...


@suggests_keywords
def aggressive_cache_release(
    func: Any = None,
    /,
    *,
    on: _When = "exit",
    device: DeviceArg = None,
    sync: bool = True,
    collect_garbage: bool = True,
    ipc_collect: bool = True,
) -> Any:
    """Release cached device memory when a block or call starts, ends, or both.

    The scoped, decorating form of :func:`release_cache`: usable as ``with``,
    ``async with``, or as a decorator (``@aggressive_cache_release`` or
    ``@aggressive_cache_release(on="both")``) on functions, coroutine functions,
    generator functions and context-manager classes. A release on exit also runs
    when the block raises; a failure of that release is logged, never raised over
    the original exception.

    Args:
        on: ``"enter"``, ``"exit"`` (default) or ``"both"``.
        device: as for :func:`release_cache` (``"all"`` allowed).
        sync, collect_garbage, ipc_collect: as for :func:`release_cache`.

    Returns:
        A :class:`CacheRelease`; its ``last_report`` holds the latest report.

    Example:
        >>> @hm.aggressive_cache_release(on="exit")   # doctest: +SKIP
        ... def offload_trainer(model): ...
    """
    ctx = CacheRelease(
        on=on, device=device, sync=sync, collect_garbage=collect_garbage, ipc_collect=ipc_collect
    )
    if func is not None:
        return ctx(func)
    return ctx
