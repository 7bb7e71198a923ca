"""The drop-in's two ends for one ``zmq_handle``: a connection kept, a bucket per sync.

verl builds a new ``BucketedWeightSender`` and a new ``BucketedWeightReceiver`` for
every weight update, each allocating, exporting and opening a fresh buffer, and each
frees it at the end of the update (``_cleanup``: the buffer dropped, ``ipc_collect``,
``empty_cache``). Here the sender's process keeps one :class:`SenderLink` per
``zmq_handle`` (a listening socket and the worker's connection, host resources only)
and the receiver's process one :class:`ReceiverLink` (the connection): verl's objects
come and go, the links stay.

What stays on the devices between syncs is what verl's own pair leaves: nothing. Each
sync makes a :class:`~hybridmem.WeightBucket` (:func:`buffers` buffers of verl's
bucket size), the worker opens it, and at the sync's end the worker closes its
mappings and gives its cache back, then the trainer frees the bucket and gives its
cache back, as verl's ``_cleanup`` does on both sides. A user who would rather keep
the bucket (made and opened once, for the process's life: faster syncs, at the price
of the bucket's memory on every trainer GPU through the rollout, and its mapping in
the worker) sets ``HYBRIDMEM_VERL_KEEP_BUCKET=1`` (:func:`keep_bucket`).

The socket: beside verl's own ZMQ path for an ``ipc://`` handle (``<path>.hybridmem``:
the two processes share ``/tmp`` exactly as verl's ZMQ sockets need), else an abstract
Unix socket named after the handle. Only a process of the same user is accepted.

One sync, over that connection (each wait bounded by ``timeout``):

- sender: ``("bucket", handle, bucket_size)`` where the worker has not opened this
  sync's bucket (the worker answers ``("ready", pid)``), then
  ``("sync", n, bucket_size, keep)``, then verl's batches (cut by
  :class:`~hybridmem.integrations.verl.batches.VerlBatches`) as the groups of one
  bucket sync (:meth:`~hybridmem.WeightBucket.send_groups`), each tagged with its
  ``is_last``;
- receiver: each batch to ``on_bucket_received`` as it arrives
  (:meth:`~hybridmem.BucketReceiver.receive_groups`: views of the bucket where it is on
  this device), then, unless ``keep``, closes its mappings and releases its cache,
  then ``("done", n)``, or ``("failed", n, why)`` when a callback raised (the sender
  raises it too); unless ``keep``, the sender then frees the bucket.

A link whose peer died, closed its end or went silent is dropped by the side that saw
it: what the peer left unread is not read again, and the next sync connects anew.

Scope: one sync at a time per link (a lock); the links of a process by handle.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import select
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._errors import SyncError
from hybridmem._log import logger
from hybridmem._platform import unix_socket
from hybridmem.integrations.verl.batches import Batch, OnBucket
from hybridmem.integrations.verl.settings import (  # DEFAULT_TIMEOUT_S: 0.2.0 defined it here
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    buffers,
    keep_bucket,
    timeout_s,
    transport,
)
from hybridmem.integrations.verl.sizing import bucket_shape, look_ahead
from hybridmem.ipc._wire import BucketHandle, Peer, PeerAborted, recv_within, send_to
from hybridmem.ipc.bucket import WeightBucket
from hybridmem.ipc.receiver import BucketReceiver

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ReceiverLink",
    "SenderLink",
    "address_of",
    "close_links",
    "made_sender_link",
    "receiver_link",
    "sender_link",
]

_CONNECT_SLICE_S = 0.01  # how often a receiver retries a sender not yet listening
_PATH_MAX = 100  # sun_path holds 108 bytes


def address_of(zmq_handle: str) -> bytes:
    """The drop-in's socket for verl's ``zmq_handle`` (both ends compute the same)."""
    if not isinstance(zmq_handle, str) or not zmq_handle:
        raise TypeError(f"zmq_handle must be a non-empty str, got {zmq_handle!r}")
    if zmq_handle.startswith("ipc://"):
        path = zmq_handle[len("ipc://") :] + ".hybridmem"
        if len(path.encode()) <= _PATH_MAX:
            return path.encode()
    digest = hashlib.sha256(zmq_handle.encode()).hexdigest()[:32]
    return b"\0hybridmem-verl-" + digest.encode()


class SenderLink:
    """The sender's end for one handle: a socket listened on once, a bucket per sync.

    Args:
        zmq_handle: verl's handle.
        bucket_size: verl's bucket, bytes, at the first sync. Each sync names its own
            size: a bucket made for it has buffers that large; a kept bucket keeps the
            first sync's (the receiver cuts verl's batches by the sync's size).
        use_shm: verl's flag: host shared memory instead of the device (``transport="host"``).
        device: where the tensors to send are (the bucket's device).
    """

    def __init__(self, zmq_handle: str, bucket_size: int, use_shm: bool, device: Any) -> None:
        self.zmq_handle = zmq_handle
        self.bucket_size = bucket_size
        self.timeout = timeout_s()
        self.address = address_of(zmq_handle)
        self.lock = threading.Lock()
        self._syncs = 0
        self._conn: Any = None
        self._peer = Peer(None, "vLLM worker")
        index = device.index if isinstance(device, torch.device) and device.type == "cuda" else None
        # Read once, here: a bad value fails the first sync before any wait.
        self._bucket_args = (index, "host" if use_shm else transport())
        buffers()
        #: the bucket of the sync in progress (kept between syncs only when asked)
        self.bucket: WeightBucket | None = None
        self._opened: WeightBucket | None = None  # the bucket the connected worker opened
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        if not self.address.startswith(b"\0"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address)  # a stale socket of an earlier run
        self._listener: socket.socket | None = unix_socket.listen(self.address, stream=True)
        logger.info(
            "verl drop-in: %s serves %s; %s",
            self.address,
            zmq_handle,
            f"the bucket ({buffers(True)} x verl's bucket size) is kept between syncs "
            "(HYBRIDMEM_VERL_KEEP_BUCKET) until close_links()"
            if keep_bucket()
            else f"each sync's bucket (up to {buffers()} x verl's bucket size) is freed "
            "when the sync ends",
        )

    def _new_bucket(self, size: int, count: int) -> WeightBucket:
        index, transport = self._bucket_args
        return WeightBucket(
            size,
            index,
            transport=transport,  # type: ignore[arg-type]
            fallback="auto",
            buffers=count,
        )

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if not self.address.startswith(b"\0"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.address)

    def _connection(self) -> Any:
        """The receiver's connection: kept while it lives, else a new one within the timeout."""
        if self._conn is not None and not unix_socket.peer_closed(self._conn):
            return self._conn
        self._drop_connection()
        assert self._listener is not None
        readable, _, _ = select.select([self._listener], [], [], self.timeout)
        if not readable:
            raise SyncError(
                f"no verl receiver connected to {self.zmq_handle!r} within {self.timeout:g} s "
                f"({TIMEOUT_ENV}): is the vLLM worker calling update_weights_from_ipc, and "
                "does it run hybridmem's BucketedWeightReceiver (hybridmem.integrations.verl."
                "install() there, or HYBRIDMEM_VERL=1)?"
            )
        sock, _ = self._listener.accept()
        pid, uid, _ = unix_socket.peer_credentials(sock)
        if uid != os.getuid():
            sock.close()
            raise SyncError(f"a process of another user (uid {uid}) connected; refused")
        self._peer = Peer(pid or None, "vLLM worker")
        self._conn = unix_socket.message_channel(sock)
        return self._conn

    def _offer(self, conn: Any, shape: tuple[int, int], bucket_size: int) -> WeightBucket:
        """This sync's bucket, made if there is none and opened by the worker if it has not.

        ``shape``: ``(bytes per buffer, buffers)`` of a bucket made now.
        """
        if self.bucket is not None and self._opened is None and self.bucket.transport == "host":
            # A kept host bucket, and a new worker (the last one exited): host buffers
            # are opened by name, and their names went once the last one had them.
            self._free_bucket()
        if self.bucket is None:
            self.bucket = self._new_bucket(*shape)
        bucket = self.bucket
        if self._opened is not bucket:
            send_to(conn, ("bucket", bucket.handle, bucket_size), self._peer, "the bucket")
            answer = recv_within(conn, self.timeout, self._peer, "its ready message")
            if not (isinstance(answer, tuple) and answer[:1] == ("ready",)):
                raise SyncError(f"unexpected answer from the verl receiver: {answer!r}")
            bucket.unlink_shared_names()  # host buffers: mapped there, names can go
            self._opened = bucket
        return bucket

    def _free_bucket(self) -> None:
        """Free the bucket, its cache given back to the driver (as verl's ``_cleanup``)."""
        bucket, self.bucket, self._opened = self.bucket, None, None
        if bucket is not None:
            bucket.close()

    def send(
        self, batches: Iterable[Batch], bucket_size: int, caller: Any = None, keep: bool = False
    ) -> int:
        """Send one sync of verl's batches (``(weights, is_last)``); return how many tensors.

        Each batch is one group of the bucket's sync, streamed as ``batches`` yields
        them: the receiver hands it to ``on_bucket_received`` whole, as views of the
        bucket when it came in one buffer. ``bucket_size`` is verl's bucket for this
        sync (the batches were cut by it). ``caller``: the stream the weights were
        written on, in the thread that made them (None: this thread's current one); the
        copies out of them wait for its work, and its later work waits for the copies.
        ``keep``: keep the bucket for the next sync; else it is freed before this
        returns, whether the sync succeeded or not, once the worker let go of it.

        Raises:
            SyncError: the receiver did not connect or answer in time, died, or its
                ``on_bucket_received`` raised (its error is in the message).
        """
        with self.lock:
            try:
                return self._send(batches, bucket_size, caller, keep)
            finally:
                if not keep:
                    self._free_bucket()

    def _send(self, batches: Iterable[Batch], bucket_size: int, caller: Any, keep: bool) -> int:
        conn = self._connection()
        self._syncs += 1
        sync = self._syncs
        sent = [0]
        callback_failed = False  # the worker's callback raised: the connection is sound
        try:
            count = buffers(keep)
            ahead, batches = look_ahead(batches, 0 if keep else count)
            bucket = self._offer(conn, bucket_shape(ahead, bucket_size, count), bucket_size)

            def groups() -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
                for weights, last in batches:
                    checked = bucket.check(weights)
                    sent[0] += len(checked)
                    yield checked, bool(last)
                    if last:
                        return

            start = ("sync", sync, bucket_size, keep)
            send_to(conn, start, self._peer, f"the start of sync {sync}")
            try:
                with _torch.stream_scope(caller):
                    bucket.send_groups(groups(), conn, timeout=self.timeout)
            except PeerAborted as exc:  # the receiver stopped: its callback says why
                reason = self._reason(conn, sync)
                callback_failed = True
                raise SyncError(
                    f"the vLLM worker's on_bucket_received failed: {reason or exc}"
                ) from exc
            while True:  # what an earlier, stopped sync left unread is skipped
                what = f"the end of sync {sync}"
                answer = recv_within(conn, self.timeout, self._peer, what)
                if isinstance(answer, tuple) and answer[:2] == ("failed", sync):
                    callback_failed = True
                    raise SyncError(f"the vLLM worker's on_bucket_received failed: {answer[2]}")
                if answer == ("done", sync):
                    return sent[0]
        except SyncError:
            if not callback_failed:  # died, closed or silent: the next sync accepts anew
                self._drop_connection()
            raise

    def stop(self, reason: str) -> None:
        """Tell the worker that this sync failed before its first tensor (``reason``).

        Waits for the worker's connection as a sync does (bounded by the timeout), so
        that its receiver raises at once instead of waiting out the timeout.

        Raises:
            SyncError: no worker connected within the timeout, or it died.
        """
        with self.lock:
            conn = self._connection()
            self._syncs += 1
            try:
                send_to(conn, ("stopped", self._syncs, reason), self._peer, "the stop")
            except SyncError:
                self._drop_connection()
                raise

    def submit(
        self, batches: Iterable[Batch], bucket_size: int, caller: Any = None, keep: bool = False
    ) -> concurrent.futures.Future[int]:
        """:meth:`send`, run on this link's own thread; its future.

        The thread is made at the first sync and kept: a sync neither starts a thread
        nor waits for one to be joined, and an event loop's default executor (whatever
        else it runs) never delays it.
        """
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="hybridmem-verl-sender"
            )
        return self._worker.submit(self.send, batches, bucket_size, caller, keep)

    def _drop_connection(self) -> None:
        """Forget the receiver's connection: what is left on it is not read again.

        A worker that died may have left messages unread on it, so that it does not
        look closed yet; the next sync waits for a new connection instead.
        """
        self._opened = None  # the next worker opens the bucket anew
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None

    def _reason(self, conn: Any, sync: int) -> str | None:
        """What the receiver said when it stopped a sync (its callback's error), if it did."""
        with contextlib.suppress(Exception):
            deadline = time.monotonic() + min(self.timeout, 5.0)
            while time.monotonic() < deadline and conn.poll(0.05):
                message = conn.recv()
                if isinstance(message, tuple) and message[:2] == ("failed", sync):
                    return str(message[2])
        return None

    def close(self) -> None:
        """Free the bucket, if one is kept, and close the socket. Idempotent."""
        self._drop_connection()
        self._close_listener()
        self._peer.close()
        self._free_bucket()
        if self._worker is not None:  # its sync, if any, ends on the closed connection
            self._worker.shutdown(wait=False)
            self._worker = None


