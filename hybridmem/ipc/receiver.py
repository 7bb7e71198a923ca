"""BucketReceiver: the consumer's side of a WeightBucket (opens it once, by GPU UUID).

Why this module is long: the consumer's side of one protocol, received two ways (a
sync of tensors, :meth:`BucketReceiver.receive`; a sync of groups handed out whole,
:meth:`BucketReceiver.receive_groups`) over the same reading, ordering, hand-back and
stopping steps. Around it: the wire format in ``_wire``, the transports (opening the
buffers) in ``transports``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Generator, Mapping
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._closing import ClosesOnExit
from hybridmem._devices import DeviceArg, device_index
from hybridmem._errors import SyncError
from hybridmem._names import suggests_keywords
from hybridmem.ipc._wire import (
    CPU,
    DEFAULT_TIMEOUT_S,
    PROTOCOL,
    BucketHandle,
    Channel,
    Entry,
    Peer,
    PeerAborted,
    byte_offset,
    check_timeout,
    dtype_named,
    flat_words,
    recv_within,
    send_to,
    word_unit,
)
from hybridmem.ipc.transports.base import Buffers
from hybridmem.ipc.transports.choice import transport_named

__all__ = ["BucketReceiver"]

_END = object()
#: How many batch layouts a receiver keeps typed views of (see ``_typed_sources``).
_TYPED_LAYOUTS = 256


def _in_order(seq: int, last: int | None) -> int:
    """``seq``, if it follows ``last``: else batches were lost (:class:`SyncError`)."""
    if last is not None and seq != last + 1:
        raise SyncError(
            f"message {seq} came after message {last}: {seq - last - 1} message(s) of this "
            "sync were lost"
        )
    return seq


@suggests_keywords
class BucketReceiver(ClosesOnExit):
    """The consumer's side of a :class:`WeightBucket`: opens it once, receives every sync.

    Args:
        handle: the producer's :attr:`WeightBucket.handle`.
        device: where received tensors go (None: the producer's GPU, found by UUID
            so that different ``CUDA_VISIBLE_DEVICES`` do not matter; for host
            buckets, the current device).

    Raises:
        TypeError: ``handle`` is not a :class:`BucketHandle`.
        ValueError: the producer's GPU is not visible here, or the protocol differs.
        IpcUnavailableError: the CUDA buffers cannot be opened here.

    Scope: one consumer thread at a time. Example::

        receiver = hm.BucketReceiver(conn.recv())
        for name, tensor in receiver.receive(conn):
            model.load_weight(name, tensor)
    """

    def __init__(self, handle: BucketHandle, device: DeviceArg = None) -> None:
        if not isinstance(handle, BucketHandle):
            raise TypeError(
                f"BucketReceiver takes a WeightBucket.handle, got {type(handle).__name__}"
            )
        if handle.protocol != PROTOCOL:
            raise ValueError(
                f"bucket protocol {handle.protocol} differs from this hybridmem's {PROTOCOL}: "
                "run the same hybridmem version on both sides"
            )
        self.handle = handle
        transport = transport_named(handle.transport)  # the producer's, asked from here on
        self._peer = Peer(handle.producer_pid, "producer")
        self._held = Buffers()
        self._buffers = self._held.views
        self._word_views: dict[int, dict[torch.dtype, torch.Tensor]] = {}
        self._typed: dict[tuple[int, tuple[Entry, ...]], tuple[torch.Tensor | None, ...]] = {}
        self._stream: Any = None
        self._closed = False
        self._filled: list[Any] = []  # the producer's events, one per buffer
        self._drained: list[Any] = []  # ours, recorded once a buffer is read
        self._event_handles: list[Any] | None = None  # the drained events', made once
        if transport.on_device:
            source = self._source_device(handle)
            self.device = torch.device(
                "cuda", device_index(device) if device is not None else source
            )
        else:
            source = -1  # host memory: no source device
            self.device = (
                torch.device("cuda", device_index(device)) if _torch.cuda_available() else CPU
            )
        transport.open(handle.exports, handle.nbytes, handle.producer_pid, source, self._held)
        if transport.on_device:
            self._filled = [_torch.open_ipc_event(source, h) for h in handle.events]
            if self._filled and self.device.index == source:
                # Hand-offs on the device both ways: no host round trip per batch.
                self._drained = [_torch.new_ipc_event(source) for _ in handle.exports]

    @staticmethod
    def _source_device(handle: BucketHandle) -> int:
        uuid = handle.device_uuid
        index = _torch.device_index_by_uuid(uuid) if uuid is not None else None
        if index is None:
            visible = [_torch.device_uuid(i) for i in range(_torch.device_count())]
            raise ValueError(
                f"the producer's GPU {uuid} is not visible in this process (visible: "
                f"{visible or 'none'}); give both processes a CUDA_VISIBLE_DEVICES that "
                "includes it, or use WeightBucket(fallback='host')"
            )
        return index

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = _torch.new_stream(self.device)
        return self._stream

    def _words(self, buffer: int, dtype: torch.dtype) -> torch.Tensor:
        views = self._word_views.setdefault(buffer, {})
        if dtype not in views:
            views[dtype] = self._buffers[buffer].view(dtype)
        return views[dtype]

    def _typed_sources(
        self, buffer: int, entries: tuple[Entry, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """Each whole entry's bytes in ``buffer`` as its dtype and shape; made once per layout.

        A producer sends the same entries every sync while its model keeps its shapes,
        so the views are kept by ``(buffer, entries)`` (a few hundred layouts at most:
        the cache is emptied beyond that). They hold this receiver's buffers only.
        """
        key = (buffer, entries)
        cached = self._typed.get(key)
        if cached is None:
            if len(self._typed) >= _TYPED_LAYOUTS:
                self._typed.clear()
            raw = self._buffers[buffer]
            cached = self._typed[key] = tuple(
                raw[offset : offset + nbytes].view(dtype_named(dtype)).view(shape)
                if start == 0 and nbytes == total and nbytes
                else None
                for _, dtype, shape, start, nbytes, offset, total in entries
            )
        return cached

    def _target(
        self, entry: Entry, out: Mapping[str, torch.Tensor] | None, dtype: torch.dtype
    ) -> torch.Tensor:
        name, _, shape, *_ = entry
        if out is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if name not in out:
            raise ValueError(f"received {name!r}, which `out` has no entry for")
        dest = out[name]
        if dest.dtype != dtype or tuple(dest.shape) != tuple(shape):
            raise ValueError(
                f"{name!r}: received {dtype} {list(shape)} but out[{name!r}] is "
                f"{dest.dtype} {list(dest.shape)}; the dtype and shape must match"
            )
        if not dest.is_contiguous():
            raise ValueError(f"out[{name!r}] is not contiguous; it cannot be filled in place")
        return dest

    def _take(
        self,
        message: Any,
        out: Mapping[str, torch.Tensor] | None,
        views: bool,
        partial: dict[str, tuple[torch.Tensor, int]],
        caller: Any,
    ) -> list[tuple[str, torch.Tensor]]:
        """Copy (or view) one batch; return the tensors it completed."""
        _, _, _, buffer, entries = message
        source = self._buffers[buffer]
        ready: list[tuple[str, torch.Tensor]] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        stream = self._side_stream()
        _torch.wait_stream(stream, caller)  # `out` tensors may be in use on the caller's stream
        if self._drained:
            _torch.wait_event(stream, self._filled[buffer])  # the producer's fill, on the device
        elif self._filled:
            _torch.synchronize_event(self._filled[buffer])
        block = None
        if out is None and not views:
            # Copies: the batch in one copy into a fresh block; whole tensors are
            # views of it (one launch, not one per tensor).
            used = max((e[5] + e[4] for e in entries), default=0)
            block = torch.empty(used, dtype=torch.uint8, device=self.device)
            with _torch.stream_scope(stream):
                block.copy_(source[:used], non_blocking=True)
        typed = self._typed_sources(buffer, entries) if out is not None else None
        for index, entry in enumerate(entries):
            name, dtype_name, shape, start, nbytes, offset, total = entry
            whole = start == 0 and nbytes == total
            if typed is not None and whole:
                # Into `out` as it is, from a view of the buffer made once: no view of
                # the user's tensor per sync.
                source_view = typed[index]
                target = self._target(entry, out, dtype_named(dtype_name))
                if source_view is not None:
                    srcs.append(source_view)
                    dsts.append(target)
                ready.append((name, target))
                continue
            dtype = dtype_named(dtype_name)
            if whole and block is not None:
                ready.append((name, block[offset : offset + nbytes].view(dtype).view(shape)))
                continue
            if views and out is None and whole:
                chunk = source[offset : offset + nbytes]
                ready.append(
                    (
                        name,
                        chunk.view(dtype).view(shape)
                        if nbytes
                        else torch.empty(shape, dtype=dtype, device=source.device),
                    )
                )
                continue
            dest, remaining = partial.pop(name, (None, total))
            if dest is None:
                dest = self._target(entry, out, dtype)
            if nbytes:
                size, unit = word_unit(total, byte_offset(dest))
                words = self._words(buffer, unit)
                flat = flat_words(dest, unit)
                srcs.append(words[offset // size : (offset + nbytes) // size])
                dsts.append(
                    flat if nbytes == total else flat[start // size : (start + nbytes) // size]
                )
            remaining -= nbytes
            if remaining > 0:
                partial[name] = (dest, remaining)
            else:
                ready.append((name, dest))
        with _torch.stream_scope(stream):
            _torch.copy_many(dsts, srcs)
        if self._drained:
            if not (views and out is None):  # views: recorded once the user moved on
                _torch.record_event(self._drained[buffer], stream)
            _torch.wait_stream(caller, stream)  # the results, on the user's stream
        else:
            _torch.synchronize_stream(stream)  # done reading the buffer before the ack
        return ready

    def receive(
        self,
        channel: Channel,
        *,
        out: Mapping[str, torch.Tensor] | None = None,
        views: bool = False,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yield ``(name, tensor)`` for every tensor of one sync, as batches arrive.

        Args:
            channel: the consumer's end of the channel.
            out: tensors to fill in place, by name (a model's parameters); each
                must match the received dtype and shape. Yields them back.
            views: yield views into the bucket instead of copies (no copy, no new
                memory). A view is valid only until the iterator moves past its
                batch: copy what you keep. Tensors split across batches (larger
                than the bucket) are always assembled into copies.
            timeout: the longest wait for any one message of the producer, in
                seconds (None: no bound); with a ``Pipe`` end the producer's process
                is watched too, so its death ends the wait within 0.1 s.

        Yields:
            ``(name, tensor)`` in the producer's order (a split tensor when its last
            piece arrived); copies on :attr:`device` unless ``views``. The copies of
            one batch share one allocation (one copy per batch); ``clone()`` a tensor
            to keep it apart from the rest. They are ready on the current stream.

        Raises:
            ValueError: a dtype/shape mismatch with ``out`` (the producer is told).
            SyncError: the producer died, closed the channel or went silent for
                ``timeout``; or the sync ended with fewer tensors or bytes than the
                producer sent (a batch was lost): nothing of it may be trusted.
            RuntimeError: the producer aborted, or a message broke the protocol.
        """
        wait, caller, sync = self._open(channel, timeout)
        partial: dict[str, tuple[torch.Tensor, int]] = {}
        finished = aborted_by_peer = False
        count = nbytes = 0
        last_seq: int | None = None
        try:
            while True:
                message = self._next(channel, wait, sync, "the next batch")
                kind = message[0]
                if kind == "end":
                    self._check_end(message, partial, count, nbytes, last_seq)
                    finished = True
                    self._ack(channel, sync, message[2], "the end")
                    return
                if kind == "group" or (kind == "batch" and len(message) == 6):
                    raise RuntimeError(
                        "the producer sends groups (WeightBucket.send_groups): receive them "
                        "with BucketReceiver.receive_groups"
                    )
                if kind != "batch" or len(message) != 5:
                    raise RuntimeError(f"unexpected message from the producer: {message!r}")
                seq = last_seq = _in_order(int(message[2]), last_seq)
                ready = self._take(message, out, views, partial, caller)
                count += len(ready)
                nbytes += sum(e[4] for e in message[4])
                if not views or out is not None:
                    # copies made: the producer may refill it
                    self._ack(channel, sync, seq, f"batch {seq}")
                    yield from ready
                else:
                    yield from ready
                    self._views_done(int(message[3]), caller)
                    # the views of this batch are done with
                    self._ack(channel, sync, seq, f"batch {seq}")
        except PeerAborted:
            aborted_by_peer = True  # the producer stopped it: no need to tell it
            raise
        finally:
            if not finished:
                self._stopped(channel, sync, caller, told=aborted_by_peer)

    def _open(self, channel: Channel, timeout: object) -> tuple[float | None, Any, int]:
        """Start receiving a sync: the checked timeout, the caller's stream, the sync's number.

        Waits for the producer's ``begin`` (an aborted sync's leftovers skipped) and
        says hello.
        """
        if self._closed:
            raise RuntimeError("this BucketReceiver is closed")
        wait = check_timeout(timeout)
        caller = _torch.current_stream(self.device)
        sync = self._begin(channel, wait)
        self._hello(channel, sync)
        return wait, caller, sync

    def _next(self, channel: Channel, wait: float | None, sync: int, what: str) -> Any:
        """The producer's next message of ``sync``; its ``abort`` raised as :class:`PeerAborted`.

        Messages of an earlier, aborted sync are skipped.
        """
        while True:
            message = recv_within(channel, wait, self._peer, what)
            if not (isinstance(message, tuple) and len(message) >= 3):
                raise RuntimeError(f"unexpected message from the producer: {message!r}")
            if message[1] != sync:
                continue  # left over from an earlier, aborted sync
            if message[0] == "abort":
                raise PeerAborted(f"the producer stopped the weight sync: {message[2]}")
            return message

    def _views_done(self, buffer: int, caller: Any) -> None:
        """The user's work on views of ``buffer`` is queued: the producer may refill it after it.

        On the device by the buffer's drained event; else (host buffers, or another
        device's) by waiting here for the user's queued work, which may still read them.
        """
        if self._drained:
            _torch.record_event(self._drained[buffer], caller)
        elif self.device.type == "cuda":
            _torch.synchronize_stream(caller)

    def _stopped(self, channel: Channel, sync: int, caller: Any, *, told: bool) -> None:
        """A sync that ends early: the producer told (unless it stopped it), reads ordered.

        Every drained event is recorded after all the reads queued so far (ours and
        the user's work on views), so that the producer's next fills come after them.
        """
        with contextlib.suppress(Exception):
            if self._drained:
                _torch.wait_stream(caller, self._side_stream())
                for event in self._drained:
                    _torch.record_event(event, caller)
        if not told:
            with contextlib.suppress(Exception):
                channel.send(("abort", sync, "the receiver stopped before the end"))

    def receive_groups(
        self,
        channel: Channel,
        *,
        views: bool = True,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> Generator[tuple[list[tuple[str, torch.Tensor]], Any], None, None]:
        """Yield ``(tensors, tag)`` for every group of one :meth:`WeightBucket.send_groups`.

        Args:
            channel: the consumer's end of the channel.
            views: hand out a group that came in one batch as views of the bucket (no
                copy, no new memory; :attr:`zero_copy` says whether they are on this
                receiver's device). They are valid until the iterator is asked for the
                next group: copy what you keep. A group split across batches arrives
                as copies.
            timeout: the longest wait for any one message of the producer (None: no
                bound); with a ``Pipe`` end the producer's death ends the wait too.

        Yields:
            ``(tensors, tag)``: the group's ``(name, tensor)`` pairs in the producer's
            order, ready on the current stream, and the tag it was sent with.

        Raises:
            SyncError, RuntimeError: as :meth:`receive`; what was yielded before stays
                yielded.

        Example:
            >>> for tensors, layer in receiver.receive_groups(conn):  # doctest: +SKIP
            ...     model.layers[layer].load(tensors)
        """
        wait, caller, sync = self._open(channel, timeout)
        partial: dict[str, tuple[torch.Tensor, int]] = {}
        group: list[tuple[str, torch.Tensor]] = []
        finished = aborted_by_peer = False
        count = nbytes = 0
        last_seq: int | None = None
        try:
            while True:
                message = self._next(channel, wait, sync, "the next group")
                kind = message[0]
                if kind == "end":
                    if group:
                        raise SyncError("the sync ended inside a group: a batch was lost")
                    self._check_end(message, partial, count, nbytes, last_seq)
                    finished = True
                    self._ack(channel, sync, message[2], "the end")
                    return
                if kind == "batch" and len(message) == 5:
                    raise RuntimeError(
                        "the producer sends a plain sync (WeightBucket.send): receive it with "
                        "BucketReceiver.receive"
                    )
                if kind not in ("batch", "group") or len(message) != (6 if kind == "batch" else 4):
                    raise RuntimeError(f"unexpected message from the producer: {message!r}")
                seq = last_seq = _in_order(int(message[2]), last_seq)
                if kind == "group":  # an empty group
                    if group:
                        raise SyncError("an empty group came inside a group: a batch was lost")
                    yield [], message[3]
                    continue
                mark = message[5]
                if mark is not None and not (
                    isinstance(mark, tuple) and len(mark) == 2 and mark[0] == "group"
                ):
                    raise RuntimeError(f"unexpected message from the producer: {message!r}")
                ends = mark is not None
                whole = views and ends and not group and not partial
                ready = self._take(message[:5], None, whole, partial, caller)
                count += len(ready)
                nbytes += sum(e[4] for e in message[4])
                if not whole:  # copies made: the producer may refill it
                    self._ack(channel, sync, seq, f"batch {seq}")
                    group.extend(ready)
                    if ends:
                        tensors, group = group, []
                        yield tensors, message[5][1]
                    continue
                yield ready, message[5][1]
                self._views_done(int(message[3]), caller)
                self._ack(channel, sync, seq, f"batch {seq}")
        except PeerAborted:
            aborted_by_peer = True  # the producer stopped it: no need to tell it
            raise
        finally:
            if not finished:
                self._stopped(channel, sync, caller, told=aborted_by_peer)

    @property
    def zero_copy(self) -> bool:
        """Whether views of the bucket are on this receiver's device, handed back there.

        True for device buffers opened on their own device: views cost no copy, and
        the producer learns when they are read from events on the device, not by a
        wait here.
        """
        return bool(self._drained)

    def _ack(self, channel: Channel, sync: int, seq: int, what: str) -> None:
        """Tell the producer message ``seq`` of ``sync`` (``what``) is done with."""
        send_to(channel, ("ack", sync, seq), self._peer, f"the ack of {what}")

    @staticmethod
    def _check_end(
        message: Any,
        partial: dict[str, tuple[torch.Tensor, int]],
        count: int,
        nbytes: int,
        last_seq: int | None,
    ) -> None:
        """The end says how many tensors and bytes were sent: all must have arrived."""
        if partial:
            raise SyncError(f"the sync ended with incomplete tensors {sorted(partial)}")
        if len(message) >= 5:
            sent, sent_bytes = int(message[3]), int(message[4])
            if (count, nbytes) != (sent, sent_bytes):
                raise SyncError(
                    f"the producer sent {sent} tensors ({sent_bytes} bytes) but {count} "
                    f"({nbytes} bytes) arrived: a batch was lost"
                )
        end_seq = int(message[2])
        if last_seq is not None and end_seq != last_seq + 1:
            raise SyncError(f"the sync ended at message {end_seq} after batch {last_seq}: lost")

    def _hello(self, channel: Channel, sync: int) -> None:
        """Tell the producer who reads its buffers (a pid), and the events that say when.

        The events go with every sync: a producer whose earlier sync failed forgot
        them (it cannot tell this receiver from a new one) and waits for them before
        it fills a buffer, which our copies out of may still be queued on the device.
        """
        if self._drained and self._event_handles is None:
            self._event_handles = [_torch.ipc_event_handle(e) for e in self._drained]
        hello = ("hello", sync, os.getpid(), self._event_handles)
        send_to(channel, hello, self._peer, "its hello")

    def _begin(self, channel: Channel, timeout: float | None) -> int:
        """Wait for the next sync's ``begin``, skipping leftovers of an aborted one."""
        while True:
            message = recv_within(channel, timeout, self._peer, "the start of a sync")
            if isinstance(message, tuple) and len(message) == 2 and message[0] == "begin":
                return int(message[1])

    async def areceive(
        self,
        channel: Channel,
        *,
        out: Mapping[str, torch.Tensor] | None = None,
        views: bool = False,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Async :meth:`receive`: each blocking step runs in a worker thread."""
        iterator = self.receive(channel, out=out, views=views, timeout=timeout)
        try:
            while True:
                item = await asyncio.to_thread(next, iterator, _END)
                if item is _END:
                    return
                yield item  # type: ignore[misc]
        finally:
            await asyncio.to_thread(iterator.close)

    def close(self) -> None:
        """Let go of the bucket's memory (the producer can then free it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._word_views.clear()
        self._typed.clear()  # views of the buffers: they would keep them mapped
        self._peer.close()
        _torch.release_stream(self._stream)  # kept for the next owner, never destroyed
        self._stream = None
        self._held.release(unlink=False)  # the producer owns the names
