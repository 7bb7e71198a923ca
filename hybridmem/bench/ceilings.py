"""The copy rates a bench run's switches are judged against, measured in its own process.

Two rates over the host link, each into device memory this process already holds, so
that neither pays an allocation or a free:

- :func:`pinned_ceiling`: device to pinned host memory by a copy engine, the offload's
  rate and the ceiling every strategy's switch is judged by, both ways;
- :func:`kernel_ceiling`: pinned host memory to the device by elementwise kernels that
  read it through its device mapping, the way hybridmem reloads after the engine's
  sleep. Right after another process frees much device memory the copy engines run
  at about half the pinned rate for a while, and kernels keep their own rate before
  and after such a free (0.80-0.82 of the pinned rate on an H200,
  ``benchmarks/reload_rate.py``, ``benchmarks/reload_by_kernel.py``; 0.54-0.62 on an
  H100 host, which is why it is measured and not assumed), so no reload that starts
  after the engine's sleep can beat its bytes at this rate: the switch to the trainer
  is shown against it beside its target's figure.

Scope: the current CUDA device, this process; each call allocates and frees its own
buffers (at most 2 GiB on the device and as much pinned host memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable

GiB = 2**30

#: A rate, not a size: up to this many bytes measure it (the copies are at speed long
#: before), and a 64 GiB state's 32 GiB of moments would pin as much host memory.
RATE_BYTES_MAX = 2 * GiB
_RATE_BYTES_MIN = 1 << 20
_ROUNDS = 3


def rate_bytes(nbytes: int) -> int:
    """The bytes a rate is measured over for a copy of ``nbytes``: clamped, whole words.

    Example:
        >>> rate_bytes(8 * GiB) == RATE_BYTES_MAX, rate_bytes(10)
        (True, 1048576)
    """
    return min(max(int(nbytes), _RATE_BYTES_MIN), RATE_BYTES_MAX) // 8 * 8


def _rate(nbytes: int, copy: Callable[[], object], wait: Callable[[], object]) -> float:
    """GB/s of ``copy`` (``nbytes`` each time): once untimed, then ``_ROUNDS`` timed."""
    copy()  # the first copy's launch and any lazy set-up are not the rate
    wait()
    started = time.perf_counter()
    for _ in range(_ROUNDS):
        copy()
    wait()
    return _ROUNDS * nbytes / (time.perf_counter() - started) / 1e9


def pinned_ceiling(nbytes: int) -> float:
    """Device-to-host GB/s into pinned memory for ``nbytes`` (the offload ceiling).

    Example:
        >>> gbps = pinned_ceiling(8 * GiB)   # doctest: +SKIP
    """
    import torch

    nbytes = rate_bytes(nbytes)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return _rate(nbytes, lambda: host.copy_(device, non_blocking=True), torch.cuda.synchronize)


def kernel_ceiling(nbytes: int) -> float | None:
    """Host-to-device GB/s of a copy by kernels reading mapped pinned memory.

    Args:
        nbytes: the bytes the switch reloads (the rate is measured over
            :func:`rate_bytes` of them).

    Returns:
        The rate, or None where pinned memory cannot be mapped for kernels here
        (no CUDA context, registration or the device mapping refused): then the
        switch has no such figure, and the verdicts leave it out rather than guess.

    Example:
        >>> gbps = kernel_ceiling(8 * GiB)   # doctest: +SKIP
    """
    import torch

    from hybridmem import _torch
    from hybridmem._platform.host_memory import huge_page_region

    index = _torch.current_device()
    if index is None:  # no CUDA context in this process: no device to map for
        return None
    nbytes = rate_bytes(nbytes)
    region = huge_page_region(nbytes)  # host memory made as the Offloader's pool is
    host = (
        torch.frombuffer(region, dtype=torch.uint8)
        if region is not None
        else torch.empty(nbytes, dtype=torch.uint8)
    )
    if not _torch.pin_host_tensor(host, mapped=True):
        return None
    try:
        view = _torch.host_device_view(host, torch.device("cuda", index))
        if view is None:
            return None
        device = torch.empty(nbytes, dtype=torch.uint8, device=view.device)
        return _rate(
            nbytes, lambda: _torch.copy_by_kernel(device, view), lambda: _torch.synchronize(index)
        )
    finally:
        _torch.synchronize(index)  # no kernel may read the memory once unregistered
        _torch.unpin_host_tensor(host.data_ptr())
