"""The producer's side of fd passing: one thread that hands out exports and holds leases.

An export (:func:`hybridmem.ipc_export` of a tensor in an expandable segment) is a
set of file descriptors of device memory, a one-time token and a reference to the
tensor's storage. The server listens on an abstract Unix socket while at least one
export waits to be opened, and only then: with none pending the listener is
closed, so nothing stays listening after a sync. It closes before the last
export's fds are sent, so a handle opened once finds nobody listening when it
is opened again. A consumer connects, the kernel
tells the server its uid and pid (``SO_PEERCRED``), the consumer sends the token;
only a peer of this user, with the token (and the pid the export names, if it
names one), gets the fds (``SCM_RIGHTS``). Anyone else is logged and disconnected,
and the export stays available to the right consumer.

The connection then stays open as the consumer's **lease**: the producer keeps the
storage referenced (so torch's allocator neither reuses nor unmaps it) until the
consumer sends ``RELEASE`` (its tensor was freed) or the connection closes (the
consumer exited or crashed: the kernel closes its sockets). This is what torch's
own CUDA IPC does with a shared reference-count file; a socket needs no polling
and survives a crash of either side.

Scope: process-global (one server per process, started on demand, its thread
ending when nothing is pending or leased); thread-safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from hybridmem._log import logger
from hybridmem._platform import unix_socket

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "HELLO",
    "OK",
    "RELEASE",
    "Export",
    "ServerStats",
    "digest",
    "offer",
    "server_stats",
    "withdraw",
]

#: What a consumer sends first: this tag, then the export's token.
HELLO = b"HMFD1"
#: The server's answer to a good hello, sent with the fds.
OK = b"HMFD1-OK"
#: What a consumer sends when its tensor was freed (then it closes).
RELEASE = b"HMFD1-RELEASE"
#: Seconds a connected peer has to send its token before it is dropped.
HANDSHAKE_TIMEOUT_S = 10.0
_MAX_MESSAGE = 256


def digest(token: bytes) -> bytes:
    """The key an export is filed under (the token itself is never stored)."""
    return hashlib.sha256(token).digest()


@dataclass
class Export:
    """One export waiting to be opened, then leased.

    Attributes:
        key: :func:`digest` of its token.
        fds: the allocations' fds, closed once sent (or when the export ends).
        keep: what must stay alive while a consumer may read the memory (the
            tensor's storage, its interprocess event).
        nbytes: bytes it makes reachable (for logs).
        deadline: ``time.monotonic()`` after which an unopened export is dropped
            (None: never).
        consumer_pid: the only pid allowed to open it (None: any process of this user).
    """

    key: bytes
    fds: list[int]
    keep: tuple[object, ...]
    nbytes: int
    deadline: float | None = None
    consumer_pid: int | None = None

    def drop(self) -> None:
        """Close the fds and let go of what was kept."""
        unix_socket.close_fds(self.fds)
        self.fds = []
        self.keep = ()


@dataclass(frozen=True)
class ServerStats:
    """What the server holds now: exports waiting, leases held, whether it listens."""

    pending: int
    leases: int
    listening: bool
    leased_bytes: int


@dataclass
class _Peer:
    sock: socket.socket
    pid: int
    uid: int
    deadline: float
    export: Export | None = None  # set once the fds were sent: a lease
    _closed: bool = field(default=False, repr=False)


class _Server:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[bytes, Export] = {}
        self._peers: dict[int, _Peer] = {}
        self._listener: socket.socket | None = None
        self._address = b""
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1

    # -- called by producers (any thread) -------------------------------- #
    def offer(self, export: Export) -> bytes:
        with self._lock:
            if self._listener is None:
                self._address = unix_socket.new_address()
                self._listener = unix_socket.listen(self._address)
                logger.debug("fd server: listening (%d pending)", len(self._pending) + 1)
            self._pending[export.key] = export
            address = self._address
            self._ensure_thread()
        self._wake()
        return address

    def withdraw(self, key: bytes) -> bool:
        with self._lock:
            export = self._pending.pop(key, None)
        if export is None:
            return False
        export.drop()
        self._wake()  # the thread closes the listener if nothing is pending now
        return True

    def stats(self) -> ServerStats:
        with self._lock:
            leases = [p.export for p in self._peers.values() if p.export is not None]
            return ServerStats(
                pending=len(self._pending),
                leases=len(leases),
                listening=self._listener is not None,
                leased_bytes=sum(e.nbytes for e in leases),
            )

    # -- the thread -------------------------------------------------------- #
    def _ensure_thread(self) -> None:
        # Not is_alive(): a thread that decided to end (it set _thread to None under
        # the lock) may still be alive for a moment, and would miss this export.
        if self._thread is not None:
            return
        if self._wake_r < 0:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="hybridmem-fd-server", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _close_listener_if_idle(self) -> None:
        """Close the listener when nothing is pending (server thread, lock held).

        Only the server thread closes sockets, so it never watches a closed fd.
        """
        if not self._pending and self._listener is not None:
            self._listener.close()
            self._listener = None
            logger.debug("fd server: no export pending, listener closed")

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            while True:
                try:
                    if not self._serve_once(selector):
                        return
                except Exception:  # pragma: no cover - a bug; keep serving the others
                    logger.exception("hybridmem fd server: one round failed")
        finally:
            selector.close()

    def _serve_once(self, selector: selectors.BaseSelector) -> bool:
        with self._lock:
            self._expire(time.monotonic())
            if not self._pending and not self._peers:
                self._thread = None
                return False
            watched: dict[int, object] = {self._wake_r: "wake"}
            if self._listener is not None:
                watched[self._listener.fileno()] = self._listener
            for fd, peer in self._peers.items():
                watched[fd] = peer
            timeout = self._next_deadline()
        for key in list(selector.get_map().values()):
            selector.unregister(key.fileobj)
        for fd, what in watched.items():
            selector.register(fd, selectors.EVENT_READ, what)  # all open: only we close
        for key, _ in selector.select(timeout):
            what = key.data
            if what == "wake":
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            elif isinstance(what, socket.socket):
                self._accept(what)
            elif isinstance(what, _Peer):
                self._read(what)
        return True

    def _next_deadline(self) -> float | None:
        deadlines = [e.deadline for e in self._pending.values() if e.deadline is not None]
        deadlines += [p.deadline for p in self._peers.values() if p.export is None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _expire(self, now: float) -> None:
        for key, export in list(self._pending.items()):
            if export.deadline is not None and now >= export.deadline:
                del self._pending[key]
                export.drop()
                logger.warning(
                    "hybridmem: an export of %d bytes was not opened in time and was "
                    "withdrawn; export the tensor again for the consumer",
                    export.nbytes,
                )
        for peer in list(self._peers.values()):
            if peer.export is None and now >= peer.deadline:
                logger.warning(
                    "hybridmem: pid %d (uid %d) connected to the export socket but sent "
                    "no token in %.0f s; disconnected",
                    peer.pid,
                    peer.uid,
                    HANDSHAKE_TIMEOUT_S,
                )
                self._close_peer(peer)
        self._close_listener_if_idle()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, OSError):
            return
        pid, uid, _gid = unix_socket.peer_credentials(sock)
        if uid != os.getuid():
            logger.warning(
                "hybridmem: refused pid %d of uid %d at the export socket: only this "
                "user (uid %d) may open exports",
                pid,
                uid,
                os.getuid(),
            )
            sock.close()
            return
        sock.setblocking(False)
        with self._lock:
            self._peers[sock.fileno()] = _Peer(
                sock, pid, uid, time.monotonic() + HANDSHAKE_TIMEOUT_S
            )

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(_MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if peer.export is not None:  # a lease: any message or EOF ends it
            if data and data != RELEASE:
                logger.warning("hybridmem: unexpected message on a lease from pid %d", peer.pid)
            with self._lock:
                self._close_peer(peer)
            return
        self._handshake(peer, data)

    def _handshake(self, peer: _Peer, data: bytes) -> None:
        token = data[len(HELLO) :] if data.startswith(HELLO) else b""
        key = digest(token) if token else b""
        with self._lock:
            export = None
            for candidate_key, candidate in self._pending.items():
                if token and hmac.compare_digest(candidate_key, key):
                    export = candidate
                    break
            refusal = None
            if export is None:
                refusal = "no valid token (wrong, already used or withdrawn)"
            elif export.consumer_pid is not None and peer.pid != export.consumer_pid:
                refusal = f"the export is for pid {export.consumer_pid} only"
            if refusal is not None:
                logger.warning(
                    "hybridmem: refused pid %d (uid %d) at the export socket: %s",
                    peer.pid,
                    peer.uid,
                    refusal,
                )
                self._close_peer(peer)
                return
            assert export is not None
            del self._pending[export.key]
            # Close the listener before the fds leave, not after: the consumer may run
            # on as soon as they arrive, and a second open of the same handle must then
            # find nobody listening, never a listener about to close (a race CI hit).
            self._close_listener_if_idle()
            try:
                unix_socket.send_with_fds(peer.sock, OK, export.fds)
            except OSError as exc:
                logger.warning("hybridmem: sending an export to pid %d failed: %s", peer.pid, exc)
                export.drop()
                self._close_peer(peer)
                return
            unix_socket.close_fds(export.fds)  # the consumer has its own copies now
            export.fds = []
            peer.export = export
        logger.debug("fd server: pid %d opened an export of %d bytes", peer.pid, export.nbytes)

    def _close_peer(self, peer: _Peer) -> None:
        """Drop a connection; a lease's storage is let go (lock held)."""
        if not peer._closed:  # fileno() is -1 once closed
            self._peers.pop(peer.sock.fileno(), None)
            peer._closed = True
        with contextlib.suppress(OSError):
            peer.sock.close()
        if peer.export is not None:
            peer.export.drop()
            peer.export = None


_SERVER = _Server()


def offer(export: Export) -> bytes:
    """Make ``export`` available to one consumer; return the socket address to give it.

    The address is the current listener's; it stays valid until ``export`` is
    opened, withdrawn or expired.
    """
    return _SERVER.offer(export)


def withdraw(key: bytes) -> bool:
    """Withdraw the unopened export filed under ``key``; False if it was not pending."""
    return _SERVER.withdraw(key)


def server_stats() -> ServerStats:
    """Return what this process's server holds now.

    Example:
        >>> server_stats().leases   # doctest: +SKIP
        0
    """
    return _SERVER.stats()
