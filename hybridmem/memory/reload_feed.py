"""A reload fed to the copy engines a chunk at a time from a thread, until it is told to stop.

Why: the switch's early reload queues a tail of copies
just before the engine's sleep, so that the copy engines work while the engine frees
its memory. Queued in full, the tail cannot be taken back, so it had to be sized by a
guess at how long the sleep will take (the last cycle's), and sleeps vary: 38, 61
and 54 ms in three cycles at 32 GiB in one bench run. A tail that ends early leaves
the copy engines idle for the rest of the sleep (13-17 ms lost per cycle in that
run); one that runs on copies at half rate after it. A feed keeps at most
:data:`FEED_DEPTH` chunks of :data:`FEED_CHUNK_BYTES` in flight, so when the sleep
ends it stops within a chunk or two, and :meth:`ReloadFeed.finish` copies the rest
by kernel, which keeps its rate after a peer's large free where the copy engines
halve theirs.

Made by :meth:`Offloader.start_reload <hybridmem.memory.offload.Offloader.start_reload>`,
which allocates every storage first, in the caller's thread and allocator mode: the
feed's thread only queues copies and waits for events (allocator settings are
process-global, and a second thread changing them under an engine call is a hazard).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

from hybridmem import _torch
from hybridmem._checks import check_number, check_seconds
from hybridmem._errors import OffloadError
from hybridmem._format import first_line
from hybridmem._log import logger
from hybridmem.memory.offload_report import OffloadReport
from hybridmem.memory.slots import Slot, allocate, groups_of

__all__ = ["FEED_CHUNK_BYTES", "FEED_DEPTH", "STOP_TIMEOUT_S", "ReloadFeed"]

#: Bytes of copies between two of the feed's events: 1.2 ms at half the pinned rate of
#: an H200 (27 GB/s), so a stopped feed leaves little in flight.
FEED_CHUNK_BYTES = 32 << 20

#: Chunks the feed keeps queued ahead of the copy engines: one running, one waiting,
#: so the engines never wait for the host between chunks.
FEED_DEPTH = 2

#: How long :meth:`ReloadFeed.stop` and :meth:`ReloadFeed.finish` wait for the feed's
#: thread, which waits for at most :data:`FEED_DEPTH` chunks of copies: far beyond
#: that, the device is hung.
STOP_TIMEOUT_S = 60.0


class ReloadFeed:
    """A reload by copy engine, fed a chunk at a time from a thread until stopped.

    Args:
        slots: the offloaded storages to reload, in the targets' order.
        stream: the feed's own stream (None off CUDA): a rest copied by kernel on
            the Offloader's side stream does not wait for the chunks still in flight.
        device: the Offloader's device.
        copy: queues one slot's copy from the pool (current stream; no allocation).
        rest: reloads slots already allocated, ``by`` kernel or copy engine, and
            waits for its copies (the Offloader's).
        unallocate: frees again slots allocated but not filled (the Offloader's).
        report: the report of the given slots (the Offloader's, logged).
        chunk_bytes: bytes of copies between two events (the pacing unit).

    Example:
        >>> feed = off.start_reload()       # doctest: +SKIP
        >>> # the copy engines work meanwhile
        >>> engine.sleep()  # doctest: +SKIP
        >>> # the rest, after the sleep
        >>> feed.finish(by="kernel")  # doctest: +SKIP

    Scope: the Offloader's device. :meth:`stop` and :meth:`finish` from the thread
    that started it; the Offloader refuses every other call until one of them ends
    the feed.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        stream: Any,
        device: Any,
        *,
        copy: Callable[[Slot], None],
        rest: Callable[[Sequence[Slot], Literal["kernel", "copy_engine"]], None],
        unallocate: Callable[[Sequence[Slot]], None],
        report: Callable[[Sequence[Slot]], OffloadReport],
        chunk_bytes: int = FEED_CHUNK_BYTES,
    ) -> None:
        self._slots = list(slots)
        self._stream = stream
        self._device = device
        self._copy = copy
        self._rest = rest
        self._unallocate = unallocate
        self._report_of = report
        self._chunk = int(
            check_number("chunk_bytes", chunk_bytes, integer=True, minimum=1, expected="bytes")
        )
        self._fed = 0  # slots whose copies are queued, in order
        self._since = 0  # bytes queued since the last event
        self._events: deque[Any] = deque()  # one per chunk, oldest first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ended = not self._slots
        self.error: BaseException | None = None  # what stopped the thread early
        self.report: OffloadReport | None = None  # set when the feed ends

    @classmethod
    def done(cls, report: OffloadReport) -> ReloadFeed:
        """A feed with nothing to reload: ended, its report ``report``."""
        feed = cls(
            [],
            None,
            None,
            copy=lambda slot: None,
            rest=lambda slots, by: None,
            unallocate=lambda slots: None,
            report=lambda slots: report,
        )
        feed.report = report
        return feed

    @property
    def pending(self) -> bool:
        """Whether neither :meth:`stop` nor :meth:`finish` has ended the feed."""
        return not self._ended

    @property
    def fed_bytes(self) -> int:
        """Bytes whose copies the feed has queued so far (read from any thread)."""
        return sum(slot.nbytes for slot in self._slots[: self._fed])

    def __repr__(self) -> str:
        return f"ReloadFeed(pending={self.pending}, fed {self._fed} of {len(self._slots)} storages)"

    # ------------------------------------------------------------------ #
    # Feeding
    # ------------------------------------------------------------------ #
    def start(self) -> None:
        """Allocate every slot here, feeding the copies as the window allows; then the thread.

        Allocating maps memory for tens of milliseconds (16 GiB of expandable
        segments), so copies are queued between allocations whenever a chunk has
        landed (polled, never waited for), and the copy engines work meanwhile.

        Raises:
            OffloadError: an allocation (out of memory) or a copy failed: what was
                queued before it is reloaded, the rest freed again and still offloaded.
        """
        _torch.wait_stream(self._stream, _torch.current_stream(self._device))
        try:
            for index, slot in enumerate(self._slots):
                allocate(slot)
                self._feed(index + 1, wait=False)
        except BaseException as exc:
            self._end_after_failure()
            rest = self._slots[self._fed :]
            listed = ", ".join(groups_of(rest))
            raise OffloadError(
                f"reload feed failed at {rest[0].name} ({type(exc).__name__}: "
                f"{first_line(exc)}): {self._fed} storages were reloaded; {len(rest)} of "
                f"{listed} are intact in the host pool and still offloaded; call reload() "
                "once the device has room",
                offloaded=frozenset(s.group for s in rest),
            ) from exc
        self._thread = threading.Thread(target=self._run, name="hybridmem-reload-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._feed(len(self._slots), wait=True)
        except BaseException as exc:  # the rest is reloaded by finish(), or stays offloaded
            self.error = exc

    def _feed(self, ready: int, *, wait: bool) -> None:
        """Queue the copies of the first ``ready`` slots while the window has room.

        ``wait``: block on the oldest chunk's event when the window is full (the
        thread), else return (the allocating caller, which polls).
        """
        while self._fed < ready and not self._stop.is_set():
            if len(self._events) >= FEED_DEPTH:
                if wait:
                    _torch.synchronize_event(self._events[0])
                elif not _torch.query_event(self._events[0]):
                    return
                self._events.popleft()
                continue  # stopped meanwhile?
            slot = self._slots[self._fed]
            with _torch.stream_scope(self._stream):
                self._copy(slot)
            slot.refill = False
            slot.offloaded = False
            self._fed += 1
            self._since += slot.nbytes
            if self._stream is not None and (
                self._since >= self._chunk or self._fed == len(self._slots)
            ):
                event = _torch.new_event()
                _torch.record_event(event, self._stream)
                self._events.append(event)
                self._since = 0

    # ------------------------------------------------------------------ #
    # Ending
    # ------------------------------------------------------------------ #
    def _halt(self, timeout_s: float) -> None:
        """Stop the thread (it finishes the copy it is queueing) and wait for it."""
        if self._ended:
            raise RuntimeError("this reload feed has already ended (stop() or finish())")
        check_seconds("timeout_s", timeout_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise OffloadError(
                    f"the reload feed's thread did not stop within {timeout_s:g} s: a copy "
                    f"never completed (the device may be hung). {self._fed} storages were "
                    "queued; the rest are intact in the host pool; the Offloader stays busy",
                    offloaded=frozenset(s.group for s in self._slots[self._fed :]),
                )
        if self.error is not None:
            logger.info(
                "reload feed stopped early after %d storages (%r); the rest is reloaded "
                "after it or stays offloaded",
                self._fed,
                self.error,
            )

    def _close(self) -> OffloadReport:
        """Order the current stream after the fed copies; hand the stream back; report."""
        current = _torch.current_stream(self._device)
        _torch.wait_stream(current, self._stream)
        _torch.release_stream(self._stream)
        self._ended = True
        self.report = self._report_of([s for s in self._slots if not s.offloaded])
        return self.report

    def _end_after_failure(self) -> None:
        """Wait for what was queued, free the rest again, end the feed (nothing escapes)."""
        self._stop.set()
        rest = self._slots[self._fed :]
        try:
            _torch.synchronize_stream(self._stream)
        finally:
            self._unallocate(rest)  # back to freed: what reload() starts from
            self._close()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> OffloadReport:
        """Stop feeding and keep what was fed; the rest is freed again and stays offloaded.

        Later device work on the current stream sees the fed storages; the host does
        not wait for them. A later ``Offloader.reload()`` brings back the rest.

        Args:
            timeout_s: how long to wait for the thread (it waits for one chunk).

        Returns:
            The report of the storages fed.

        Raises:
            RuntimeError: the feed has already ended.
            OffloadError: the thread did not stop in time (the device may be hung).
        """
        self._halt(timeout_s)
        self._unallocate(self._slots[self._fed :])
        return self._close()

    def finish(
        self, by: Literal["kernel", "copy_engine"] = "kernel", *, timeout_s: float = STOP_TIMEOUT_S
    ) -> OffloadReport:
        """Stop feeding, reload the rest ``by`` kernel or copy engine, wait for every copy.

        The rest goes on the Offloader's side stream, beside the feed's last chunks.

        Args:
            by: how the rest is copied: ``"kernel"`` keeps its rate right after another
                process's large free, where the copy engines halve theirs.
            timeout_s: how long to wait for the thread (it waits for one chunk).

        Returns:
            The report of every storage the feed reloaded.

        Raises:
            RuntimeError: the feed has already ended.
            OffloadError: the rest could not be copied (what was fed is reloaded, the
                rest intact in the host pool and still offloaded), or the thread did
                not stop in time.
        """
        self._halt(timeout_s)
        rest = self._slots[self._fed :]
        try:
            if rest:
                self._rest(rest, by)
        except BaseException as exc:
            self._end_after_failure()
            listed = ", ".join(groups_of(rest))
            raise OffloadError(
                f"reload of the rest of a feed ({len(rest)} storages of {listed}) "
                f"failed ({type(exc).__name__}): {self._fed} storages were reloaded; the rest "
                "are intact in the host pool and still offloaded; call reload() again",
                offloaded=frozenset(s.group for s in rest),
            ) from exc
        for slot in rest:
            slot.offloaded = False
        _torch.synchronize_stream(self._stream)  # every copy has landed, as reload() promises
        return self._close()