class ReceiverLink:
    """The receiver's end for one handle: connected once, each sync's bucket opened.

    Args:
        zmq_handle: verl's handle.
        device: where received tensors go (the worker's device; the CPU without CUDA).
    """

    def __init__(self, zmq_handle: str, device: torch.device) -> None:
        self.zmq_handle = zmq_handle
        self.timeout = timeout_s()
        self.lock = threading.Lock()
        index = device.index if device.type == "cuda" else None
        if device.type == "cuda" and index is None:
            index = torch.cuda.current_device()
        self._index = index
        #: the sender's bucket, opened (None between syncs unless the sender keeps it)
        self.receiver: BucketReceiver | None = None
        address = address_of(zmq_handle)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock = unix_socket.connect(address, self.timeout, stream=True)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise SyncError(
                        f"no verl sender listens for {zmq_handle!r} after {self.timeout:g} s "
                        f"({TIMEOUT_ENV}): does the trainer run hybridmem's "
                        "BucketedWeightSender (hybridmem.integrations.verl.install())?"
                    ) from None
                time.sleep(_CONNECT_SLICE_S)
        pid = unix_socket.peer_credentials(sock)[0] or None
        self._conn = unix_socket.message_channel(sock)
        self._peer = Peer(pid, "verl sender")
        self._broken = False

    def _open(self, message: tuple[Any, ...]) -> None:
        """Open the sender's bucket (closing the one before), and say so."""
        handle = message[1]
        if not isinstance(handle, BucketHandle):
            raise SyncError(f"the verl sender sent {type(handle).__name__}, not a bucket")
        self._let_go(release=False)
        self.receiver = BucketReceiver(handle, self._index)
        send_to(self._conn, ("ready", os.getpid()), self._peer, "its ready message")

    def _let_go(self, *, release: bool) -> None:
        """Close the bucket's mappings; with ``release``, give this device's cache back.

        As verl's receiver ends a sync: the device's work done first (the callback's
        copies out of the bucket may still run), then the mappings closed, then CUDA
        IPC's leftovers collected and the cache emptied, so the sender's free of the
        bucket returns its memory to the driver.
        """
        receiver, self.receiver = self.receiver, None
        on_device = self._index is not None and _torch.cuda_initialized()
        if receiver is not None:
            if on_device:
                _torch.synchronize(self._index)  # type: ignore[arg-type]
            receiver.close()
        if release and on_device:
            _torch.ipc_collect()
            _torch.empty_cache()

    def receive(self, on_bucket_received: OnBucket) -> int:
        """Receive one sync, calling ``on_bucket_received`` with verl's batches; count them.

        Each batch comes as views of the bucket where it came in one buffer on this
        device (as verl's own receiver hands out views of its buffer), else as copies.
        Unless the sender keeps its bucket, the bucket's mappings are closed and this
        device's cache given back before this returns or raises.

        Raises:
            SyncError: the sender died, went silent or stopped (nothing more is
                delivered; what was delivered before stays delivered).
            Exception: what ``on_bucket_received`` raised (the sender is told).
        """
        with self.lock:
            conn = self._conn
            try:
                while True:  # what an earlier, stopped sync left unread is skipped
                    header = recv_within(conn, self.timeout, self._peer, "the start of a sync")
                    if isinstance(header, tuple) and len(header) == 3 and header[0] == "bucket":
                        self._open(header)
                    elif isinstance(header, tuple) and len(header) == 4 and header[0] == "sync":
                        break
                    elif isinstance(header, tuple) and len(header) == 3 and header[0] == "stopped":
                        raise PeerAborted(f"sync {header[1]}: {header[2]}")
            except PeerAborted as exc:  # the sender's weights failed before the first tensor
                self._let_go(release=True)
                raise SyncError(f"the verl sender stopped ({exc}); nothing was delivered") from exc
            except SyncError:
                self._broken = True
                self._let_go(release=True)
                raise
            sync, keep = header[1], bool(header[3])
            if self.receiver is None:
                self._broken = True
                raise SyncError(f"the verl sender started sync {sync} without a bucket")
            try:
                try:
                    calls = self._deliver(self.receiver, on_bucket_received)
                finally:
                    if not keep:  # nothing of the sync's views is referenced here now
                        self._let_go(release=True)
            except PeerAborted as exc:  # the sender's weights or checks failed: it said why
                raise SyncError(
                    f"the verl sender stopped sync {sync} ({exc}); what was delivered "
                    "before stays delivered"
                ) from exc
            except SyncError:
                # Died, closed or silent: what it left unread is not read again, the
                # next receive connects anew.
                self._broken = True
                raise
            except BaseException as exc:
                self._failed(conn, sync, exc)
                raise
            send_to(conn, ("done", sync), self._peer, f"the end of sync {sync}")
            return calls

    def _deliver(self, receiver: BucketReceiver, on_bucket_received: OnBucket) -> int:
        """Hand each batch of the sync to ``on_bucket_received``; how many batches."""
        calls = 0
        groups = receiver.receive_groups(self._conn, views=receiver.zero_copy, timeout=self.timeout)
        try:
            for weights, last in groups:
                calls += 1
                on_bucket_received(weights, bool(last))
        finally:
            groups.close()  # stopped early: the sender is told
        return calls

    @staticmethod
    def _failed(conn: Any, sync: int, exc: BaseException) -> None:
        """Tell the sender why this sync stopped (its ``SyncError`` quotes it)."""
        with contextlib.suppress(Exception):
            conn.send(("failed", sync, f"{type(exc).__name__}: {exc}"))

    @property
    def closed(self) -> bool:
        """Whether the sender closed its end (its process exited or shut the link).

        Also after a sync that ended because the sender died, closed its end or went
        silent, though messages it sent may still be unread on the connection.
        """
        return self._broken or unix_socket.peer_closed(self._conn)

    def close(self) -> None:
        """Let go of the bucket and the connection. Idempotent."""
        self._let_go(release=False)
        with contextlib.suppress(OSError):
            self._conn.close()
        self._peer.close()


