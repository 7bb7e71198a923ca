"""Freeing an offload's device storage: all or none, and chunk by chunk as its copies land.

:func:`free_slots` frees
storages whose copies have landed, all or none. :func:`free_as_landed` does it chunk
by chunk while the later copies still run, and gives each chunk's memory back to the
driver at once.

Why chunk by chunk: returning what an offload freed (the driver
unmapping and releasing expandable segments' pages) took 44-48 ms after a 16-34 GiB
offload in the bench's switch to rollout, in a stage of its own after the copies.
Measured on an H200 (``benchmarks/release_during_offload.py``, 16 GiB in 64 MiB
tensors, medians of five): the copies and then the release took 1.114x the copies
alone; freeing and releasing every 512 MiB as those copies landed, while the later ones
ran, 1.004x (1.007x every 1 GiB, 1.014x every 2 GiB). Unmapping does not slow the copy
engines. With classic segments each release waits for the device (``cudaFree``
synchronizes), which costs what the one release after the copies cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hybridmem import _torch
from hybridmem._errors import OffloadError
from hybridmem.memory.offload_report import OffloadReport
from hybridmem.memory.slots import Slot, groups_of

__all__ = ["LANDING_CHUNK_BYTES", "Landing", "OffloadInFlight", "free_as_landed", "free_slots"]

#: Bytes of copies between two landings: every 512 MiB cost 1.004x the copies alone
#: on the H200 (the last chunk's release is all that is left after them).
LANDING_CHUNK_BYTES = 512 << 20

Slots = Callable[[Sequence[Slot]], None]


def _listed(slots: Sequence[Slot]) -> str:
    return ", ".join(groups_of(slots))


def _stranded(what: str, freed: Sequence[Slot], again: BaseException) -> OffloadError:
    """The error for storages freed whose putting back failed too: they stay offloaded."""
    return OffloadError(
        f"{what}, and putting back the {len(freed)} storages freed before it failed too "
        f"({again!r}): those stay offloaded (of {_listed(freed)}), their data intact in "
        "the host pool; Offloader.reload() brings them back, every other target is as it was",
        offloaded=frozenset(s.group for s in freed),
    )


def free_slots(slots: Sequence[Slot], restore: Slots, unallocate: Slots) -> None:
    """Free the slots' device storage and mark them offloaded, all or none.

    Args:
        slots: storages whose copies to the pool have landed.
        restore: reallocates and refills freed slots from the pool (blocking).
        unallocate: frees again slots reallocated but not refilled.

    Raises:
        OffloadError: one could not be freed. Those freed before it were put back,
            or, if that failed too, stay offloaded (their data is in the pool, the
            error names their groups), so that ``reload()`` finds them.
    """
    freed: list[Slot] = []
    try:
        for slot in slots:
            _torch.resize_storage(slot.storage, 0)
            freed.append(slot)
    except BaseException as exc:
        failed = slots[len(freed)].name
        try:
            restore(freed)
        except BaseException as again:
            for slot in freed:
                slot.offloaded = True
            unallocate(freed)  # back to freed: what reload() starts from
            raise _stranded(f"offload failed freeing {failed} ({exc!r})", freed, again) from exc
        raise OffloadError(
            f"offload failed freeing {failed} ({exc!r}); the {len(freed)} storages freed "
            "before it were put back from the host pool: every target is as it was"
        ) from exc
    for slot in slots:
        slot.offloaded = True


class Landing:
    """Events on an offload's side stream, one after every ``chunk`` bytes of copies.

    Args:
        chunk: bytes of copies between two events (None: :data:`LANDING_CHUNK_BYTES`).

    Example:
        >>> landing = Landing(512 << 20)
        >>> landing.copied(None, 1 << 30)   # no stream (not CUDA): nothing recorded
        >>> list(landing.landed(1))
        [1]

    Scope: one offload, on the thread that queues its copies.
    """

    def __init__(self, chunk: int | None = None) -> None:
        self.chunk = LANDING_CHUNK_BYTES if chunk is None else chunk
        self._count = 0  # copies queued
        self._since = 0  # bytes queued since the last event
        self._events: list[tuple[int, Any]] = []  # (copies queued before it, event)

    def copied(self, stream: Any, nbytes: int) -> None:
        """Note one copy of ``nbytes`` queued on ``stream``; record an event every chunk."""
        self._count += 1
        self._since += nbytes
        if stream is not None and self._since >= self.chunk:
            event = _torch.new_event()
            _torch.record_event(event, stream)
            self._events.append((self._count, event))
            self._since = 0

    def landed(self, total: int) -> Iterator[int]:
        """Yield how many of the ``total`` copies have landed, chunk by chunk (waiting).

        The last value is always ``total``, not waited for here: the caller waits
        for the stream, which covers the copies after the last event.
        """
        for count, event in self._events:
            if count < total:
                _torch.synchronize_event(event)
                yield count
        yield total


def free_as_landed(
    slots: Sequence[Slot], landing: Landing, side: Any, restore: Slots, unallocate: Slots
) -> None:
    """Free ``slots`` chunk by chunk as their copies land, emptying the cache after each.

    Args:
        slots: the storages copied, in the order their copies were queued.
        landing: the events recorded while they were queued.
        side: the side stream the copies run on.
        restore, unallocate: as for :func:`free_slots`.

    Raises:
        OffloadError: a chunk could not be freed. The chunks freed before it were
            reloaded from the pool (every target is as it was), or, where that failed
            or the failing chunk could not be put back, they stay offloaded with
            their data intact in the host pool (the error names their groups;
            ``Offloader.reload()`` brings them back).
    """
    done = 0
    try:
        for upto in landing.landed(len(slots)):
            if upto == len(slots):
                _torch.synchronize_stream(side)  # the copies after the last event
            free_slots(slots[done:upto], restore, unallocate)
            done = upto
            _torch.empty_cache()  # unmapped while the later copies run
    except BaseException as exc:
        with contextlib.suppress(BaseException):  # copies still in flight write the pool
            _torch.synchronize_stream(side)
        if done and done < len(slots):
            _undo(slots[:done], len(slots), exc, restore)
        raise  # nothing freed, or all of it (the last release failed), or an interrupt


def _undo(freed: Sequence[Slot], total: int, exc: BaseException, restore: Slots) -> None:
    """Reload the chunks freed before a failure, and raise what to say (not for interrupts).

    A chunk that failed and could not be put back either (``exc.offloaded``) leaves
    the chunks before it offloaded too: nothing more is moved while the device refuses.
    """
    done = len(freed)
    stuck = isinstance(exc, OffloadError) and bool(exc.offloaded)
    if not stuck:
        try:
            restore(freed)
        except BaseException as again:
            what = f"offload failed after {done} of {total} storages were freed ({exc!r})"
            raise _stranded(what, freed, again) from exc
        for slot in freed:
            slot.offloaded = False
    if isinstance(exc, OffloadError) and stuck:
        raise OffloadError(
            f"{exc}; the {done} storages freed in earlier chunks stay offloaded too (of "
            f"{_listed(freed)}), their data intact in the host pool",
            offloaded=exc.offloaded | {s.group for s in freed},
        ) from exc.__cause__
    if isinstance(exc, OffloadError):
        raise OffloadError(
            f"{exc}; the {done} storages freed in earlier chunks were reloaded too"
        ) from exc.__cause__
    if isinstance(exc, Exception):
        raise OffloadError(
            f"offload failed after {done} of {total} storages were freed ({exc!r}); "
            "those were reloaded from the host pool: every target is as it was"
        ) from exc


class OffloadInFlight:
    """An offload whose copies are queued and whose device storage is not freed yet.

    Made by :meth:`Offloader.start_offload <hybridmem.memory.offload.Offloader.start_offload>`.
    :meth:`finish` frees the storages (as their copies land, with ``release_cache``)
    and reports, as ``offload()`` does; :meth:`cancel` waits for the copies and frees
    nothing, so every target stays as it was. One of the two, once; until then the
    Offloader refuses every other call.

    Args:
        free: frees the storages and returns the report (the Offloader's).
        wait: waits for the queued copies.

    Example:
        >>> flight = off.start_offload()   # doctest: +SKIP
        >>> sync_weights(); report = flight.finish()  # doctest: +SKIP

    Scope: the Offloader's device; not thread-safe.
    """

    def __init__(self, free: Callable[[], OffloadReport], wait: Callable[[], None]) -> None:
        self._free: Callable[[], OffloadReport] | None = free
        self._wait = wait
        self.report: OffloadReport | None = None  # set by finish()

    @classmethod
    def done(cls, report: OffloadReport) -> OffloadInFlight:
        """An offload with nothing to copy: its ``finish()`` returns ``report``."""
        return cls(lambda: report, lambda: None)

    @property
    def pending(self) -> bool:
        """Whether neither :meth:`finish` nor :meth:`cancel` was called (a failed one counts)."""
        return self._free is not None

    def __repr__(self) -> str:
        return f"OffloadInFlight(pending={self.pending})"

    def finish(self) -> OffloadReport:
        """Wait for the copies, free the storages, return the report (also logged).

        Raises:
            RuntimeError: already finished or cancelled.
            OffloadError: freeing failed midway, as for ``offload()``; the offload
                has ended either way (what was freed was put back or is named).
        """
        free = self._take("finish")
        self.report = free()
        return self.report

    def cancel(self) -> None:
        """Wait for the copies and free nothing: every target stays as it was.

        Raises:
            RuntimeError: already finished or cancelled.
        """
        self._take("cancel")
        self._wait()

    def _take(self, call: str) -> Callable[[], OffloadReport]:
        if self._free is None:
            raise RuntimeError(f"OffloadInFlight.{call}(): this offload has already ended")
        free, self._free = self._free, None  # ended, even if what follows fails
        return free
