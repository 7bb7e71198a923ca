"""The ``cuda`` transport: buffers in classic segments, shared by CUDA IPC handles.

``cudaIpcGetMemHandle`` needs no ``pidfd_getfd`` in the consumer, so it works in
containers that deny it; it needs classic segments (not the ``cudaMallocAsync``
backend) and a machine where classic IPC works (the probe says).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._errors import IpcUnavailableError
from hybridmem.allocator.scopes import ExpandableSegments
from hybridmem.allocator.state import ENGINE
from hybridmem.ipc.capabilities import cached_capabilities, ipc_capabilities
from hybridmem.ipc.transports.base import Buffers, Probe, Transport

__all__ = ["CudaTransport"]


def _probed(device: int, probe: Probe) -> bool | None:
    """The IPC probe's ``classic_ipc`` (None: not asked, or no cached result)."""
    if probe == "run":
        return ipc_capabilities(device).classic_ipc
    caps = cached_capabilities(device) if probe == "cached" else None
    return None if caps is None else caps.classic_ipc


class CudaTransport(Transport):
    """Buffers in classic segments; the handle carries their CUDA IPC exports."""

    name = "cuda"
    on_device = True
    falls_back_to = "host"

    @staticmethod
    def blocker(device: int, probe: Probe = "off") -> str | None:
        if not _torch.cuda_available():
            # No GPU here (or a CPU build): "cuda" would be a promise nothing can keep (#22).
            built = _torch.cuda_built()
            return "no CUDA device is visible" if built else "this torch is built without CUDA"
        blocker = ENGINE.classic_blocker()
        # The probe runs only where nothing else says no; its verdict None means "works".
        if blocker is None and _probed(device, probe) is False:
            caps = cached_capabilities(device)
            blocker = f"the IPC probe found CUDA IPC broken here ({caps.reason if caps else '?'})"
        return blocker

    @classmethod
    def refused(cls, who: str, device: int, blocker: str) -> str:
        return (
            f"{who}: CUDA IPC cannot be used on device {device}: {blocker}. Pass "
            "fallback='host' (or 'auto') to ship tensors through host shared memory instead."
        )

    @classmethod
    def passed_over(cls, who: str, device: int, blocker: str) -> str:
        return (
            f"CUDA IPC cannot be used on device {device} ({blocker}); falling back to host "
            "shared memory, which costs a device-to-host and a host-to-device copy"
        )

    def allocate(self, nbytes: int, count: int, device: int, into: Buffers) -> None:
        # Expandable segments off (the cache released first): fresh classic segments.
        with ExpandableSegments(False), torch.cuda.device(device):
            for _ in range(count):
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
                if _torch.is_legacy_ipc_capable(buffer) is False:
                    raise IpcUnavailableError(
                        "the staging buffer did not land in a classic segment; pass fallback='host'"
                    )
                into.views.append(buffer)
                into.exports.append(_torch.export_cuda_tensor(buffer))
                into.events.append(_torch.new_ipc_event(device))

    def open(
        self, exports: Sequence[Any], nbytes: int, producer_pid: int, source: int, into: Buffers
    ) -> None:
        for rebuild, args in exports:
            try:
                into.views.append(_torch.import_cuda_tensor(rebuild, args, source))
            except RuntimeError as exc:
                raise IpcUnavailableError(
                    f"cannot open the producer's (pid {producer_pid}) CUDA buffer: {exc}. "
                    "See hm.ipc_capabilities() here; WeightBucket(fallback='host') avoids "
                    "CUDA IPC"
                ) from exc