_senders: dict[str, SenderLink] = {}
_receivers: dict[str, ReceiverLink] = {}
# One lock per side: a receiver that waits for its sender (in the same process, as
# vLLM's in-process engine runs) must not stop that sender from listening. A receiver
# is made under its handle's own lock: one that waits for its sender (up to the
# timeout) does not hold up another handle's.
_senders_lock = threading.Lock()
_receivers_lock = threading.Lock()
_receiver_locks: dict[str, threading.Lock] = {}


def sender_link(zmq_handle: str, bucket_size: int, use_shm: bool, device: Any) -> SenderLink:
    """This process's sender link for ``zmq_handle``, made once (by the first sync's size)."""
    with _senders_lock:
        link = _senders.get(zmq_handle)
        if link is None:
            link = _senders[zmq_handle] = SenderLink(zmq_handle, bucket_size, use_shm, device)
        return link


def made_sender_link(zmq_handle: str) -> SenderLink | None:
    """This process's sender link for ``zmq_handle`` if one was made (no lock, no wait)."""
    return _senders.get(zmq_handle)


def receiver_link(zmq_handle: str, device: torch.device) -> ReceiverLink:
    """This process's receiver link for ``zmq_handle``, connected once (again if it broke)."""
    with _receivers_lock:
        making = _receiver_locks.setdefault(zmq_handle, threading.Lock())
    with making:
        link = _receivers.get(zmq_handle)
        if link is not None and not link.closed:
            return link
        if link is not None:
            link.close()
        made = ReceiverLink(zmq_handle, device)  # may wait for the sender: no shared lock
        with _receivers_lock:
            _receivers[zmq_handle] = made
        return made


def close_links() -> None:
    """Close every link of this process (its buckets freed, its sockets closed)."""
    with _receivers_lock:
        for link in list(_receivers.values()):
            link.close()
        _receivers.clear()
    with _senders_lock:
        for sender in list(_senders.values()):
            sender.close()
        _senders.clear()
