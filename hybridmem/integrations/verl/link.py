"""The drop-in's two ends for one ``zmq_handle``, kept for the life of the process.

verl builds a new ``BucketedWeightSender`` and a new ``BucketedWeightReceiver`` for
every weight update, each allocating, exporting and opening a fresh buffer. Here the
sender's process keeps one :class:`SenderLink` per ``zmq_handle`` (one
:class:`~hybridmem.WeightBucket`, exported once, and one listening socket) and the
receiver's process one :class:`ReceiverLink` (the bucket opened once, one connection):
verl's objects come and go, the links stay.

The socket: beside verl's own ZMQ path for an ``ipc://`` handle (``<path>.hybridmem``:
the two processes share ``/tmp`` exactly as verl's ZMQ sockets need), else an abstract
Unix socket named after the handle. Only a process of the same user is accepted.

One sync, over that connection (each wait bounded by ``timeout``):

- sender: ``("sync", n, bucket_size)``, then verl's batches (cut by
  :class:`~hybridmem.integrations.verl.batches.VerlBatches`) as the groups of one
  bucket sync (:meth:`~hybridmem.WeightBucket.send_groups`), each tagged with its
  ``is_last``;
- receiver: each batch to ``on_bucket_received`` as it arrives
  (:meth:`~hybridmem.BucketReceiver.receive_groups`: views of the bucket where it is on
  this device), then ``("done", n)``, or ``("failed", n, why)`` when a callback raised
  (the sender raises it too).

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
from hybridmem.ipc._wire import BucketHandle, Peer, PeerAborted, recv_within, send_to
from hybridmem.ipc.bucket import WeightBucket
from hybridmem.ipc.bucket_options import MAX_BUFFERS
from hybridmem.ipc.receiver import BucketReceiver

__all__ = [
    "DEFAULT_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "ReceiverLink",
    "SenderLink",
    "address_of",
    "buffers",
    "close_links",
    "made_sender_link",
    "receiver_link",
    "sender_link",
]

#: How long either end waits for the other, per message and for the first connection.
DEFAULT_TIMEOUT_S = 120.0
_TIMEOUT_ENV = "HYBRIDMEM_VERL_TIMEOUT"
_TRANSPORT_ENV = "HYBRIDMEM_VERL_TRANSPORT"
_BUFFERS_ENV = "HYBRIDMEM_VERL_BUFFERS"
#: How many bucket-sized buffers a sender's bucket rotates unless told otherwise.
DEFAULT_BUFFERS = 2
_CONNECT_SLICE_S = 0.01  # how often a receiver retries a sender not yet listening
_PATH_MAX = 100  # sun_path holds 108 bytes


def timeout_s() -> float:
    """The links' bound on every wait: ``HYBRIDMEM_VERL_TIMEOUT`` seconds, else 120."""
    raw = os.environ.get(_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{_TIMEOUT_ENV}={raw!r}: a number of seconds > 0 is needed") from None
    if not value > 0:
        raise ValueError(f"{_TIMEOUT_ENV}={raw!r}: a number of seconds > 0 is needed")
    return value


def transport() -> str:
    """The bucket's transport, from ``HYBRIDMEM_VERL_TRANSPORT``: auto, cuda, fd or host."""
    raw = os.environ.get(_TRANSPORT_ENV, "").strip() or "auto"
    if raw not in ("auto", "cuda", "fd", "host"):
        raise ValueError(
            f"{_TRANSPORT_ENV}={raw!r}: one of 'auto', 'cuda', 'fd' (no pidfd_getfd in the "
            "vLLM worker needed, expandable segments kept) or 'host'"
        )
    return raw


def buffers() -> int:
    """How many buffers a sender's bucket rotates: ``HYBRIDMEM_VERL_BUFFERS``, else 2.

    Each is verl's bucket size, on the trainer's device for the process's life; a third
    lets the trainer fill one while the engine's answer for another is on its way.
    """
    raw = os.environ.get(_BUFFERS_ENV, "").strip()
    if not raw:
        return DEFAULT_BUFFERS
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_BUFFERS:
        raise ValueError(
            f"{_BUFFERS_ENV}={raw!r}: a whole number from 1 to {MAX_BUFFERS} is needed "
            f"(default {DEFAULT_BUFFERS}; each buffer is one verl bucket on the trainer's device)"
        )
    return int(raw)


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
    """The sender's end for one handle: a bucket exported once, a socket listened on once.

    Args:
        zmq_handle: verl's handle.
        bucket_size: verl's bucket, bytes, at the first sync: the bucket's buffers are
            as large. A later sync may name another size: it is sent with the sync (the
            receiver cuts verl's batches by it) and the buffers stay.
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
        if not self.address.startswith(b"\0"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address)  # a stale socket of an earlier run
        self._listener: socket.socket | None = unix_socket.listen(self.address, stream=True)
        index = device.index if isinstance(device, torch.device) and device.type == "cuda" else None
        self._bucket_args = (bucket_size, index, "host" if use_shm else transport(), buffers())
        self._served = False  # a receiver opened the bucket (host buffers' names are gone)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        try:
            self.bucket = self._new_bucket()
        except BaseException:
            self._close_listener()
            raise
        logger.info(
            "verl drop-in: %s serves %s over a %s bucket of %d x %d bytes (held until "
            "close_links())",
            self.address,
            zmq_handle,
            self.bucket.transport,
            self._bucket_args[3],
            bucket_size,
        )

    def _new_bucket(self) -> WeightBucket:
        size, index, transport, count = self._bucket_args
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
                f"({_TIMEOUT_ENV}): is the vLLM worker calling update_weights_from_ipc, and "
                "does it run hybridmem's BucketedWeightReceiver (hybridmem.integrations.verl."
                "install() there, or HYBRIDMEM_VERL=1)?"
            )
        sock, _ = self._listener.accept()
        pid, uid, _ = unix_socket.peer_credentials(sock)
        if uid != os.getuid():
            sock.close()
            raise SyncError(f"a process of another user (uid {uid}) connected; refused")
        conn = unix_socket.message_channel(sock)
        self._peer = Peer(pid or None, "vLLM worker")
        if self._served and self.bucket.transport == "host":
            # A new worker (the last one exited): host buffers are opened by name, and
            # their names went once the last one had them. Device buffers open again.
            self.bucket.close()
            self.bucket = self._new_bucket()
        try:
            send_to(
                conn, ("bucket", self.bucket.handle, self.bucket_size), self._peer, "the bucket"
            )
            answer = recv_within(conn, self.timeout, self._peer, "its ready message")
            if not (isinstance(answer, tuple) and answer[:1] == ("ready",)):
                raise SyncError(f"unexpected answer from the verl receiver: {answer!r}")
        except BaseException:
            conn.close()
            raise
        self.bucket.unlink_shared_names()  # host buffers: mapped there, names can go
        self._served = True
        self._conn = conn
        return conn

    def send(self, batches: Iterable[Batch], bucket_size: int, caller: Any = None) -> int:
        """Send one sync of verl's batches (``(weights, is_last)``); return how many tensors.

        Each batch is one group of the bucket's sync, streamed as ``batches`` yields
        them: the receiver hands it to ``on_bucket_received`` whole, as views of the
        bucket when it came in one buffer. ``bucket_size`` is verl's bucket for this
        sync (the batches were cut by it). ``caller``: the stream the weights were
        written on, in the thread that made them (None: this thread's current one); the
        copies out of them wait for its work, and its later work waits for the copies.

        Raises:
            SyncError: the receiver did not connect or answer in time, died, or its
                ``on_bucket_received`` raised (its error is in the message).
        """
        with self.lock:
            conn = self._connection()
            self._syncs += 1
            sync = self._syncs
            sent = [0]
            callback_failed = False  # the worker's callback raised: the connection is sound

            def groups() -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
                for weights, last in batches:
                    checked = self.bucket.check(weights)
                    sent[0] += len(checked)
                    yield checked, bool(last)
                    if last:
                        return

            try:
                start = ("sync", sync, bucket_size)
                send_to(conn, start, self._peer, f"the start of sync {sync}")
                try:
                    with _torch.stream_scope(caller):
                        self.bucket.send_groups(groups(), conn, timeout=self.timeout)
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

    def submit(
        self, batches: Iterable[Batch], bucket_size: int, caller: Any = None
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
        return self._worker.submit(self.send, batches, bucket_size, caller)

    def _drop_connection(self) -> None:
        """Forget the receiver's connection: what is left on it is not read again.

        A worker that died may have left messages unread on it, so that it does not
        look closed yet; the next sync waits for a new connection instead.
        """
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
        """Free the bucket and close the socket. Idempotent."""
        self._drop_connection()
        self._close_listener()
        self._peer.close()
        self.bucket.close()
        if self._worker is not None:  # its sync, if any, ends on the closed connection
            self._worker.shutdown(wait=False)
            self._worker = None


class ReceiverLink:
    """The receiver's end for one handle: connected and the bucket opened, once.

    Args:
        zmq_handle: verl's handle.
        device: where received tensors go (the worker's device; the CPU without CUDA).
    """

    def __init__(self, zmq_handle: str, device: torch.device) -> None:
        self.zmq_handle = zmq_handle
        self.timeout = timeout_s()
        self.lock = threading.Lock()
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
                        f"({_TIMEOUT_ENV}): does the trainer run hybridmem's "
                        "BucketedWeightSender (hybridmem.integrations.verl.install())?"
                    ) from None
                time.sleep(_CONNECT_SLICE_S)
        pid = unix_socket.peer_credentials(sock)[0] or None
        conn = unix_socket.message_channel(sock)
        self._peer = Peer(pid, "verl sender")
        try:
            message = recv_within(conn, self.timeout, self._peer, "the bucket")
            if not (isinstance(message, tuple) and len(message) == 3 and message[0] == "bucket"):
                raise SyncError(f"unexpected first message from the verl sender: {message!r}")
            handle = message[1]
            if not isinstance(handle, BucketHandle):
                raise SyncError(f"the verl sender sent {type(handle).__name__}, not a bucket")
            index = device.index if device.type == "cuda" else None
            if device.type == "cuda" and index is None:
                index = torch.cuda.current_device()
            self.receiver = BucketReceiver(handle, index)
            send_to(conn, ("ready", os.getpid()), self._peer, "its ready message")
        except BaseException:
            conn.close()
            self._peer.close()
            raise
        self._conn = conn
        self._broken = False

    def receive(self, on_bucket_received: OnBucket) -> int:
        """Receive one sync, calling ``on_bucket_received`` with verl's batches; count them.

        Each batch comes as views of the bucket where it came in one buffer on this
        device (as verl's own receiver hands out views of its buffer), else as copies.

        Raises:
            SyncError: the sender died, went silent or stopped (nothing more is
                delivered; what was delivered before stays delivered).
            Exception: what ``on_bucket_received`` raised (the sender is told).
        """
        with self.lock:
            conn = self._conn
            while True:  # what an earlier, stopped sync left unread is skipped
                header = recv_within(conn, self.timeout, self._peer, "the start of a sync")
                if isinstance(header, tuple) and len(header) == 3 and header[0] == "sync":
                    break
            sync = header[1]
            calls = 0
            groups = self.receiver.receive_groups(
                conn, views=self.receiver.zero_copy, timeout=self.timeout
            )
            try:
                try:
                    for weights, last in groups:
                        calls += 1
                        on_bucket_received(weights, bool(last))
                finally:
                    groups.close()  # stopped early: the sender is told
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
        self.receiver.close()
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
