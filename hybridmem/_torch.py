"""The one seam between hybridmem and torch.

Every private or version-dependent torch call lives here, guarded, with the torch
version it applies to. Other modules call these functions through the module
(``_torch.empty_cache()``), so CPU tests can monkeypatch them; real behaviour is
checked by the GPU tests.

Nothing here initialises CUDA: functions that need a CUDA context say so and are
only called by hybridmem once :func:`cuda_initialized` is true.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

from hybridmem._errors import AllocatorSettingsError

__all__ = [
    "api_report",
    "copy_many",
    "cuda_available",
    "cuda_built",
    "cuda_initialized",
    "cuda_version",
    "current_device",
    "current_stream",
    "dense_parts",
    "device_count",
    "device_index_by_uuid",
    "device_uuid",
    "dist_all_gather_object",
    "dist_barrier",
    "dist_initialized",
    "dist_rank",
    "empty_cache",
    "export_cuda_tensor",
    "has_context",
    "import_cuda_tensor",
    "initialized_devices",
    "ipc_collect",
    "ipc_event_handle",
    "is_device_tensor",
    "is_legacy_ipc_capable",
    "last_allocator_settings",
    "local_tensor",
    "mem_get_info",
    "memory_stats",
    "new_ipc_event",
    "new_stream",
    "open_ipc_event",
    "pin_host_tensor",
    "process_rank",
    "record_event",
    "resize_storage",
    "runtime_allocator_backend",
    "set_allocator_settings",
    "settings_setter_name",
    "snapshot",
    "snapshot_allocator_settings",
    "storage_key",
    "storage_of",
    "storage_resizable",
    "stream_scope",
    "synchronize",
    "synchronize_event",
    "synchronize_stream",
    "torch_version",
    "torch_version_string",
    "unpin_host_tensor",
    "wait_event",
    "wait_stream",
]


def _parse_version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:  # pragma: no cover - torch always has a numeric version
        return (0, 0)
    return (int(match.group(1)), int(match.group(2)))


_TORCH_VERSION = _parse_version(torch.__version__)


def torch_version() -> tuple[int, int]:
    """Return torch's ``(major, minor)`` version, e.g. ``(2, 11)``."""
    return _TORCH_VERSION


def torch_version_string() -> str:
    """Return ``torch.__version__`` as a plain string, e.g. ``"2.11.0+cu130"``."""
    return str(torch.__version__)


# --------------------------------------------------------------------------- #
# Allocator settings
# --------------------------------------------------------------------------- #

# torch 2.10+ moved the setter to the accelerator-generic binding; the old
# ``torch.cuda.memory._set_allocator_settings`` still exists there but emits a
# FutureWarning. torch <= 2.9 only has the old one.
_NEW_SETTER = "_accelerator_setAllocatorSettings"
# torch 2.12+ only: returns the *last string set* (env or setter), not the
# effective configuration.
_GETTER = "_accelerator_getAllocatorSettings"


# Called on every real toggle: no typing constructs at run time (a ``cast`` to a
# subscripted Callable builds a new alias object on each call).
_SetterFn = Callable[[str], None]


def _new_setter() -> _SetterFn | None:
    fn: Any = getattr(torch._C, _NEW_SETTER, None)
    return fn if callable(fn) else None


def _old_setter() -> Callable[[str], None] | None:
    # torch 2.1 - 2.9: a Python wrapper over ``torch._C._cuda_cudaCachingAllocator_
    # set_allocator_settings``, which CPU-only builds of those versions lack.
    fn = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if not callable(fn):
        return None
    if _TORCH_VERSION < (2, 10) and not hasattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings"
    ):
        return None
    return cast(Callable[[str], None], fn)


def settings_setter_name() -> str | None:
    """Return the dotted name of the allocator-settings setter torch offers, or None."""
    if _new_setter() is not None:
        return "torch._C." + _NEW_SETTER
    if _old_setter() is not None:
        return "torch.cuda.memory._set_allocator_settings"
    return None


