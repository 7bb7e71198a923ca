"""What a WeightBucket and its BucketReceiver share: the handle, the channel, the wire format.

Protocol over any channel with ``send(obj)`` / ``recv()`` (a
``multiprocessing.Pipe`` end, a wrapped ZMQ socket), every message tagged with the
sync's number: ``("begin", sync)``; ``("hello", sync, pid, events)`` from the
receiver (its pid, so that the producer can tell when it dies; the handles of the
interprocess events it records after reading each buffer, or None where it hands off
on the host), which a producer that knows no such events waits for before its first
fill of a device buffer; ``("batch", sync, seq, buffer, entries)`` once a buffer is
filled (its copy finished, or its interprocess event recorded), with a sixth element
``("group", tag)`` on the last batch of a group (:meth:`WeightBucket.send_groups`)
and ``("group", sync, seq, tag)`` for an empty group; ``("ack", sync,
seq)`` from the receiver once it no longer reads that buffer (or queued its reads);
``("end", sync, seq, count, nbytes)``, acknowledged too once the receiver checked
that it got ``count`` tensors and ``nbytes`` bytes in batches numbered without a gap;
``("abort", sync, why)`` from either side ends the sync with an error on the other.
Messages of an earlier, aborted sync are skipped, so a failed sync does not poison the
next one.

Every message goes out through :func:`send_to`, so a peer that exited ends the sync
with a :class:`SyncError` saying so, never a bare ``BrokenPipeError``. Every wait for
the other side is bounded (:func:`recv_within`): a channel with
``poll(timeout)`` (a ``Pipe`` end) is polled in short slices, between which the other
process's liveness is checked, so a peer that died is noticed within a slice even
when this process still holds its end of the pipe (no EOF ever comes then).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from hybridmem._checks import check_seconds
from hybridmem._errors import SyncError
from hybridmem.ipc.transports.base import TransportName

__all__ = [
    "CPU",
    "DEFAULT_TIMEOUT_S",
    "PROTOCOL",
    "UNITS",
    "BucketHandle",
    "Channel",
    "Entry",
    "Peer",
    "PeerAborted",
    "byte_offset",
    "check_timeout",
    "dtype_named",
    "flat_words",
    "recv_within",
    "send_to",
    "word_unit",
]

#: 2: the receiver says hello (its pid); the end is checked. 3: groups, and the hello
#: carries the receiver's drained events, every sync.
PROTOCOL = 3

#: How long a sync waits for the other side by default, per message (seconds).
DEFAULT_TIMEOUT_S = 60.0
_SLICE_S = 0.1  # liveness is checked at least this often while waiting

# (name, dtype, shape, start byte in the tensor, bytes, offset in the buffer, tensor bytes)
Entry = tuple[str, str, tuple[int, ...], int, int, int, int]


@runtime_checkable
class Channel(Protocol):
    """What a bucket talks through: ``send(obj)`` and ``recv()`` of picklable objects.

    ``multiprocessing.connection.Connection`` (a ``Pipe()`` end) qualifies as is.
    Messages are small tuples (names, dtypes, shapes, offsets), never tensor data.
    """

    def send(self, obj: Any) -> None:
        """Send one message to the other side."""

    def recv(self) -> Any:
        """Block until the other side's next message arrives; return it."""


@dataclass(frozen=True)
class BucketHandle:
    """Everything a receiver needs to open a bucket; picklable, sent once.

    Attributes:
        transport: the name of the transport that opens it
            (:mod:`hybridmem.ipc.transports`): ``"cuda"`` (CUDA IPC of classic
            segments), ``"fd"`` (expandable segments, fds passed over a Unix socket)
            or ``"host"`` (POSIX shared memory).
        nbytes: bytes per buffer.
        buffers: number of buffers (2 = double buffering).
        device_uuid: the producer's GPU, by UUID (indices differ between processes
            with different ``CUDA_VISIBLE_DEVICES``); None without CUDA.
        exports: per buffer, a CUDA IPC export (``"cuda"``), a one-time
            :class:`~hybridmem.TensorHandle` (``"fd"``) or a shared-memory name.
        producer_pid: the producer's process id (for error messages).
        events: per buffer, an interprocess CUDA event the producer records once the
            buffer is filled (``"cuda"`` and ``"fd"``): the receiver's stream waits for it on
            the device, no host round trip.
        protocol: message-protocol version.
    """

    transport: TransportName
    nbytes: int
    buffers: int
    device_uuid: str | None
    exports: tuple[Any, ...]
    producer_pid: int
    events: tuple[bytes, ...] = ()
    protocol: int = PROTOCOL


# Copy units, widest first: pieces are moved as int64 words when their sizes allow
# (offsets are 256-aligned), so that batched copies move 8 bytes per element.
UNITS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def word_unit(nbytes: int, offset: int = 0) -> tuple[int, torch.dtype]:
    """The widest copy unit that divides ``nbytes`` and a tensor's byte ``offset``.

    A view as wider words needs the tensor's start in its storage on a word
    boundary too: a bf16 view at an odd element of a flat buffer is moved as int16.
    """
    for unit in UNITS:  # a plain loop: called for every tensor of every sync
        if nbytes % unit[0] == 0 and offset % unit[0] == 0:
            return unit
    return UNITS[-1]  # pragma: no cover - bytes divide everything


