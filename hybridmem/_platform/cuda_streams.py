"""Single CUDA streams made with the driver, outside torch's stream pool.

``torch.cuda.Stream()`` draws from a per-device pool that torch fills on first use
with 32 streams for each priority level it supports; on an H200 that first call
grew the context by 70 MiB of device memory that nothing gives back
(``benchmarks/stack_reservation.py``). hybridmem needs one side stream per
Offloader, bucket and receiver, so it makes exactly those with ``cuStreamCreate``
(public driver API) in the device's primary context, the one torch uses, and wraps
them in ``torch.cuda.ExternalStream`` (in :mod:`hybridmem._torch`, which keeps them
for reuse rather than destroying them).

Stdlib only (ctypes). Scope: process-global; thread-safe (the driver is).
"""

from __future__ import annotations

import ctypes

from hybridmem._platform.cuda_driver import DriverError, check, function
from hybridmem._platform.cuda_vmm import on_device

__all__ = ["STREAM_NON_BLOCKING", "create_stream"]

#: ``CU_STREAM_NON_BLOCKING`` (cuda.h): no implicit ordering with the legacy default
#: stream, as torch makes its pool streams.
STREAM_NON_BLOCKING = 0x1


def create_stream(device: int) -> int | None:
    """Create one non-blocking stream in ``device``'s primary context; return its handle.

    Args:
        device: the CUDA device index (as this process numbers its devices).

    Returns:
        The ``CUstream`` as an int (the same value as a runtime ``cudaStream_t``),
        or None where the driver lacks the calls or refuses (the caller then uses
        torch's pool).

    Example:
        >>> handle = create_stream(0)   # doctest: +SKIP
    """
    stream = ctypes.c_void_p(0)
    flags = ctypes.c_uint(STREAM_NON_BLOCKING)
    try:
        with on_device(device):
            check("cuStreamCreate", function("cuStreamCreate")(ctypes.byref(stream), flags))
    except (KeyError, DriverError):
        return None
    return int(stream.value or 0) or None
