"""The ``fd`` transport: buffers in expandable segments, their pages' fds passed over a socket.

Each read of the handle makes one-time exports of the buffers
(:func:`hybridmem.ipc_export`, one receiver each) and withdraws the unopened ones of
the read before. Needs the CUDA driver's virtual memory API and an allocator that can
switch expandable segments on (not ``cudaMallocAsync``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._platform import cuda_vmm
from hybridmem.allocator.state import ENGINE
from hybridmem.ipc.export import TensorHandle, ipc_export
from hybridmem.ipc.transports.base import Buffers, Probe, Transport
from hybridmem.scopes.allocator import ExpandableSegments

__all__ = ["FdTransport"]


class FdTransport(Transport):
    """Buffers in expandable segments; the handle carries fresh fd exports per read."""

    name = "fd"
    on_device = True
    falls_back_to = "cuda"

    def __init__(self) -> None:
        self._minted: list[TensorHandle] = []  # the exports of the last handle read

    @staticmethod
    def blocker(device: int, probe: Probe = "off") -> str | None:
        if not _torch.cuda_available():
            return "no CUDA device is visible"
        if ENGINE.backend() == "cudaMallocAsync":
            return "the allocator backend is cudaMallocAsync (its pools are not exportable)"
        if _torch.settings_setter_name() is None:
            return "this torch cannot switch expandable segments on at run time"
        if not cuda_vmm.has_vmm():
            return "the CUDA driver lacks the virtual memory API (CUDA 10.2+)"
        return None

    @classmethod
    def refused(cls, who: str, device: int, blocker: str) -> str:
        return (
            f"{who}(transport='fd'): {blocker}; use transport='cuda' (classic segments) or 'host'"
        )

    @classmethod
    def passed_over(cls, who: str, device: int, blocker: str) -> str:
        return (
            f"{who}(transport='fd') is not possible here ({blocker}); using classic-segment "
            "CUDA IPC"
        )

    def allocate(self, nbytes: int, count: int, device: int, into: Buffers) -> None:
        with ExpandableSegments(True), torch.cuda.device(device):
            for _ in range(count):
                into.views.append(
                    torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
                )
                into.events.append(_torch.new_ipc_event(device))

    def exports(self, held: Buffers) -> tuple[Any, ...]:
        self.withdraw()
        self._minted = [ipc_export(buffer, timeout=None) for buffer in held.views]
        return tuple(self._minted)

    def withdraw(self) -> None:
        for minted in self._minted:
            minted.withdraw()
        self._minted = []

    def open(
        self, exports: Sequence[Any], nbytes: int, producer_pid: int, source: int, into: Buffers
    ) -> None:
        for export in exports:  # one-time exports, opened by fd passing
            into.views.append(export.open())
