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
from hybridmem.ipc.capabilities import ipc_capabilities
from hybridmem.ipc.transports.base import Buffers, Probe, Transport
from hybridmem.scopes.allocator import ExpandableSegments
from hybridmem.scopes.ipc_safe import classic_ipc_blocker, passed_over, refused

__all__ = ["CudaTransport"]


class CudaTransport(Transport):
    """Buffers in classic segments; the handle carries their CUDA IPC exports."""

    name = "cuda"
    on_device = True
    falls_back_to = "host"

    @staticmethod
    def blocker(device: int, probe: Probe = "off") -> str | None:
        # The probe runs only where nothing else says no; it notes its verdict for
        # classic_ipc_blocker, the one place that decides (ipc_safe asks it too).
        blocker = classic_ipc_blocker(device, probe_verdicts=False)
        if blocker is None and probe == "run":
            ipc_capabilities(device)
        return blocker or classic_ipc_blocker(device, probe_verdicts=probe != "off")

    @classmethod
    def refused(cls, who: str, device: int, blocker: str) -> str:
        return refused(who, device, blocker)

    @classmethod
    def passed_over(cls, who: str, device: int, blocker: str) -> str:
        return passed_over(who, device, blocker)

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
