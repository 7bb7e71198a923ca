"""CUDA state, read without ever creating a context."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

_CUDA_BUILT = torch.version.cuda is not None and hasattr(torch._C, "_cuda_getDeviceCount")
# torch ships these two without annotations; typed aliases keep mypy --strict honest.
_IS_INITIALIZED = cast(Callable[[], bool], torch.cuda.is_initialized)


def cuda_built() -> bool:
    """Return whether this torch build has CUDA support compiled in."""
    return _CUDA_BUILT


def cuda_version() -> str | None:
    """Return the CUDA version torch was built with, e.g. ``"13.0"``."""
    return torch.version.cuda


def cuda_available() -> bool:
    """Return ``torch.cuda.is_available()`` (queries the driver, no context)."""
    return cuda_built() and torch.cuda.is_available()


def device_count() -> int:
    """Return the number of visible CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if cuda_built() else 0


def cuda_initialized() -> bool:
    """Return whether torch has initialised CUDA in this process."""
    return _CUDA_BUILT and _IS_INITIALIZED()


def current_device() -> int | None:
    """Return the current CUDA device index, or None when CUDA is not initialised."""
    if not cuda_initialized():
        return None
    return int(torch.cuda.current_device())


def has_context(index: int) -> bool:
    """Return whether device ``index`` has a primary CUDA context in this process.

    Uses ``torch._C._cuda_hasPrimaryContext`` (torch 1.x+), which asks the
    driver without creating one. Without it only the current device counts.
    """
    if not cuda_initialized():
        return False
    fn = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if callable(fn):
        return bool(fn(index))
    return index == current_device()


def initialized_devices() -> list[int]:
    """Return the indices of devices with a CUDA context in this process."""
    if not cuda_initialized():
        return []
    return [i for i in range(device_count()) if has_context(i)]


def synchronize(index: int) -> None:
    """Wait for all work on device ``index`` (which must have a context)."""
    torch.cuda.synchronize(index)


def empty_cache() -> None:
    """Return cached free blocks to the driver (torch empties every device's cache)."""
    if cuda_initialized():
        torch.cuda.empty_cache()


def clear_blas_workspaces() -> bool:
    """Free the cuBLAS workspaces torch keeps per handle and stream; False if impossible.

    torch allocates a workspace (32 MiB on Hopper: ``CUBLAS_WORKSPACE_CONFIG``'s
    default ``:4096:8``) through its caching allocator at the first matmul on a
    stream and keeps it for the process's life. A workspace allocated while a large
    segment had room lands inside it and keeps the whole segment from being
    released: on the H200 bench, one 32 MiB workspace pinned an 852 MiB classic
    segment (820 MiB of cache that ``empty_cache`` could not return). The next
    matmul allocates a new one. ``torch._C._cuda_clearCublasWorkspaces`` (torch
    1.13+, private; what CUDA-graph capture uses). Call it only when no kernel that
    uses a workspace is queued (after a synchronise) and no other thread runs
    matmuls.
    """
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if not cuda_initialized() or not callable(fn):
        return False
    fn()
    return True


def ipc_collect() -> None:
    """Release memory held for tensors shared over CUDA IPC that consumers dropped."""
    if cuda_initialized():
        cast(Callable[[], None], torch.cuda.ipc_collect)()


#: The per-pool halves of every counter, which nothing in hybridmem reads.
_POOLS = frozenset({"small_pool", "large_pool"})


def _stat_key(key: object) -> str:
    # As torch.cuda.memory_stats names keys (a tuple key's parts joined by "_").
    return "_".join(str(part) for part in key) if isinstance(key, tuple) else str(key)


def _flatten(prefix: str, nested: dict[Any, Any], flat: dict[str, Any]) -> None:
    for key, value in nested.items():
        name = _stat_key(key)
        if name in _POOLS:
            continue
        if isinstance(value, dict):
            _flatten(f"{prefix}{name}.", value, flat)
        else:
            flat[prefix + name] = value


def memory_stats(index: int) -> dict[str, Any]:
    """Return the caching allocator's statistics for device ``index``, all pools together.

    Keyed as ``torch.cuda.memory_stats`` keys them (``"allocated_bytes.all.current"``,
    ``"num_alloc_retries"``), without the ``small_pool``/``large_pool`` split. Read from
    ``torch.cuda.memory_stats_as_nested_dict`` (public in every torch this supports):
    ``memory_stats`` flattens and sorts every counter of every pool in Python, and a
    switch reads memory at each of its stages' boundaries. Empty without
    a CUDA context.

    Example:
        >>> memory_stats(0).get("allocated_bytes.all.current", 0) >= 0
        True
    """
    if not cuda_initialized():
        return {}
    nested = getattr(torch.cuda.memory, "memory_stats_as_nested_dict", None)
    if nested is None:  # not seen in torch 2.4-2.15; the flat reading says the same
        return dict(torch.cuda.memory_stats(index))
    flat: dict[str, Any] = {}
    _flatten("", nested(index), flat)
    return flat


def mem_get_info(index: int) -> tuple[int, int]:
    """Return device-wide ``(free, total)`` bytes for a device that has a context."""
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)
