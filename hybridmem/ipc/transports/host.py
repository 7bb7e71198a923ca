"""The ``host`` transport: POSIX shared memory, pinned where CUDA allows.

Works everywhere (no GPU, CUDA IPC broken, a receiver on another device); each byte
then crosses the host twice. Hand-offs wait on the host.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._platform.stdlib import attach_shared_memory
from hybridmem.ipc.transports.base import Buffers, Probe, Transport

__all__ = ["HostTransport", "host_buffer"]


def host_buffer(shm: shared_memory.SharedMemory, nbytes: int) -> tuple[torch.Tensor, bool]:
    """A segment as a flat uint8 tensor, and whether pinning it worked."""
    tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
    return tensor, _torch.pin_host_tensor(tensor)


def _hold(shm: shared_memory.SharedMemory, nbytes: int, into: Buffers) -> None:
    into.shms.append(shm)
    tensor, pinned = host_buffer(shm, nbytes)
    if pinned:
        into.pinned.append(tensor.data_ptr())
    into.views.append(tensor)


class HostTransport(Transport):
    """Buffers in host shared memory, named in the handle."""

    name = "host"
    on_device = False

    @staticmethod
    def blocker(device: int, probe: Probe = "off") -> str | None:
        return None  # shared memory is always there

    def allocate(self, nbytes: int, count: int, device: int, into: Buffers) -> None:
        for _ in range(count):
            shm = shared_memory.SharedMemory(create=True, size=nbytes)
            _hold(shm, nbytes, into)
            into.exports.append(shm.name)

    def open(
        self, exports: Sequence[Any], nbytes: int, producer_pid: int, source: int, into: Buffers
    ) -> None:
        for name in exports:
            _hold(
                attach_shared_memory(str(name), own_process=producer_pid == os.getpid()),
                nbytes,
                into,
            )
