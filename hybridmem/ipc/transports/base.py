"""What every transport is: its interface, the buffers it holds, and the values it takes.

A transport owns, for one bucket: what blocks it on this machine
(:meth:`Transport.blocker`), the producer's allocation and export
(:meth:`Transport.allocate`, :meth:`Transport.exports`), the consumer's open
(:meth:`Transport.open`), and the teardown of what either side holds
(:meth:`Buffers.release`). Bucket and receiver ask it; nothing compares its name.

Scope: a transport object belongs to one bucket or receiver (not thread-safe).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any, ClassVar, Literal

import torch

from hybridmem import _torch
from hybridmem._platform.stdlib import unlink_shared_memory
from hybridmem.scopes.ipc_safe import Fallback, check_fallback

__all__ = [
    "Buffers",
    "Fallback",
    "Probe",
    "Transport",
    "TransportName",
    "check_fallback",
    "drop_host_buffers",
]

#: The transports' names: what a ``BucketHandle`` carries to the receiver.
TransportName = Literal["cuda", "fd", "host"]
#: How CUDA IPC's health is judged: run the IPC probe (once per process and device),
#: read its cached result only, or not at all.
Probe = Literal["run", "cached", "off"]


def drop_host_buffers(
    pinned: list[int], shms: list[shared_memory.SharedMemory], *, unlink: bool
) -> None:
    """Unpin and unmap host buffers (and unlink them: the producer owns them)."""
    for ptr in pinned:
        _torch.unpin_host_tensor(ptr)
    pinned.clear()
    for shm in shms:
        if unlink:
            unlink_shared_memory(shm)
        with contextlib.suppress(BufferError):  # a tensor still maps it: freed at exit
            shm.close()
    shms.clear()


@dataclass
class Buffers:
    """One side's buffers of a bucket, and what must be let go with them.

    Attributes:
        views: the buffers, as flat uint8 tensors (device or host memory).
        exports: the producer's exports, one per buffer, as allocated.
        events: the producer's interprocess events, recorded after each fill
            (device transports only).
        shms: host shared-memory segments held.
        pinned: host addresses registered with CUDA (unpinned on release).
    """

    views: list[torch.Tensor] = field(default_factory=list)
    exports: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    shms: list[shared_memory.SharedMemory] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)

    def release(self, *, unlink: bool) -> None:
        """Drop the views; unpin and unmap host buffers, unlinking them if ``unlink``.

        Idempotent; the producer unlinks (it owns the names), a receiver does not.
        """
        self.views.clear()
        drop_host_buffers(self.pinned, self.shms, unlink=unlink)


class Transport(ABC):
    """One way of sharing a bucket's buffers between two processes.

    Example:
        >>> transport = transport_named("host")   # doctest: +SKIP
        >>> held = Buffers()                      # doctest: +SKIP
        >>> transport.allocate(1 << 20, 2, 0, held)  # doctest: +SKIP
        >>> handle_exports = transport.exports(held)  # doctest: +SKIP
    """

    #: What the handle carries to the receiver.
    name: ClassVar[TransportName]
    #: Buffers in device memory, handed off on the device by interprocess events;
    #: False: host memory, handed off by waiting on the host.
    on_device: ClassVar[bool]
    #: The transport taken where this one is blocked and ``fallback`` allows it
    #: (None: this one is never blocked).
    falls_back_to: ClassVar[TransportName | None] = None

    @staticmethod
    @abstractmethod
    def blocker(device: int, probe: Probe = "off") -> str | None:
        """Why this transport cannot be used for ``device`` here (None: it can).

        ``probe`` says whether a transport that the IPC probe judges may run it
        (``"run"``), read its cached result (``"cached"``) or not ask (``"off"``).
        """

    @classmethod
    def refused(cls, who: str, device: int, blocker: str) -> str:
        """The error's text where this transport is blocked and ``fallback="raise"``."""
        return f"{who}: the {cls.name!r} transport cannot be used on device {device}: {blocker}"

    @classmethod
    def passed_over(cls, who: str, device: int, blocker: str) -> str:
        """The warning's text where this transport is blocked and the next one is taken."""
        return (
            f"{who}: the {cls.name!r} transport cannot be used on device {device} "
            f"({blocker}); using {cls.falls_back_to!r}"
        )

    @abstractmethod
    def allocate(self, nbytes: int, count: int, device: int, into: Buffers) -> None:
        """Allocate and export ``count`` buffers of ``nbytes`` into ``into`` (producer).

        What is made is appended as it is made, so a failure midway leaves it all in
        ``into`` for :meth:`Buffers.release`.
        """

    def exports(self, held: Buffers) -> tuple[Any, ...]:
        """What the handle carries, read each time the producer's handle is read."""
        return tuple(held.exports)

    def withdraw(self) -> None:
        """Withdraw the exports of the last :meth:`exports` not yet opened (if any)."""
        return  # only a transport that mints exports per read has any

    @abstractmethod
    def open(
        self, exports: Sequence[Any], nbytes: int, producer_pid: int, source: int, into: Buffers
    ) -> None:
        """Open the producer's buffers into ``into`` (consumer); ``source``: its GPU here."""
