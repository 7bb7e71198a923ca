"""WeightBucket: a persistent, IPC-safe staging buffer for weight sync between processes.

Frameworks that re-allocate and re-export a staging buffer every step leak one
bucket per step (+2.04 GiB per sync with 2 GiB buckets, OOM around sync 32; verl
#6958), and receivers that keep views into a reused buffer read garbage (verl
#6688). A :class:`WeightBucket` allocates its buffers once, in classic segments
(``"cuda"``) or in expandable segments shared by fd passing (``"fd"``): either way
no pidfd is needed by the consumer; it exports them once
(:attr:`WeightBucket.handle`) and reuses them for every sync; the
:class:`BucketReceiver` opens them once, by GPU UUID, and hands out copies unless
views are asked for.

The wire format is in :mod:`hybridmem.ipc._wire`; the receiving side is
:mod:`hybridmem.ipc.receiver`.

Why this module is long: the producer's side of one protocol (send, wait for the
receiver, reuse the buffers). Around it: the wire format and the batch plan in
``_wire`` and ``_plan``, the tensors' checks in ``tensor_checks``, the packing and
fills in ``bucket_fill``, its arguments' values in ``bucket_options``, its report in
``sync_report``, and
the transports (their choice, allocation, export, open and teardown) in
``transports``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._checks import MAX_DEVICE_BYTES, check_number
from hybridmem._closing import ClosesOnExit
from hybridmem._devices import DeviceArg, device_index
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem._names import suggests_keywords
from hybridmem._platform.stdlib import unlink_shared_memory
from hybridmem.ipc._plan import align_up
from hybridmem.ipc._wire import (
    CPU,
    DEFAULT_TIMEOUT_S,
    BucketHandle,
    Channel,
    Peer,
    PeerAborted,
    check_timeout,
    recv_within,
    send_to,
)
from hybridmem.ipc.bucket_fill import Filler, Plan
from hybridmem.ipc.bucket_options import MAX_BUFFERS, TransportChoice, auto_size, check_transport
from hybridmem.ipc.sync_report import SyncReport
from hybridmem.ipc.tensor_checks import Checked, NamedTensors, validate
from hybridmem.ipc.transports.base import (
    Buffers,
    Fallback,
    TransportName,
    check_fallback,
    drop_host_buffers,
)
from hybridmem.ipc.transports.choice import choose_transport
from hybridmem.observe import timeline as _timeline
from hybridmem.scopes.release import release_cache

__all__ = [
    "BucketHandle",
    "SyncReport",
    "TransportChoice",
    "WeightBucket",
]  # BucketHandle: what .handle is


@suggests_keywords
class WeightBucket(ClosesOnExit):
    """A persistent staging buffer that ships named tensors to another process.

    Allocated once (``buffers`` buffers of ``nbytes``), exported once
    (:attr:`handle`), reused by every :meth:`send`. The consumer needs no
    ``pidfd_getfd`` on any transport: ``"cuda"`` buffers are in classic segments,
    ``"fd"`` buffers are in expandable segments and reach the consumer by fd
    passing (:func:`hybridmem.ipc_export`), ``"host"`` buffers are shared memory.
    Tensors larger than the bucket are split across batches;
    each batch is copied in (one multi-tensor copy), synchronised, and handed off
    with its metadata. Device memory stays flat across syncs.

    Args:
        nbytes: bytes per buffer (rounded up to a multiple of 256). Bigger means
            fewer hand-offs per sync, smaller less memory: :meth:`for_tensors`
            sizes it by the model, as measured on the H200.
        device: the device of the tensors to send (None: the current device).
        fallback: ``"auto"`` probes :func:`ipc_capabilities` once and uses host
            shared memory if CUDA IPC is broken here; ``"host"`` always uses host
            shared memory; ``"raise"`` uses CUDA IPC and raises
            :class:`IpcUnavailableError` where it cannot.
        buffers: number of buffers, 1 to 8 (2: fill one while the receiver drains
            the other).
        transport: ``"auto"`` (default) and ``"cuda"``: CUDA IPC of classic
            segments, host memory where ``fallback`` allows it; ``"fd"``: buffers
            in expandable segments, their pages' fds passed over a Unix socket
            (where ``fd`` export is impossible, ``fallback="auto"`` warns and
            takes ``"cuda"``, ``"raise"`` raises); ``"host"``: host shared memory.

    Raises:
        TypeError, ValueError: bad arguments (the message names them), or
            ``transport="fd"`` with ``fallback="host"`` (they contradict).
        IpcUnavailableError: CUDA IPC impossible and ``fallback="raise"``.

    Scope: one producer thread at a time (the methods are not re-entrant); the
    bucket's memory is on ``device``. Close it (or use ``with``) to free it; close
    receivers first so their mappings do not keep it alive.

    Example:
        >>> bucket = hm.WeightBucket(256 << 20)        # doctest: +SKIP
        >>> # once, before training
        >>> conn.send(bucket.handle)  # doctest: +SKIP
        >>> for step in range(steps):                  # doctest: +SKIP
        ...     train_step()
        ...     bucket.send(model.state_dict(), conn)  # every step, no new memory
    """

    def __init__(
        self,
        nbytes: int,
        device: DeviceArg = None,
        *,
        fallback: Fallback = "auto",
        buffers: int = 2,
        transport: TransportChoice = "auto",
    ) -> None:
        size = align_up(
            int(
                check_number(
                    "nbytes",
                    nbytes,
                    integer=True,
                    minimum=1,
                    maximum=MAX_DEVICE_BYTES,
                    expected="a whole number of bytes from 1 to 1 TiB per buffer",
                )
            )
        )
        self._buffers_count = int(
            check_number("buffers", buffers, integer=True, minimum=1, maximum=MAX_BUFFERS)
        )
        self.fallback = check_fallback(fallback)
        choice = check_transport(transport, self.fallback)
        self._index = device_index(device)
        self.nbytes = size
        # The transport is chosen once, here, and asked from then on.
        self._transport = choose_transport(
            choice,
            self.fallback,
            self._index,
            who="WeightBucket",
            probe="run" if self.fallback == "auto" else "off",
            host_without_cuda=True,  # CPU processes share host memory by design
        )
        self._held = Buffers()
        self._views = self._held.views
        self._stream: Any = None
        self._acked = 0
        self._seq = 0
        self._sync = 0
        self._batches = 0  # batches of the current sync: the next one's buffer
        self._closed = False
        self._filler = Filler(self._views, size, self.device)  # the plan and the fills
        self._filled = self._held.events  # interprocess events, recorded after each fill
        self._drained: list[Any] | None = None  # the receiver's, once it sent them
        self._drained_handles: Any = None  # what they were opened from
        self._peer = Peer(None, "receiver")  # learnt from its hello
        # A bucket dropped without close() (or whose set-up failed midway) still
        # unlinks its host segments: torch's resource tracker would otherwise report
        # them leaked at exit, and they would outlive the process in /dev/shm.
        # The host part of Buffers.release only: at exit, device tensors are left alone.
        self._release_host = weakref.finalize(
            self, drop_host_buffers, self._held.pinned, self._held.shms, unlink=True
        )
        self._transport.allocate(size, self._buffers_count, self._index, self._held)
        self._handle = BucketHandle(
            transport=self._transport.name,
            nbytes=size,
            buffers=self._buffers_count,
            device_uuid=_torch.device_uuid(self._index) if _torch.cuda_available() else None,
            exports=tuple(self._held.exports),
            producer_pid=os.getpid(),
            events=tuple(_torch.ipc_event_handle(e) for e in self._filled),
        )
        logger.info(
            "WeightBucket: %d x %s over %s on device %d",
            self._buffers_count,
            fmt_bytes(size),
            self.transport,
            self._index,
        )

    # ------------------------------------------------------------------ #
    # Set-up
    # ------------------------------------------------------------------ #
    @property
    def handle(self) -> BucketHandle:
        """What a :class:`BucketReceiver` opens; picklable, send it once.

        The transport says what it carries: for ``"fd"`` each read makes fresh
        one-time exports of the buffers (one receiver per read) and withdraws the
        unopened ones of the read before.
        """
        if self._closed:
            return self._handle
        return dataclasses.replace(self._handle, exports=self._transport.exports(self._held))

    @property
    def transport(self) -> TransportName:
        """The transport's name: ``"cuda"``, ``"fd"`` or ``"host"`` (chosen at construction)."""
        return self._transport.name

    def unlink_shared_names(self) -> int:
        """Remove the host buffers' names from ``/dev/shm`` once every receiver opened them.

        The memory stays mapped in this process and in every receiver that opened
        it, and is freed when the last of them lets go, even if the producer dies
        by ``SIGKILL`` (whose finalizers never run, leaving named segments behind
        until reboot). A receiver that has not opened the bucket yet cannot open it
        afterwards. CUDA transports have no names: nothing to do.

        Returns:
            How many names were removed (0 for ``"cuda"`` and ``"fd"`` buckets).

        Scope: this bucket; call it from the producer's thread.

        Example:
            >>> conn.send(bucket.handle)           # doctest: +SKIP
            >>> # wait until the receiver attached
            >>> assert conn.recv() == "opened"  # doctest: +SKIP
            >>> bucket.unlink_shared_names()       # doctest: +SKIP
        """
        removed = sum(unlink_shared_memory(shm) for shm in self._held.shms)
        if removed:
            logger.debug("WeightBucket: %d host buffer names unlinked", removed)
        return removed

    @classmethod
    def for_tensors(
        cls,
        named_tensors: NamedTensors,
        device: DeviceArg = None,
        *,
        fallback: Fallback = "auto",
        transport: TransportChoice = "auto",
        buffers: int | None = None,
    ) -> WeightBucket:
        """A bucket sized for these tensors (a model's ``state_dict()``): the default to use.

        Buffers of half the model, between 256 MiB and 1 GiB (rounded up to
        64 MiB); 3 of them once the model fills eight, else 2. Each batch costs a
        GPU hand-off between the processes (~0.5 ms on the H200), so big buckets
        win: at 8 GiB (190 tensors of an 8B model) 1 GiB x 2 took 10.3 ms per sync,
        79% of the two-copy ceiling, against 14.1 ms with 256 MiB x 2; at 1 GiB,
        512 MiB x 2 took 1.4 ms (76%) against 1.7 ms (benchmarks/weight_sync.py
        on the H200). The price is device memory: up to 3 GiB while the bucket lives.

        Args:
            named_tensors: what will be sent, a mapping or a list of pairs (only
                their sizes are read; an iterator would be used up).
            device, fallback, transport: as for :class:`WeightBucket`.
            buffers: overrides the buffer count (None: as above).

        Returns:
            The bucket (its :attr:`nbytes` and :attr:`buffers` say what was chosen).

        Raises:
            TypeError: ``named_tensors`` is not a mapping or a list of
                ``(name, tensor)`` pairs.
            ValueError: it holds no tensors (nothing to size the bucket by).

        Example:
            >>> bucket = hm.WeightBucket.for_tensors(model.state_dict())  # doctest: +SKIP
            >>> conn.send(bucket.handle)                                  # doctest: +SKIP
        """
        how = "pass model.state_dict() or a list of its items()"
        if isinstance(named_tensors, Mapping):
            items = list(named_tensors.items())
        elif isinstance(named_tensors, (list, tuple)):
            items = list(named_tensors)
        else:
            raise TypeError(
                "WeightBucket.for_tensors takes a mapping of names to tensors or a list of "
                f"(name, tensor) pairs, got {type(named_tensors).__name__}: {how}"
            )
        total = 0
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(
                    f"WeightBucket.for_tensors takes (name, tensor) pairs, got {item!r}: {how}"
                )
            name, tensor = item
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"WeightBucket.for_tensors takes (name, tensor) pairs; {name!r} is a "
                    f"{type(tensor).__name__}: {how}"
                )
            total += tensor.nbytes
        if not items:
            raise ValueError(
                "WeightBucket.for_tensors got no tensors, so there is nothing to size the "
                f"bucket by: {how}, or give WeightBucket(nbytes) its size"
            )
        size, count = auto_size(total)
        return cls(
            size,
            device,
            fallback=fallback,
            buffers=count if buffers is None else buffers,
            transport=transport,
        )

    @property
    def buffers(self) -> int:
        """How many buffers of :attr:`nbytes` the bucket holds."""
        return self._buffers_count

    @property
    def device(self) -> torch.device:
        """Where the tensors to send live (and, for ``"cuda"``, the buffers)."""
        return torch.device("cuda", self._index) if _torch.cuda_available() else CPU

    # ------------------------------------------------------------------ #
    # Sending
    # ------------------------------------------------------------------ #
    def check(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        """Check named tensors as :meth:`send` would, without sending anything.

        For a caller that must commit another party before sending (a control-plane
        call that waits for the data, as vLLM's ``update_weights`` does): a bad name
        or tensor is then refused before that call is made.

        Returns:
            The ``(name, tensor)`` pairs, in order; :meth:`send` takes them without
            checking every tensor again (per-tensor checks add up over the tens of
            thousands of tensors of a large MoE model).

        Raises:
            TypeError, ValueError: as :meth:`send` (the message names the tensor).

        Example:
            >>> items = bucket.check(model.state_dict())   # doctest: +SKIP
            >>> bucket.send(items, conn)                   # doctest: +SKIP
        """
        return Checked(validate(named_tensors, self.device))

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = _torch.new_stream(self.device)
        return self._stream

    def _wait_ack(self, channel: Channel, seq: int, timeout: float | None) -> None:
        while self._acked < seq:
            message = recv_within(channel, timeout, self._peer, f"an ack of batch {seq}")
            if not (isinstance(message, tuple) and len(message) >= 3):
                raise RuntimeError(f"unexpected message from the receiver: {message!r}")
            kind, sync = message[0], message[1]
            if kind == "hello":
                self._hello(message)
                continue
            if sync != self._sync:
                continue  # left over from an earlier, aborted sync
            if kind == "ack":
                self._acked = max(self._acked, int(message[2]))
            elif kind == "abort":
                raise PeerAborted(f"the receiver stopped the weight sync: {message[2]}")
            else:
                raise RuntimeError(f"unexpected message from the receiver: {message!r}")

    def _hello(self, message: tuple[Any, ...]) -> None:
        """The receiver's pid (its death is noticed while waiting) and its drained events.

        A receiver that reads the buffers on the device sends the interprocess events
        it records after each read with every sync; they are opened once.
        """
        self._peer.track(int(message[2]))
        handles = message[3] if len(message) >= 4 else None
        if handles is not None and handles != self._drained_handles:
            self._drained = [_torch.open_ipc_event(self._index, h) for h in handles]
            self._drained_handles = handles

    def _wait_hello(self, channel: Channel, sync: int, timeout: float | None) -> None:
        """Before a first fill: the receiver's hello for ``sync``, with its events if any.

        Needed while this bucket knows no drained events but its buffers are on the
        device: a receiver of an earlier sync may still have reads of them queued.
        """
        while True:
            message = recv_within(channel, timeout, self._peer, f"the hello of sync {sync}")
            if not (isinstance(message, tuple) and len(message) >= 3):
                raise RuntimeError(f"unexpected message from the receiver: {message!r}")
            if message[1] != sync:
                continue  # left over from an earlier, aborted sync
            if message[0] == "hello":
                self._hello(message)
                return
            if message[0] == "abort":
                raise PeerAborted(f"the receiver stopped the weight sync: {message[2]}")
            raise RuntimeError(f"unexpected message from the receiver: {message!r}")

    def _forget_receiver(self, caller: Any, stream: Any) -> None:
        """After a failed sync: wait for this side's copies, and expect a fresh receiver.

        The bucket stays usable: the next sync starts from a clean slate (a new
        receiver sends its own hello and events; this one's are never waited on).
        """
        with contextlib.suppress(Exception):
            _torch.synchronize_stream(stream)  # our fills of the buffers are done
            _torch.wait_stream(caller, stream)
        self._drained = self._drained_handles = None
        self._acked = self._seq
        self._peer.close()
        self._peer = Peer(None, "receiver")  # the next receiver says hello anew

    def _put(
        self,
        channel: Channel,
        sync: int,
        occupied: list[int],
        plan: Plan,
        number: int,
        items: list[tuple[str, torch.Tensor]],
        flats: dict[int, torch.Tensor],
        timeout: float | None,
        extra: tuple[Any, ...] = (),
    ) -> None:
        """Fill the next buffer with batch ``number`` once the receiver is done with it, send it."""
        stream = self._side_stream()
        buffer = self._batches % self._buffers_count
        self._batches += 1
        self._wait_ack(channel, occupied[buffer], timeout)
        if self._drained is not None:  # the receiver's copies out of it come first
            _torch.wait_event(stream, self._drained[buffer])
        with _torch.stream_scope(stream):
            self._filler.fill(buffer, number, plan, items, flats)
        # The data is complete before the hand-off: on the device through the
        # buffer's event (CUDA), or by waiting here (host memory).
        if self._filled:
            _torch.record_event(self._filled[buffer], stream)
        else:
            _torch.synchronize_stream(stream)
        self._seq += 1
        message = ("batch", sync, self._seq, buffer, plan.entries[number], *extra)
        send_to(channel, message, self._peer, f"batch {self._seq}")
        occupied[buffer] = self._seq

    def _run(
        self,
        channel: Channel,
        caller: Any,
        timeout: float | None,
        body: Callable[[int, list[int]], tuple[int, int]],
    ) -> SyncReport:
        """One sync: its begin, ``body(sync, occupied)`` (tensors, bytes sent), its end."""
        if self._closed:
            raise RuntimeError("this WeightBucket is closed")
        started = time.perf_counter()
        stream = self._side_stream()
        _torch.wait_stream(stream, caller)  # the tensors are written on the caller's stream
        occupied: list[int] = [0] * self._buffers_count
        self._batches = 0
        self._sync += 1
        sync = self._sync
        try:
            send_to(channel, ("begin", sync), self._peer, f"the begin of sync {sync}")
            if self._filled and self._drained is None:
                self._wait_hello(channel, sync, timeout)
            count, total = body(sync, occupied)
            self._seq += 1
            send_to(
                channel,
                ("end", sync, self._seq, count, total),
                self._peer,
                f"the end of sync {sync}",
            )
            self._wait_ack(channel, self._seq, timeout)
            _torch.wait_stream(caller, stream)  # later writes to the sources come after
        except PeerAborted:
            self._forget_receiver(caller, stream)
            raise
        except BaseException as exc:
            with contextlib.suppress(Exception):
                channel.send(("abort", sync, f"{type(exc).__name__}: {exc}"))
            self._forget_receiver(caller, stream)
            raise
        report = SyncReport(
            tensors=count,
            nbytes=total,
            batches=self._batches,
            seconds=time.perf_counter() - started,
            transport=self._transport.name,
        )
        logger.debug("WeightBucket: %s", report)
        return report

    def _send(
        self,
        items: list[tuple[str, torch.Tensor]],
        channel: Channel,
        caller: Any,
        timeout: float | None,
    ) -> SyncReport:
        def body(sync: int, occupied: list[int]) -> tuple[int, int]:
            plan = self._filler.make_plan(items)
            flats: dict[int, torch.Tensor] = {}
            for number in range(len(plan.batches)):
                self._put(channel, sync, occupied, plan, number, items, flats, timeout)
            return len(items), sum(t.nbytes for _, t in items)

        return self._run(channel, caller, timeout, body)

    def _send_groups(
        self,
        groups: Iterable[tuple[NamedTensors, Any]],
        channel: Channel,
        caller: Any,
        timeout: float | None,
    ) -> SyncReport:
        stream = self._side_stream()

        def body(sync: int, occupied: list[int]) -> tuple[int, int]:
            count = total = 0
            for group in groups:
                if not (isinstance(group, tuple) and len(group) == 2):
                    raise TypeError(f"groups must yield (named_tensors, tag) pairs, got {group!r}")
                named, tag = group
                items = named if isinstance(named, Checked) else validate(named, self.device)
                # This group's tensors may have been written since the sync began.
                _torch.wait_stream(stream, caller)
                plan = self._filler.make_plan(items, together=True)
                last = len(plan.batches) - 1
                if last < 0:  # an empty group: nothing to fill, its tag all the same
                    self._seq += 1
                    message = ("group", sync, self._seq, tag)
                    send_to(channel, message, self._peer, f"group {self._seq}")
                flats: dict[int, torch.Tensor] = {}
                for number in range(last + 1):
                    mark = ("group", tag) if number == last else None  # the group goes on
                    self._put(channel, sync, occupied, plan, number, items, flats, timeout, (mark,))
                # The caller's later work (which may reuse these tensors' memory once it
                # lets go of them) comes after the copies out of them.
                _torch.wait_stream(caller, stream)
                count += len(items)
                total += sum(t.nbytes for _, t in items)
            return count, total

        return self._run(channel, caller, timeout, body)

    @_timeline.traced("weight_sync.send", lambda r: {"nbytes": r.nbytes, "gbps": r.gbps})
    def send(
        self,
        named_tensors: NamedTensors,
        channel: Channel,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SyncReport:
        """Ship ``named_tensors`` to the receiver on the other end of ``channel``.

        Returns when the receiver has taken every tensor (it acknowledged the end;
        with CUDA buffers its copies may still be running on its GPU, ordered by the
        buffers' events). The sources may then be changed or freed: the current
        stream waits for the copies out of them on the device, and work queued on it
        before the call is waited for before they start.

        Args:
            named_tensors: a mapping of names to tensors (``state_dict()``) or
                ``(name, tensor)`` pairs (``named_parameters()``): contiguous,
                dense, on the bucket's device, unique names.
            channel: the producer's end of a two-way channel (see :class:`Channel`).
            timeout: the longest wait for any one answer of the receiver, in seconds
                (None: no bound). With a ``Pipe`` end (a channel with ``poll()``) the
                receiver's process is also watched: its death ends the wait within
                0.1 s, even when this process still holds the receiver's end of the
                pipe (which then never reports EOF).

        Returns:
            A :class:`SyncReport`.

        Raises:
            TypeError, ValueError: a bad name, tensor or timeout (the message names
                it); nothing was sent.
            SyncError: the receiver died, closed the channel or did not answer in
                time; the bucket stays usable for the next sync.
            RuntimeError: the receiver aborted or answered out of protocol.
        """
        wait = check_timeout(timeout)
        items = validate(named_tensors, self.device)
        return self._send(items, channel, _torch.current_stream(self.device), wait)

    async def asend(
        self,
        named_tensors: NamedTensors,
        channel: Channel,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SyncReport:
        """Async :meth:`send`: the blocking waits run in a worker thread, not the loop."""
        wait = check_timeout(timeout)
        items = validate(named_tensors, self.device)
        caller = _torch.current_stream(self.device)
        return await asyncio.to_thread(self._send, items, channel, caller, wait)

    @_timeline.traced("weight_sync.send", lambda r: {"nbytes": r.nbytes, "gbps": r.gbps})
    def send_groups(
        self,
        groups: Iterable[tuple[NamedTensors, Any]],
        channel: Channel,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SyncReport:
        """Ship groups of tensors as they come, each to arrive together with its tag.

        One sync, streamed: ``groups`` is read one group at a time while the receiver
        drains earlier ones, so a producer that makes its tensors as it goes (a
        gather per layer) never holds more than one group. Each group is packed into
        one batch whenever it fits a buffer (at 256-byte offsets, else at offsets
        rounded to each tensor's element size), so that
        :meth:`BucketReceiver.receive_groups` can hand it out as views of the bucket,
        with no copy; a larger group is split across batches and arrives as copies.

        Args:
            groups: an iterable of ``(named_tensors, tag)``: tensors as :meth:`send`
                takes them (a mapping or pairs; :meth:`check`'s result is not checked
                again), and a small picklable ``tag`` handed to the receiver with them
                (a flag, a name). An empty group arrives empty, with its tag.
            channel: the producer's end of a two-way channel.
            timeout: the longest wait for any one answer of the receiver (None: no bound).

        Returns:
            A :class:`SyncReport` for the whole sync.

        Raises:
            TypeError, ValueError: a bad group, name or tensor; the receiver is told
                and stops, what it was handed before stays handed.
            SyncError, RuntimeError: as :meth:`send`; the bucket stays usable.
            Exception: what ``groups`` raised (the receiver is told).

        Example:
            >>> def layers():                                         # doctest: +SKIP
            ...     for i, layer in enumerate(model.layers):
            ...         yield dict(layer.named_parameters()), i
            >>> bucket.send_groups(layers(), conn)                    # doctest: +SKIP

        Scope: as :meth:`send`; each group's copies come after the work queued on the
        current stream before it was read, and work queued after it comes after them.
        """
        wait = check_timeout(timeout)
        return self._send_groups(groups, channel, _torch.current_stream(self.device), wait)

    # ------------------------------------------------------------------ #
    # Closing
    # ------------------------------------------------------------------ #
    def close(self) -> None:
        """Free the buffers: ``ipc_collect`` plus a cache release for CUDA, unlink for host.

        Idempotent. Receivers should close first: torch keeps CUDA memory a
        consumer still maps alive until that consumer lets go.
        """
        if self._closed:
            return
        self._closed = True
        self._transport.withdraw()
        self._filler.clear()
        self._peer.close()
        _torch.release_stream(self._stream)  # kept for the next owner, never destroyed
        self._stream = None
        # The receiver's teardown too; the finalizer (host buffers only) is not needed now.
        self._release_host.detach()
        self._held.release(unlink=True)
        if self._transport.on_device and _torch.cuda_initialized():
            release_cache(self._index, collect_garbage=False)

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.transport
        return (
            f"WeightBucket({fmt_bytes(self.nbytes)} x {self._buffers_count}, "
            f"device={self.device}, {state})"
        )
