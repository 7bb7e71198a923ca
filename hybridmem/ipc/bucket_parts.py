"""A WeightBucket's sizes, transports and report: the values its arguments take.

Split out of :mod:`hybridmem.ipc.bucket` (issue #27).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from hybridmem._format import fmt_bytes
from hybridmem.ipc._plan import align_up
from hybridmem.ipc.transports.base import Fallback, TransportName

__all__ = [
    "MAX_BUFFERS",
    "SyncReport",
    "TransportChoice",
    "auto_size",
    "check_transport",
]

MAX_BUFFERS = 8
# WeightBucket.for_tensors: half the model, within these bounds (issue #25's runs).
_AUTO_MIN, _AUTO_MAX, _AUTO_STEP = 256 << 20, 1 << 30, 64 << 20


def auto_size(total: int) -> tuple[int, int]:
    """``(bytes per buffer, buffers)`` for a model of ``total`` bytes (see ``for_tensors``)."""
    size = min(_AUTO_MAX, max(_AUTO_MIN, align_up(-(-total // 2), _AUTO_STEP)))
    return size, 3 if total >= 8 * size else 2


#: What ``WeightBucket(transport=...)`` accepts.
TransportChoice = Literal["auto", "cuda", "fd", "host"]
_CHOICES: tuple[str, ...] = get_args(TransportChoice)


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


def check_transport(transport: object, fallback: Fallback) -> str:
    if not isinstance(transport, str) or transport not in _CHOICES:
        raise ValueError(
            f"transport must be one of {', '.join(map(repr, _CHOICES))}; got {transport!r}"
        )
    if transport == "fd" and fallback == "host":
        raise ValueError(
            "transport='fd' with fallback='host' contradict each other (fallback='host' "
            "always uses host memory); pass fallback='auto' or 'raise', or transport='host'"
        )
    return transport