def set_allocator_settings(settings: str) -> bool:
    """Apply an allocator settings string through torch's setter.

    Works before CUDA is initialised (torch parses the string into its config
    singleton; the allocator reads it when it creates segments).

    Args:
        settings: a ``key:value,...`` string in torch's grammar.

    Returns:
        True if a setter existed and accepted the string, False if this torch
        build has no setter.

    Raises:
        AllocatorSettingsError: torch rejected the string (``ValueError`` on
            torch 2.10+, ``RuntimeError`` before; both are mapped here).
    """
    new = _new_setter()
    try:
        if new is not None:
            new(settings)
            return True
        old = _old_setter()
        if old is None:
            return False
        # On 2.10+ this path is never taken (the new setter exists); the filter
        # only guards odd builds so that torch's FutureWarning never reaches users.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            old(settings)
        return True
    except _REFUSALS as exc:
        raise AllocatorSettingsError(
            f"torch rejected the allocator settings {settings!r}: {_reason(exc)}"
        ) from exc


# What torch's parser raises: ValueError (TORCH_CHECK_VALUE, 2.10+), RuntimeError
# (TORCH_CHECK and INTERNAL ASSERT; all errors before 2.10), IndexError (a C++
# std::out_of_range, e.g. stoull on "99999999999999999999").
_REFUSALS = (ValueError, RuntimeError, IndexError)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def last_allocator_settings() -> str | None:
    """Return the last settings string torch parsed (torch 2.12+), else None.

    This is the env string at start-up or the last string given to the setter,
    not the effective configuration; hybridmem uses it to notice settings changed
    behind its back. Its first call makes torch parse its env variable.

    Raises:
        AllocatorSettingsError: torch refused the env string on that first parse.
    """
    if _GETTER_FN is None:
        return None
    try:
        value = _GETTER_FN()
    except _REFUSALS as exc:  # its first call parses the env, which may be malformed
        raise AllocatorSettingsError(
            f"torch refuses the allocator settings in its env: {_reason(exc)}"
        ) from exc
    return value if isinstance(value, str) else None


# Bound once: it is called on every scope entry and exit (hot path).
_GETTER_FN: Callable[[], object] | None = getattr(torch._C, _GETTER, None)
if not callable(_GETTER_FN):
    _GETTER_FN = None


def snapshot() -> dict[str, Any] | None:
    """Return ``torch.cuda.memory._snapshot()`` when CUDA is initialised, else None.

    Costly (walks every segment): for diagnostics and tests, never a hot path.
    """
    if not cuda_initialized():
        return None
    fn = getattr(torch.cuda.memory, "_snapshot", None)
    if not callable(fn):
        return None
    result = fn()
    return result if isinstance(result, dict) else None


def snapshot_allocator_settings() -> dict[str, Any] | None:
    """Return the effective allocator settings torch reports in a snapshot.

    Available on torch builds whose snapshot carries ``allocator_settings``
    (2.5+), once CUDA is initialised; None otherwise.
    """
    snap = snapshot()
    if snap is None:
        return None
    settings = snap.get("allocator_settings")
    return dict(settings) if isinstance(settings, dict) else None


def runtime_allocator_backend() -> str | None:
    """Return the CUDA allocator backend torch is running (``native`` / ``cudaMallocAsync``).

    None on CPU-only builds. Does not create a CUDA context.
    """
    if not cuda_built():
        return None
    fn = getattr(torch._C, "_cuda_getAllocatorBackend", None)
    if not callable(fn):
        return None
    try:
        value = fn()
    except RuntimeError:
        return None
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------- #
# CUDA state (never creates a context)
# --------------------------------------------------------------------------- #


_CUDA_BUILT = torch.version.cuda is not None and hasattr(torch._C, "_cuda_getDeviceCount")
# torch ships these two without annotations; typed aliases keep mypy --strict honest.
_IS_INITIALIZED = cast(Callable[[], bool], torch.cuda.is_initialized)
_CUDART: Callable[[], Any] = torch.cuda.cudart
_CUDA_STREAM = cast(Callable[..., Any], torch.cuda.Stream)
_CUDA_EVENT: Any = torch.cuda.Event


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


def ipc_collect() -> None:
    """Release memory held for tensors shared over CUDA IPC that consumers dropped."""
    if cuda_initialized():
        cast(Callable[[], None], torch.cuda.ipc_collect)()


def memory_stats(index: int) -> dict[str, Any]:
    """Return the caching allocator's statistics for device ``index``."""
    if not cuda_initialized():
        return {}
    return dict(torch.cuda.memory_stats(index))


def mem_get_info(index: int) -> tuple[int, int]:
    """Return device-wide ``(free, total)`` bytes for a device that has a context."""
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


