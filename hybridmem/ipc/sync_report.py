"""What one weight sync did: tensors, bytes, batches, time and transport."""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem._format import fmt_bytes
from hybridmem.ipc.transports.base import TransportName

__all__ = ["SyncReport"]


@dataclass(frozen=True)
class SyncReport:
    """What one :meth:`WeightBucket.send` did."""

    tensors: int
    nbytes: int
    batches: int
    seconds: float
    transport: TransportName

    @property
    def gbps(self) -> float:
        """Tensor bytes per second, in GB/s (1e9)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"synced {self.tensors} tensors ({fmt_bytes(self.nbytes)}) in {self.batches} "
            f"batches over {self.transport} in {self.seconds * 1e3:.1f} ms ({self.gbps:.1f} GB/s)"
        )
