"""What a WeightBucket's arguments take: its buffers' count and sizes, its transports.

:func:`auto_size` is ``WeightBucket.for_tensors``'s choice: buffers of half the model,
between 256 MiB and 1 GiB, three once the model fills eight of them.
"""

from __future__ import annotations

from typing import Literal, get_args

from hybridmem.ipc._plan import align_up
from hybridmem.ipc.transports.base import Fallback

__all__ = [
    "MAX_BUFFERS",
    "TransportChoice",
    "auto_size",
    "check_transport",
]

MAX_BUFFERS = 8
# WeightBucket.for_tensors: half the model, within these bounds (benchmarks/weight_sync.py).
_AUTO_MIN, _AUTO_MAX, _AUTO_STEP = 256 << 20, 1 << 30, 64 << 20


def auto_size(total: int) -> tuple[int, int]:
    """``(bytes per buffer, buffers)`` for a model of ``total`` bytes (see ``for_tensors``)."""
    size = min(_AUTO_MAX, max(_AUTO_MIN, align_up(-(-total // 2), _AUTO_STEP)))
    return size, 3 if total >= 8 * size else 2


#: What ``WeightBucket(transport=...)`` accepts.
TransportChoice = Literal["auto", "cuda", "fd", "host"]
_CHOICES: tuple[str, ...] = get_args(TransportChoice)


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
