"""CUDA IPC: segment kind, device identity, export and import of tensors and events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from hybridmem._platform import cuda_driver
from hybridmem._torch.device import cuda_available, device_count
from hybridmem._torch.tensors import is_device_tensor
from hybridmem._torch.version import torch_version_string

_CUDA_EVENT: Any = torch.cuda.Event


def is_legacy_ipc_capable(tensor: torch.Tensor) -> bool | None:
    """Return whether a device tensor's memory can go through ``cudaIpcGetMemHandle``.

    True for classic segments (``cudaMalloc``), False for expandable segments
    (``cuMemCreate``/``cuMemMap``, exported as a POSIX fd that the consumer must
    fetch with ``pidfd_getfd``) and for ``cudaMallocAsync`` pools. One driver call
    (``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)``,
    about 1 us), no allocator snapshot. None when the driver cannot be asked (no
    libcuda, an empty tensor, or an error).
    """
    if not is_device_tensor(tensor) or tensor.untyped_storage().nbytes() == 0:
        return None
    value = cuda_driver.pointer_attribute(
        tensor.untyped_storage().data_ptr(), cuda_driver.POINTER_IS_LEGACY_CUDA_IPC_CAPABLE
    )
    return None if value is None else bool(value)


def device_uuid(index: int) -> str | None:
    """Return the UUID of visible device ``index`` (``"GPU-..."``), as ``nvidia-smi -L`` does.

    A UUID names the same GPU in every process, whatever ``CUDA_VISIBLE_DEVICES``
    each one has. ``torch.cuda.get_device_properties(i).uuid`` exists from torch
    2.1; it initialises CUDA but creates no context on the device.
    """
    if not cuda_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def device_index_by_uuid(uuid: str) -> int | None:
    """Return the index under which this process sees the GPU ``uuid`` (None if not visible)."""
    for index in range(device_count()):
        if device_uuid(index) == uuid:
            return index
    return None


# torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments (torch 1.x to
# 2.15; tests/test_torch_seam.py checks the installed torch's signature): position 6
# is the device index the consumer opens the storage on.
_REBUILD_DEVICE_ARG = 6
_REBUILD_ARG_COUNT = 15


def export_cuda_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """Export a device tensor for another process, as ``torch.multiprocessing`` does.

    Returns ``(rebuild, args)``, picklable. torch keeps the memory alive until
    every consumer released it and ``torch.cuda.ipc_collect()`` ran.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    reduce = cast(Callable[[torch.Tensor], tuple[Any, tuple[Any, ...]]], reduce_tensor)
    rebuild, args = reduce(tensor)
    return rebuild, tuple(args)


def import_cuda_tensor(rebuild: Any, args: tuple[Any, ...], device: int) -> torch.Tensor:
    """Open a tensor exported by :func:`export_cuda_tensor` on local device ``device``.

    torch's own rebuild opens the storage under the *producer's* device index,
    which names another GPU when the two processes have different
    ``CUDA_VISIBLE_DEVICES``; the index is replaced with ``device``.
    """
    name = getattr(rebuild, "__name__", "")
    if name != "rebuild_cuda_tensor" or len(args) != _REBUILD_ARG_COUNT:
        raise ValueError(
            f"unexpected CUDA tensor export ({name}, {len(args)} arguments): the producer "
            f"and the consumer must run the same torch version (this one is "
            f"{torch_version_string()})"
        )
    fixed = list(args)
    fixed[_REBUILD_DEVICE_ARG] = device
    with torch.cuda.device(device):
        result = rebuild(*fixed)
    if not isinstance(result, torch.Tensor):  # pragma: no cover - torch always returns one
        raise TypeError(f"rebuilding a CUDA tensor returned {type(result).__name__}")
    return result


def new_event() -> Any:
    """Return a CUDA event without timing (the cheapest kind) to record and wait for.

    For the current device's streams; all torch versions (``torch.cuda.Event``).
    """
    return _CUDA_EVENT(enable_timing=False)


def new_timed_event() -> Any:
    """Return a CUDA event that can time (``enable_timing=True``), for :func:`event_seconds`.

    For the current device's streams; all torch versions (``torch.cuda.Event``).
    """
    return _CUDA_EVENT(enable_timing=True)


def event_seconds(start: Any, end: Any) -> float:
    """Seconds on the device between two timed events' last records, both completed.

    All torch versions (``torch.cuda.Event.elapsed_time``, in milliseconds).
    """
    return float(start.elapsed_time(end)) / 1e3


def new_ipc_event(device: int) -> Any:
    """Return a CUDA event another process can open (``cudaEventInterprocess``).

    Interprocess events cannot time (torch disables timing for them).
    """
    with torch.cuda.device(device):
        return _CUDA_EVENT(interprocess=True)


def ipc_event_handle(event: Any) -> bytes:
    """Return the handle another process opens with :func:`open_ipc_event`."""
    return bytes(event.ipc_handle())


def open_ipc_event(device: int, handle: bytes) -> Any:
    """Open an interprocess event of another process on local device ``device``."""
    return _CUDA_EVENT.from_ipc_handle(device, handle)


def record_event(event: Any, stream: Any) -> None:
    """Record ``event`` on ``stream`` (the last record is what waiters wait for)."""
    event.record(stream)


def wait_event(stream: Any, event: Any) -> None:
    """Make ``stream``'s later work wait for ``event``'s last record (on the device)."""
    stream.wait_event(event)


def synchronize_event(event: Any) -> None:
    """Block the host until ``event``'s last record has completed."""
    event.synchronize()


def query_event(event: Any) -> bool:
    """Whether ``event``'s last record has completed, without waiting (all torch versions)."""
    return bool(event.query())