# --------------------------------------------------------------------------- #
# Offload: streams, pinned host memory, sharded tensors
# --------------------------------------------------------------------------- #


def is_device_tensor(tensor: torch.Tensor) -> bool:
    """Return whether ``tensor`` lives in CUDA device memory (what offload moves)."""
    return bool(tensor.is_cuda)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return the local shard of a DTensor (FSDP2, tensor parallel), else ``tensor``.

    ``DTensor.to_local()`` (torch 2.4+, public) shares the shard's storage, which is
    what offload frees and restores.
    """
    to_local = getattr(tensor, "to_local", None)
    if to_local is None or not callable(to_local):
        return tensor
    with torch.no_grad():
        local = to_local()
    return local if isinstance(local, torch.Tensor) else tensor


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage:
    """Return ``tensor``'s untyped storage (what offload frees and restores).

    Raises:
        TypeError: the tensor has no storage of its own (a tensor subclass or a
            layout without one); the message names its type and layout.
    """
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError) as exc:
        raise TypeError(
            f"a {type(tensor).__name__} with layout {tensor.layout} has no storage that "
            f"can be freed in place ({_reason(exc)})"
        ) from None


def storage_key(storage: torch.UntypedStorage) -> int:
    """An id of the C++ storage behind ``storage`` (two Python objects may share one).

    ``UntypedStorage._cdata`` (torch 1.x - 2.13): the address of the StorageImpl,
    what torch itself compares for storage identity.
    """
    return int(storage._cdata)


def storage_resizable(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` can be freed and reallocated in place (``resize_``).

    False for memory this process does not own: imported through CUDA IPC or
    DLPack, or wrapping an external buffer (``torch.frombuffer``).
    """
    return bool(storage.resizable())


def resize_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Free (``nbytes=0``) or reallocate a storage in place, keeping every view of it.

    Raises:
        torch.OutOfMemoryError: the reallocation did not fit.
    """
    storage.resize_(nbytes)


def dense_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors that hold a tensor's data: itself, or a sparse one's pieces.

    COO: indices and values (``_indices()``/``_values()``, torch 1.x - 2.13: the
    public ``indices()`` refuses an uncoalesced tensor); CSR/CSC/BSR/BSC: their
    compressed indices and values. Each piece shares its storage with the sparse
    tensor, so freeing and restoring the piece's storage in place restores it.

    Raises:
        TypeError: a layout whose data is not in such pieces (the message names it).
    """
    layout = tensor.layout
    if layout == torch.strided:
        return [tensor]
    if layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    raise TypeError(f"tensors with layout {layout} cannot be offloaded in place")


def new_stream(device: torch.device) -> Any:
    """Return a new CUDA stream on ``device`` (None for non-CUDA devices)."""
    return _CUDA_STREAM(device=device) if device.type == "cuda" else None


def current_stream(device: torch.device) -> Any:
    """Return the current stream of ``device`` (None for non-CUDA devices)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def stream_scope(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Make ``stream`` current inside the block (a no-op for None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait_stream(waiter: Any, waitee: Any) -> None:
    """Order ``waiter``'s later work after ``waitee``'s work queued so far."""
    if waiter is not None and waitee is not None:
        waiter.wait_stream(waitee)


def synchronize_stream(stream: Any) -> None:
    """Block the host until ``stream``'s queued work is done."""
    if stream is not None:
        stream.synchronize()


def pin_host_tensor(tensor: torch.Tensor) -> bool:
    """Page-lock a CPU tensor's memory in place with ``cudaHostRegister``.

    Unlike ``pin_memory=True`` (torch's caching host allocator rounds every
    allocation up to a power of two: 24 GiB would pin 32 GiB), registering an
    exact-size allocation pins exactly what is asked. Returns False when CUDA is
    absent or registration failed (the tensor stays pageable).
    """
    if not cuda_available():
        return False
    cudart = _CUDART()
    # flag 1 = cudaHostRegisterPortable: pinned for every CUDA context in the process
    status = int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 1))
    return status == 0


def unpin_host_tensor(data_ptr: int) -> None:
    """Undo :func:`pin_host_tensor` (errors ignored: the process may be exiting)."""
    with contextlib.suppress(Exception):  # CUDA may already be torn down at exit
        _CUDART().cudaHostUnregister(data_ptr)


# --------------------------------------------------------------------------- #
# CUDA IPC: segment kind, device identity, export and import
# --------------------------------------------------------------------------- #

