"""Unix sockets that pass file descriptors (SCM_RIGHTS) and name their peer (SO_PEERCRED).

A file descriptor sent with ``SCM_RIGHTS`` arrives as a new descriptor in the
receiver, with no ptrace right needed (``pidfd_getfd`` needs one, and container
seccomp profiles deny it). The sockets live in Linux's abstract namespace: no file
to clean up, nothing left behind by a crash; anyone in the same network namespace
could connect, so the listener checks the peer's uid with ``SO_PEERCRED`` and
each export carries a one-time token (see :mod:`hybridmem.ipc.fd_server`).
``SOCK_SEQPACKET`` keeps message boundaries, so a message and its fds arrive whole;
``stream=True`` sockets carry a :func:`message_channel` (pickled messages of any
size, as a ``Pipe`` end does).

Stdlib only. Scope: the sockets are the caller's; nothing here is shared.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
from multiprocessing.connection import Connection

__all__ = [
    "PREFIX",
    "Credentials",
    "close_fds",
    "connect",
    "listen",
    "message_channel",
    "new_address",
    "peer_closed",
    "peer_credentials",
    "receive_with_fds",
    "send_with_fds",
]

#: Every hybridmem socket's name starts with this, after the abstract namespace's NUL.
PREFIX = b"hybridmem-fd-"
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
Credentials = tuple[int, int, int]


def new_address(prefix: bytes = PREFIX) -> bytes:
    """Return a fresh, unguessable abstract-namespace address (128 random bits)."""
    return b"\0" + prefix + secrets.token_hex(16).encode()


def _kind(stream: bool) -> int:
    return (socket.SOCK_STREAM if stream else socket.SOCK_SEQPACKET) | socket.SOCK_CLOEXEC


def listen(address: bytes, backlog: int = 16, *, stream: bool = False) -> socket.socket:
    """Bind a non-blocking listener at ``address`` (``SOCK_SEQPACKET``, or ``SOCK_STREAM``).

    Raises:
        OSError: the address is taken (EADDRINUSE) or sockets are not allowed.
    """
    sock = socket.socket(socket.AF_UNIX, _kind(stream))
    try:
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(address: bytes, timeout: float | None, *, stream: bool = False) -> socket.socket:
    """Connect to ``address``; every later call on the socket has ``timeout`` seconds.

    Raises:
        ConnectionRefusedError, FileNotFoundError: nobody listens there.
        TimeoutError: no answer within ``timeout``.
    """
    sock = socket.socket(socket.AF_UNIX, _kind(stream))
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def message_channel(sock: socket.socket) -> Connection:
    """Turn a connected ``stream=True`` socket into a ``Pipe``-like end (it takes the fd).

    ``multiprocessing.connection.Connection`` is the class behind ``Pipe()`` (stable
    since Python 3.3; its constructor, taking an fd, is not in the module's
    ``__all__``): ``send``/``recv`` of pickled messages of any size, ``send_bytes``/
    ``recv_bytes`` of raw ones, and ``poll(timeout)``, which bounded waits need.
    The socket is put back in blocking mode first: the channel's reads and writes
    block, and waits are bounded by ``poll``.
    """
    sock.settimeout(None)
    return Connection(sock.detach())


def peer_closed(channel: Connection) -> bool:
    """Whether the peer closed its end of ``channel``; never blocks, never reads a message.

    Peeks at the socket (on a duplicate of its fd): an end of file is all that is left
    to read once the peer closed the connection, while a pending message means it has
    not. A reset connection counts as closed.
    """
    with socket.fromfd(channel.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            data = probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
    return data == b""


def peer_credentials(sock: socket.socket) -> Credentials:
    """Return the connected peer's ``(pid, uid, gid)``, as the kernel saw them at connect.

    The pid is in this process's pid namespace (0 when the peer's is not visible).
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, gid = _CREDENTIALS.unpack(raw)
    return int(pid), int(uid), int(gid)


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send one message with ``fds`` attached (they stay open here; close them after)."""
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def receive_with_fds(sock: socket.socket, maxlen: int, maxfds: int) -> tuple[bytes, list[int]]:
    """Receive one message and the fds that came with it (the caller closes them).

    An empty message means the peer closed the connection.
    """
    data, fds, _flags, _addr = socket.recv_fds(sock, maxlen, maxfds)
    return data, list(fds)


def close_fds(fds: list[int]) -> None:
    """Close each fd, ignoring ones already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