def byte_offset(tensor: torch.Tensor) -> int:
    """Where ``tensor`` starts in its storage, in bytes."""
    return int(tensor.storage_offset()) * tensor.element_size()


def flat_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D view of ``dtype`` words.

    Called for every tensor of every sync on both sides, so it stays cheap:
    ``detach()`` rather than a ``no_grad`` block (the view is outside autograd either
    way, and an in-place copy into it is allowed), ``dtype.itemsize`` (torch 2.1+)
    rather than an empty tensor to ask.
    """
    flat = tensor.detach().view(-1)
    if flat.dtype == dtype:
        return flat
    if flat.element_size() < dtype.itemsize:
        flat = flat.view(torch.uint8)  # bytes first: any dtype views as bytes
    return flat.view(dtype)


@functools.lru_cache(maxsize=64)
def dtype_named(name: str) -> torch.dtype:
    """The dtype a producer named (``"torch.bfloat16"``); cached: every entry asks."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"received an unknown dtype {name!r}: producer and receiver differ?")
    return dtype


CPU = torch.device("cpu")


class PeerAborted(RuntimeError):
    """The other side sent ``abort`` (so there is no need to tell it)."""


def check_timeout(timeout: object) -> float | None:
    """Validate a ``timeout=`` argument: seconds > 0, or None to wait without bound."""
    if timeout is None:
        return None
    return check_seconds("timeout", timeout)


class Peer:
    """The process on the other end: its pid, and whether it is still alive.

    Linux: a pidfd (``os.pidfd_open``) turns readable when the process exits, a
    zombie included (a dead child the parent has not reaped yet still "exists" for
    ``kill(pid, 0)``); elsewhere ``kill(pid, 0)``.
    """

    def __init__(self, pid: int | None, what: str) -> None:
        self.what = what
        self.pid: int | None = None
        self._fd: int | None = None
        self.track(pid)

    def track(self, pid: int | None) -> None:
        if pid is None or pid == self.pid or pid == os.getpid():
            return
        self.close()
        self.pid = pid
        opener = getattr(os, "pidfd_open", None)
        if opener is not None:
            with contextlib.suppress(OSError):  # gone already, or not permitted
                self._fd = opener(pid)

    def alive(self) -> bool:
        if self.pid is None:
            return True
        if self._fd is not None:
            readable, _, _ = select.select([self._fd], [], [], 0)
            return not readable
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            return True
        return True

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = None


def recv_within(channel: Channel, timeout: float | None, peer: Peer, waiting_for: str) -> Any:
    """``channel.recv()``, but never longer than ``timeout`` and never from a dead peer.

    Args:
        channel: the channel; one with ``poll(seconds)`` is waited on in slices.
        timeout: seconds (None: as long as it takes).
        peer: the other process, checked between slices.
        waiting_for: what the message is, for the error.

    Raises:
        SyncError: the peer died, closed the channel, or said nothing for ``timeout``.
    """
    poll = getattr(channel, "poll", None)
    deadline = None if timeout is None else time.monotonic() + timeout
    if poll is not None:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise SyncError(
                    f"the {peer.what} (pid {peer.pid or '?'}) did not send {waiting_for} "
                    f"within {timeout:g} s (timeout=): it is stuck or gone"
                )
            try:
                if poll(_SLICE_S if left is None else min(left, _SLICE_S)):
                    break
            except (EOFError, OSError) as exc:
                raise SyncError(
                    f"the {peer.what}'s end of the channel is closed ({exc!r}) while this side "
                    f"waited for {waiting_for}: it exited or closed the link"
                ) from exc
            if not peer.alive():
                raise SyncError(
                    f"the {peer.what} (pid {peer.pid}) died while this side waited for "
                    f"{waiting_for}"
                )
    try:
        return channel.recv()
    except (EOFError, OSError) as exc:
        raise SyncError(
            f"the {peer.what}'s end of the channel is closed ({exc!r}) while this side waited "
            f"for {waiting_for}: it exited or closed the link"
        ) from exc


def send_to(channel: Channel, message: Any, peer: Peer, what: str, *, raw: bool = False) -> None:
    """``channel.send(message)``, turning a closed channel into a SyncError that says why.

    A peer that exited leaves its end closed: the send then fails with
    ``BrokenPipeError``/``ConnectionResetError`` (or ``EOFError``), and which of the
    two sides notices first is a race. This gives both the same error as
    :func:`recv_within`, so a caller tells "the peer is gone" by the cause
    (``exc.__cause__`` is the ``OSError``/``EOFError``) whichever side noticed.

    Args:
        channel: this side's end.
        message: any picklable object.
        peer: the other process (for the error).
        what: what the message is, for the error ("the ack of batch 3").
        raw: ``message`` is bytes, sent unpickled (``send_bytes``: a one-time token
            proven before anything is unpickled).

    Raises:
        SyncError: the channel is closed (the peer exited or closed it).
    """
    try:
        if raw:
            channel_bytes: Any = channel  # a Connection: send_bytes is not in Channel
            channel_bytes.send_bytes(message)
        else:
            channel.send(message)
    except (EOFError, OSError) as exc:
        raise SyncError(
            f"the {peer.what}'s end of the channel is closed ({exc!r}) while this side sent "
            f"{what}: it exited or closed the link"
        ) from exc