# CUpointer_attribute values (cuda.h, CUDA 10.1+ for both).
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10


@functools.lru_cache(maxsize=1)
def _libcuda() -> Any:
    """Return the CUDA driver library torch already loaded, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, "cuPointerGetAttribute", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    return lib


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
    lib = _libcuda()
    if lib is None:
        return None
    value = ctypes.c_int(0)
    status = lib.cuPointerGetAttribute(
        ctypes.byref(value),
        _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        tensor.untyped_storage().data_ptr(),
    )
    if status != 0:
        return None
    return bool(value.value)


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
# 2.13): position 6 is the device index the consumer opens the storage on.
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


# Pieces at least this big are copied one by one (a contiguous same-dtype
# ``copy_`` is a cudaMemcpyAsync at full bandwidth); smaller ones are batched into
# multi-tensor kernels, where one launch per piece would cost more than the copy.
FOREACH_MAX_BYTES = 1 << 20


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy ``srcs[i]`` into ``dsts[i]`` (flat, same dtype) for every i, quickly.

    Large pieces go through ``copy_`` (a memcpy each); small same-device pieces of
    one dtype are batched with ``torch._foreach_copy_`` (torch 2.1+). Copies are
    asynchronous on the current stream.
    """
    small: dict[tuple[torch.dtype, torch.device], tuple[list[Any], list[Any]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.nbytes >= FOREACH_MAX_BYTES or dst.device != src.device:
            dst.copy_(src, non_blocking=True)
        else:
            group = small.setdefault((dst.dtype, dst.device), ([], []))
            group[0].append(dst)
            group[1].append(src)
    foreach = getattr(torch, "_foreach_copy_", None)
    for group_dsts, group_srcs in small.values():
        if foreach is not None and len(group_dsts) > 1:
            foreach(group_dsts, group_srcs)
        else:
            for dst, src in zip(group_dsts, group_srcs, strict=True):
                dst.copy_(src, non_blocking=True)


# --------------------------------------------------------------------------- #
# torch.distributed (many ranks)
# --------------------------------------------------------------------------- #


def dist_initialized() -> bool:
    """Return whether a ``torch.distributed`` default process group exists."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def dist_rank() -> int | None:
    """Return this process's global rank, or None outside a process group."""
    if not dist_initialized():
        return None
    import torch.distributed as dist

    return int(dist.get_rank())


def process_rank() -> int:
    """This process's rank: ``torch.distributed``'s, else the ``RANK`` env variable, else 0."""
    rank = dist_rank()
    if rank is not None:
        return rank
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def dist_barrier() -> None:
    """Barrier on the default process group (NCCL: on the current device, never device 0)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl" and cuda_initialized():
        dist.barrier(device_ids=[int(torch.cuda.current_device())])
    else:
        dist.barrier()


def dist_all_gather_object(obj: object, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``torch.distributed.all_gather_object``).

    A collective: every rank of ``group`` (None: the default group) must call it.
    With NCCL the objects travel through the current device, never device 0 by
    assumption. It waits as long as the process group's timeout (set with
    ``init_process_group(timeout=...)``), then raises.
    """
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def api_report() -> dict[str, bool]:
    """Return which version-dependent torch APIs this build offers (for ``doctor``)."""
    return {
        "torch._C._accelerator_setAllocatorSettings": _new_setter() is not None,
        "torch.cuda.memory._set_allocator_settings": callable(
            getattr(torch.cuda.memory, "_set_allocator_settings", None)
        ),
        "torch._C._accelerator_getAllocatorSettings": callable(getattr(torch._C, _GETTER, None)),
        "torch.cuda.memory._snapshot": callable(getattr(torch.cuda.memory, "_snapshot", None)),
        "torch._C._cuda_hasPrimaryContext": callable(
            getattr(torch._C, "_cuda_hasPrimaryContext", None)
        ),
        "torch._C._cuda_getAllocatorBackend": callable(
            getattr(torch._C, "_cuda_getAllocatorBackend", None)
        ),
        "torch._foreach_copy_": callable(getattr(torch, "_foreach_copy_", None)),
        "torch.multiprocessing.reductions.rebuild_cuda_tensor": _has_rebuild(),
    }


def _has_rebuild() -> bool:
    from torch.multiprocessing import reductions

    return callable(getattr(reductions, "rebuild_cuda_tensor", None))
