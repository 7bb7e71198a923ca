"""Move resident tensors out of classic segments, so no cache stays stuck around them.

The caching allocator gives every request over 1 MiB a classic segment rounded up
to 2 MiB (or a share of a 20 MiB one): a 10.7 MiB weight sits in a 12 MiB segment.
While the tensor lives, ``empty_cache`` cannot return the 1.3 MiB left over, so a
model built before any expandable-segments scope keeps about 1 MiB of cache per
large weight through every rollout (99.7 MiB for the bench's 369 M-parameter Llama,
measured on an H200: docs/benchmarks.md). In an expandable segment, tensors are
packed one after the other and free pages are unmapped.

:func:`compact` moves the device storages of its targets that live in classic
segments into expandable segments, **in place**: each ``UntypedStorage`` is freed
and reallocated (``resize_``), so every ``Parameter``, view and tied weight keeps
its identity, and optimizers and hooks keep working. All of them leave the device
first (through an :class:`~hybridmem.Offloader`'s pinned pool, then released), and
only then come back: the allocator hands out cached classic blocks whatever the
setting says (best fit over one pool), so a storage reallocated while the classic
segments of the others are still there lands in them (measured on the H200: the
bench's 128 MiB embedding went back into an 852 MiB classic segment and kept 596
MiB of it cached).

Where tensors must stay in classic segments (shared through classic CUDA IPC,
``cudaIpcGetMemHandle``, which expandable segments refuse), ``into="segment"``
puts them back to back in **one** classic segment: the allocator's rounding is paid
once, not once per tensor. Neither way can reach memory of a private pool, such as
a torch_memory_saver region (a ``torch.cuda.MemPool`` in both of its hook modes):
``empty_cache`` keeps a private pool's free segments while the pool lives, so a
move would leave the old ones cached beside the new (measured on an H200:
docs/benchmarks.md). An engine packs its region's weights when it makes them,
with :func:`hybridmem.one_segment`.

Scope: one CUDA device per call (the targets'), process-global allocator settings
for the duration; not thread-safe (no other thread may allocate meanwhile). Memory
this process does not own (``cudaMallocAsync`` pools, memory imported through CUDA
IPC) and memory of a private pool (a CUDA graph's, a ``torch.cuda.MemPool``) is left where
it is; so, with the default ``into``, is memory outside classic segments.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybridmem import _torch
from hybridmem._checks import check_bool
from hybridmem._env import disabled
from hybridmem._errors import OffloadError
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem._names import suggests_keywords
from hybridmem.allocator.state import ENGINE
from hybridmem.memory.offload import Offloader
from hybridmem.memory.targets import Target, device_storages, select_groups
from hybridmem.observe import timeline as _timeline
from hybridmem.observe.memory import read_memory
from hybridmem.scopes.allocator import expandable_segments

__all__ = ["INTO", "CompactError", "CompactReport", "compact"]

#: Where :func:`compact` can put the storages it moves.
INTO = ("expandable", "segment")
#: How a report words each ``into``: where they went, where the stuck ones are, and
#: where there was no room.
_PLACES = {
    "expandable": ("expandable segments", "back in classic segments", "expandable ones"),
    "segment": ("one segment", "outside it", "one segment"),
}


@dataclass(frozen=True)
class CompactReport:
    """What one :func:`compact` did.

    Attributes:
        moved: storages moved into expandable segments (``into="segment"``: into
            the one segment).
        nbytes: their bytes.
        kept: device storages left where they were (already outside classic
            segments, in a private pool, not this process's to move, or, with
            ``into="segment"``, of 1 MiB or less).
        stuck: storages that came back elsewhere all the same: there was no room
            in expandable segments (or for the one segment), or a classic segment that
            another tensor (not a target) still holds had room for them (small
            tensors share 2 MiB segments).
        seconds: wall-clock time, copies and cache release included.
        reserved_before, reserved_after: ``torch.cuda.memory_reserved`` of the
            device before and after (0 when nothing was read).
        cached_before, cached_after: reserved minus allocated, before and after:
            the cache that a release could not return.
        device: the CUDA device (``""`` when no target is on one).
        reason: why nothing moved, when nothing could (``""`` otherwise).
        into: where they went: ``"expandable"`` segments or one ``"segment"``.
    """

    moved: int
    nbytes: int
    kept: int
    seconds: float
    stuck: int = 0
    reserved_before: int = 0
    reserved_after: int = 0
    cached_before: int = 0
    cached_after: int = 0
    device: str = ""
    reason: str = ""
    into: str = "expandable"

    def __str__(self) -> str:
        if self.reason:
            return f"compact: nothing moved ({self.reason})"
        return (
            f"compact on {self.device}: moved {self.moved} storages "
            f"({fmt_bytes(self.nbytes)}) into {_PLACES[self.into][0]}, kept {self.kept}"
            f"{f', {self.stuck} {_PLACES[self.into][1]}' if self.stuck else ''}; "
            f"cache {fmt_bytes(self.cached_before)} -> {fmt_bytes(self.cached_after)}, "
            f"{self.seconds * 1e3:.1f} ms"
        )


class CompactError(OffloadError):
    """A compaction took storages off the device and could not put them back.

    Attributes:
        offloader: holds their bytes in its host pool: nothing is lost; call
            ``error.offloader.reload()`` once the device has room.
    """

    def __init__(self, message: str, offloader: Offloader) -> None:
        super().__init__(message, offloaded=offloader.offloaded_groups)
        self.offloader = offloader


def _nothing(reason: str, start: float, kept: int = 0, device: str = "") -> CompactReport:
    logger.info("compact: nothing moved (%s)", reason)
    return CompactReport(0, 0, kept, time.perf_counter() - start, device=device, reason=reason)


def _is_classic(view: torch.Tensor) -> bool:
    return bool(
        _torch.storage_resizable(view.untyped_storage()) and _torch.is_legacy_ipc_capable(view)
    )


def _movable(view: torch.Tensor, into: str, private: list[tuple[int, int]]) -> bool:
    """Whether ``compact(into=into)`` moves this storage (``private``: private pools)."""
    address = _torch.storage_address(view.untyped_storage())
    if any(start <= address < start + size for start, size in private):
        return False  # empty_cache keeps a private pool's segments: both copies would stay
    if into == "segment":
        storage = view.untyped_storage()
        return _torch.storage_resizable(storage) and storage.nbytes() > _torch.SMALL_REQUEST_BYTES
    return _is_classic(view)


def _carve(
    offloader: Offloader, todo: list[torch.Tensor], total: int, device: torch.device
) -> list[torch.Tensor]:
    """Reload into one block of ``total`` bytes, freed just before; return those inside it.

    The allocator keeps the freed block cached and serves each request from it (best
    fit on this stream, split when more than 1 MiB remains): the storages land back to
    back, in one segment allocated in the caller's context (a torch_memory_saver
    region). No room for the block: the classic segments, wherever they fit.

    Raises:
        CompactError: nothing fitted (the bytes stay in ``offloader``'s pool).
    """
    try:
        with expandable_segments(False, release_cache=False):
            start = _torch.hold_block(total, device)  # cached: the reload is carved from it
            offloader.reload()
    except (torch.OutOfMemoryError, OffloadError):
        _bring_back(offloader, expandable=False)
        return []
    return [v for v in todo if start <= _torch.storage_address(v.untyped_storage()) < start + total]


def _bring_back(offloader: Offloader, *, expandable: bool) -> bool:
    """Reload into expandable segments (else classic ones); True if expandable worked.

    Raises:
        CompactError: nothing fitted (the bytes stay in ``offloader``'s pool).
    """
    cause: BaseException | None = None
    if expandable:
        try:
            with expandable_segments(True, release_cache=True):
                offloader.reload()
            return True
        except OffloadError as exc:  # no room there: the classic segments, then
            cause = exc.__cause__ or exc
    try:
        with expandable_segments(False, release_cache=False):
            offloader.reload()
    except OffloadError as again:
        raise CompactError(
            f"compact could not bring the tensors it took off the device back "
            f"({cause!r}; in classic segments: {again.__cause__!r}). Their bytes are in the "
            "host pool: call error.offloader.reload() once the device has room",
            offloader,
        ) from again
    return False


@suggests_keywords
@_timeline.traced("compact", lambda r: {"nbytes": r.nbytes, "moved": r.moved})
def compact(
    *targets: Target,
    groups: str | Iterable[str] | None = None,
    release_cache: bool = True,
    into: str = "expandable",
) -> CompactReport:
    """Move the targets' tensors in classic segments into expandable segments, in place.

    Call it once after building the model (or after loading a checkpoint) and before
    the first switch, for the tensors that stay on the device through rollout
    (parameters a trainer keeps resident, buffers). The optimizer state an
    :class:`~hybridmem.Offloader` moves is reallocated at every reload, in the
    settings in force there: ``HybridSwitch`` reloads it in its backend's ``train``
    recipe's mode. Building the model inside ``hm.phase("train")``
    (or ``hm.expandable_segments(True)``) has the effect of compacting it.

    The storages go through pinned host memory (as many bytes as they hold, released
    at the end): a few tens of milliseconds per GiB on an H200. Do not compact
    tensors that a CUDA graph captured or that another process opened through CUDA
    IPC: both hold the old address (share them again after).

    Args:
        *targets: as for :class:`~hybridmem.Offloader`: modules, optimizers,
            tensors, dicts/lists of them.
        groups: the groups to move (``None``: all): ``"parameters"``,
            ``"buffers"``, ``"gradients"``, ``"optimizer"``, ``"tensors"``.
        release_cache: return the emptied segments to the driver at the end.
        into: ``"expandable"`` (the default): into expandable segments, for the
            tensors in classic segments. ``"segment"``: every storage over 1 MiB
            (smaller ones share the allocator's 2 MiB segments already), back to
            back into one classic segment, with expandable segments off.

    Returns:
        A :class:`CompactReport` (also logged at INFO). Nothing moves, and the report
        says why, when hybridmem is disabled, no target is on a GPU, the allocator is
        ``cudaMallocAsync``, or the env sets ``expandable_segments:False``
        explicitly (hybridmem never overrides that).

    Raises:
        TypeError: a target is not a module, optimizer, tensor or container of them,
            or a target tensor has no storage of its own (before anything moves).
        ValueError: an unknown group or ``into``, or targets on several devices
            (before anything moves).
        OffloadError: taking them off failed (nothing moved, all data intact), or
            :class:`CompactError`: they could not come back even in classic
            segments; their bytes are in ``error.offloader``'s host pool.

    Scope: the targets' device; the allocator settings are switched process-wide
    for the call; not thread-safe.

    Example:
        >>> model, optimizer = build_trainer()          # doctest: +SKIP
        >>> print(hm.compact(model, optimizer))         # doctest: +SKIP
        compact on cuda:0: moved 48 storages (512.06 MiB) into expandable segments, kept 0,
        48 back in classic segments; cache 65.69 MiB -> 9.69 MiB, 307.5 ms
        >>> print(hm.compact(shared_weights, into="segment"))  # doctest: +SKIP
    """
    start = time.perf_counter()
    wanted = select_groups(groups)
    check_bool("release_cache", release_cache)
    if into not in INTO:
        raise ValueError(
            f"compact(into=...) must be one of {', '.join(map(repr, INTO))}, got {into!r}: "
            "'expandable' for tensors that may live in expandable segments, 'segment' "
            "for tensors that must stay in classic ones (shared through classic CUDA "
            "IPC); a torch_memory_saver region's tensors are packed when they are made, "
            "with hm.one_segment"
        )
    if disabled():
        return _nothing("HYBRIDMEM_DISABLE is on", start)
    found = [
        (storage, device)
        for _, storage, group, device in device_storages(targets, who="compact", action="move")
        if group in wanted and storage.nbytes() > 0
    ]
    devices = {device for _, device in found}
    if len(devices) > 1:
        listed = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"compact targets span several devices ({listed}); compact each one")
    if not found:
        return _nothing("no target tensor is on a GPU", start)
    (device,) = devices
    if ENGINE.backend() == "cudaMallocAsync":
        return _nothing("the allocator backend is cudaMallocAsync", start, len(found), str(device))
    forbidding = ENGINE.env_expandable_false() if into == "expandable" else None
    if forbidding is not None:
        return _nothing(
            f"{forbidding} sets expandable_segments:False explicitly",
            start,
            len(found),
            str(device),
        )
    views = [_torch.storage_bytes(storage, device) for storage, _ in found]
    index = device.index if device.index is not None else _torch.current_device()
    private = _torch.private_pool_ranges(index) if index is not None else []
    todo = [v for v in views if _movable(v, into, private)]
    total = sum(_torch.block_bytes(v.untyped_storage().nbytes()) for v in todo)
    reserved_before, cached_before = _cache(index)
    moved: list[torch.Tensor] = []
    if todo:
        offloader = Offloader(todo, device=device if device.type == "cuda" else None)
        try:
            offloader.offload(release_cache=False)  # all or nothing (see the handler below)
            _release_classic(index)
            if into == "segment":
                moved = _carve(offloader, todo, total, device)
                placed = bool(moved)
            else:
                placed = _bring_back(offloader, expandable=True)
                moved = [v for v in todo if not _is_classic(v)] if placed else []
        except CompactError:
            raise  # the caller's to reload: the pool stays pinned until then
        except BaseException as exc:  # failed or interrupted: nothing may stay off
            # What is still offloaded (an interrupt, or an offload that could not put
            # back what it freed) comes back before unpinning; CompactError keeps it.
            if offloader.offloaded_groups:
                _bring_back(offloader, expandable=False)
            offloader.close()
            if isinstance(exc, OffloadError) and exc.offloaded:
                raise OffloadError(
                    f"compact failed taking its targets off the device ({exc.__cause__!r}); "
                    "it brought back what it had freed: every target is as it was"
                ) from exc
            raise
        offloader.close()  # unpinned at once, not when garbage-collected
        if len(moved) < len(todo):
            logger.info(
                "compact: %d of %d storages came back %s (%s)",
                len(todo) - len(moved),
                len(todo),
                _PLACES[into][1],
                f"no room in {_PLACES[into][2]}"
                if not placed
                else "segments that other live tensors hold had room for them",
            )
    if release_cache:
        _torch.empty_cache()
    reserved_after, cached_after = _cache(index)
    report = CompactReport(
        moved=len(moved),
        nbytes=sum(v.untyped_storage().nbytes() for v in moved),
        kept=len(views) - len(todo),
        seconds=time.perf_counter() - start,
        stuck=len(todo) - len(moved),
        reserved_before=reserved_before,
        reserved_after=reserved_after,
        cached_before=cached_before,
        cached_after=cached_after,
        device=str(device),
        into=into,
    )
    logger.info("%s", report)
    return report


def _release_classic(index: int | None) -> None:
    """Return the classic segments the offload emptied, before anything is reallocated.

    The cuBLAS workspaces go first: one left in a classic segment keeps all of it
    (see :func:`hybridmem.release_cache`). Emptied here, not by the expandable scope,
    which empties the cache only when the setting changes.
    """
    if index is not None and _torch.cuda_initialized():
        _torch.synchronize(index)
        _torch.clear_blas_workspaces()
    _torch.empty_cache()


def _cache(index: int | None) -> tuple[int, int]:
    """``(reserved, reserved - allocated)`` of device ``index`` now (0s without CUDA)."""
    if index is None or not _torch.cuda_initialized():
        return 0, 0
    _torch.synchronize(index)
    memory = read_memory(index)
    return memory.reserved, memory.reserved - memory.allocated
