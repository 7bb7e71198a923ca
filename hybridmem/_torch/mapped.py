"""Copies done by kernels that read pinned host memory through its device mapping.

Why: right after another process frees a lot of device
memory, host-to-device copies by the copy engines run at about half the pinned rate
for half a second and more, whichever memory they land in. An elementwise kernel
reading the same pinned memory through its device mapping keeps about 0.82 of that
rate. Measured on an H200 with torch 2.11 (``benchmarks/reload_by_kernel.py``, 3 GiB,
six runs each, the Offloader's kind of pool): copy engine 0.46 after a peer's 60 GiB
free and 0.56-0.64 during it, four streams no better; the kernel 0.82 and 0.81-0.82.

Scope: the device given; the caller keeps the host memory alive (and registered)
for as long as the view; thread-safe (no state).
"""

from __future__ import annotations

import torch

from hybridmem._platform import cuda_driver
from hybridmem._torch.device import cuda_available
from hybridmem._torch.dlpack import tensor_from_memory

__all__ = ["copy_by_kernel", "host_device_view"]

_WORD = 8  # bytes a kernel thread reads at a time where both ends are aligned


def _keep() -> None:
    """The view owns nothing: the host memory is freed by its owner."""


def host_device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA uint8 tensor over pinned, mapped host memory: kernels read it over the bus.

    Args:
        host: a contiguous CPU tensor registered with the mapped flag
            (:func:`~hybridmem._torch.tensors.pin_host_tensor` with ``mapped=True``).
        device: the CUDA device whose kernels will read it.

    Returns:
        The view (``host``'s bytes, same length), or None where there is none: no
        CUDA, memory not mapped, the driver refused. Keep ``host`` alive and
        registered while the view is used.

    Example:
        >>> view = host_device_view(pool, torch.device("cuda", 0))   # doctest: +SKIP
    """
    if not cuda_available() or host.device.type != "cpu" or device.type != "cuda":
        return None
    nbytes = host.numel() * host.element_size()
    if nbytes == 0 or not host.is_contiguous():
        return None
    address = cuda_driver.host_device_pointer(host.data_ptr())
    if address is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tensor_from_memory(address, nbytes, index, _keep)


def copy_by_kernel(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` with elementwise kernels (the SMs), not a copy engine.

    Eight-byte words where both ends are aligned, then any tail byte by byte; queued
    on the current stream, like ``copy_(non_blocking=True)``.

    Args:
        dst: a contiguous 1-D uint8 tensor.
        src: a contiguous 1-D uint8 tensor as long, on the same device (a
            :func:`host_device_view` slice, for a reload).

    Raises:
        ValueError: the two differ in length, dtype or device.

    Example:
        >>> copy_by_kernel(device_bytes, view[offset : offset + n])   # doctest: +SKIP
    """
    if (dst.numel(), dst.dtype, dst.device) != (src.numel(), src.dtype, src.device):
        raise ValueError(
            f"copy_by_kernel: dst ({dst.numel()} {dst.dtype} on {dst.device}) and src "
            f"({src.numel()} {src.dtype} on {src.device}) must match"
        )
    n = dst.numel()
    aligned = dst.data_ptr() % _WORD == 0 and src.data_ptr() % _WORD == 0
    words = n // _WORD * _WORD if aligned else 0
    if words:
        torch.bitwise_or(src[:words].view(torch.int64), 0, out=dst[:words].view(torch.int64))
    if words < n:
        torch.bitwise_or(src[words:], 0, out=dst[words:])
