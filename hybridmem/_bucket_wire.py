"""What a WeightBucket and its BucketReceiver share: the handle, the channel, the wire format.

Protocol over any channel with ``send(obj)`` / ``recv()`` (a
``multiprocessing.Pipe`` end, a wrapped ZMQ socket), every message tagged with the
sync's number: ``("begin", sync)``; ``("events", sync, handles)`` once from a receiver
that hands off on the device; ``("batch", sync, seq, buffer, entries)`` once a buffer
is filled (its copy finished, or its interprocess event recorded); ``("ack", sync,
seq)`` from the receiver once it no longer reads that buffer (or queued its reads);
``("end", sync, seq, count, nbytes)``, acknowledged too; ``("abort", sync, why)`` from
either side ends the sync with an error on the other. Messages of an earlier, aborted
sync are skipped, so a failed sync does not poison the next one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Protocol, runtime_checkable

import torch

from hybridmem import _torch
from hybridmem.ipc import Transport

__all__ = [
    "CPU",
    "PROTOCOL",
    "UNITS",
    "BucketHandle",
    "Channel",
    "Entry",
    "PeerAborted",
    "attach_shm",
    "drop_host_buffers",
    "dtype_named",
    "flat_words",
    "host_buffer",
    "word_unit",
]

PROTOCOL = 1

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
        transport: ``"cuda"`` (CUDA IPC of classic segments) or ``"host"`` (POSIX
            shared memory).
        nbytes: bytes per buffer.
        buffers: number of buffers (2 = double buffering).
        device_uuid: the producer's GPU, by UUID (indices differ between processes
            with different ``CUDA_VISIBLE_DEVICES``); None without CUDA.
        exports: per buffer, a CUDA IPC export (``"cuda"``) or a shared-memory name.
        producer_pid: the producer's process id (for error messages).
        events: per buffer, an interprocess CUDA event the producer records once the
            buffer is filled (``"cuda"`` only): the receiver's stream waits for it on
            the device, no host round trip.
        protocol: message-protocol version.
    """

    transport: Transport
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


def word_unit(nbytes: int) -> tuple[int, torch.dtype]:
    """The widest copy unit that divides ``nbytes``."""
    return next(u for u in UNITS if nbytes % u[0] == 0)


def flat_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D view of ``dtype`` words."""
    with torch.no_grad():
        flat = tensor.view(-1)
        return flat if flat.dtype == dtype else flat.view(dtype)


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"received an unknown dtype {name!r}: producer and receiver differ?")
    return dtype


def attach_shm(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    # Python < 3.13 registers attached segments with this process's resource
    # tracker, which would unlink the producer's segment when we exit.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def host_buffer(shm: shared_memory.SharedMemory, nbytes: int) -> tuple[torch.Tensor, bool]:
    tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
    return tensor, _torch.pin_host_tensor(tensor)


CPU = torch.device("cpu")


class PeerAborted(RuntimeError):
    """The other side sent ``abort`` (so there is no need to tell it)."""


def drop_host_buffers(
    pinned: list[int], shms: list[shared_memory.SharedMemory], *, unlink: bool
) -> None:
    """Unpin and unmap host buffers (and unlink them: the producer owns them)."""
    for ptr in pinned:
        _torch.unpin_host_tensor(ptr)
    pinned.clear()
    for shm in shms:
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        with contextlib.suppress(BufferError):  # a tensor still maps it: freed at exit
            shm.close()
    shms.clear()
