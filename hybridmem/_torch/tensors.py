"""Tensors and storages, streams, pinned host memory, batched copies (offload's needs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch

from hybridmem._format import first_line
from hybridmem._platform import cuda_streams
from hybridmem._torch.device import cuda_available

# torch ships these without annotations; typed aliases keep mypy --strict honest.
_CUDART: Callable[[], Any] = torch.cuda.cudart
_CUDA_STREAM = cast(Callable[..., Any], torch.cuda.Stream)
_EXTERNAL_STREAM = cast(Callable[..., Any], torch.cuda.ExternalStream)


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
            f"can be freed in place ({first_line(exc)})"
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


def storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``: it shares the storage and its resizes."""
    view = torch.empty(0, dtype=torch.uint8, device=device)
    view.set_(storage)
    return view


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


#: Per device, driver streams whose owners closed: handed out again, never destroyed.
_SPARE_STREAMS: dict[int, list[int]] = {}
#: The driver streams :func:`new_stream` handed out and not yet released.
_LENT_STREAMS: set[int] = set()


def new_stream(device: torch.device) -> Any:
    """Return a new CUDA stream on ``device`` (None for non-CUDA devices).

    One stream made with the driver (``cuStreamCreate``) and wrapped in
    ``torch.cuda.ExternalStream`` (torch 1.9+): ``torch.cuda.Stream()`` would fill
    torch's stream pool on first use, 70 MiB of device memory on an H200 that is
    never given back. Where the driver cannot make one, torch's pool
    serves. Its owner hands it back with :func:`release_stream` when it closes.

    A stream is never destroyed, as torch never destroys its pool's: torch may still
    name it (its allocator keeps the stream a block was made on). Nor is it released
    by a finalizer on the wrapper: on the H200, one such finalizer running at exit
    crashed the process (``weakref.finalize`` on ``ExternalStream``).

    Scope: process-global per device; thread-safe (list and set operations are
    atomic).
    """
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    spare = _SPARE_STREAMS.setdefault(index, [])
    try:
        handle: int | None = spare.pop()
    except IndexError:
        handle = cuda_streams.create_stream(index)
    if handle is None:
        return _CUDA_STREAM(device=device)
    _LENT_STREAMS.add(handle)
    return _EXTERNAL_STREAM(handle, device=torch.device("cuda", index))


def release_stream(stream: Any) -> None:
    """Hand a stream of :func:`new_stream` back for the next caller (others: ignored).

    The next owner's work is queued after whatever is still queued on it.
    """
    handle = getattr(stream, "cuda_stream", None)
    if handle in _LENT_STREAMS:
        _LENT_STREAMS.discard(handle)
        _SPARE_STREAMS.setdefault(stream.device.index, []).append(handle)


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


def pin_host_tensor(tensor: torch.Tensor, *, mapped: bool = False) -> bool:
    """Page-lock a CPU tensor's memory in place with ``cudaHostRegister``.

    Unlike ``pin_memory=True`` (torch's caching host allocator rounds every
    allocation up to a power of two: 24 GiB would pin 32 GiB), registering an
    exact-size allocation pins exactly what is asked. ``mapped`` also maps it into
    the devices' address space, so that kernels can read it
    (:func:`hybridmem._torch.mapped.host_device_view`); measured on an H200, that
    costs no more device memory (4.0 MiB for 3 GiB either way,
    ``benchmarks/reload_rate.py``). Returns False when CUDA is absent or
    registration failed (the tensor stays pageable).
    """
    if not cuda_available():
        return False
    cudart = _CUDART()
    # flag 1 = cudaHostRegisterPortable: pinned for every CUDA context in the
    # process; 2 = cudaHostRegisterMapped: with a device address too
    flags = 3 if mapped else 1
    status = int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, flags))
    return status == 0


def unpin_host_tensor(data_ptr: int) -> None:
    """Undo :func:`pin_host_tensor` (errors ignored: the process may be exiting)."""
    with contextlib.suppress(Exception):  # CUDA may already be torn down at exit
        _CUDART().cudaHostUnregister(data_ptr)


# Pieces at least this big are copied one by one (a contiguous same-dtype
# ``copy_`` is a cudaMemcpyAsync at full bandwidth); smaller ones are batched into
# multi-tensor kernels, where one launch per piece would cost more than the copy.
FOREACH_MAX_BYTES = 1 << 20


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy ``srcs[i]`` into ``dsts[i]`` (same shape and dtype) for every i, quickly.

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


def nonzero_static(flags: torch.Tensor, size: int) -> torch.Tensor:
    """The flat indices of the first ``size`` true entries of a 1-D bool tensor; no sync.

    ``torch.nonzero_static`` (CPU from torch 2.1, CUDA from pytorch#136415) knows its
    output size up front, so it never asks the device how many entries are true;
    where this torch lacks it, a cumulative sum and a scatter do the same. Missing
    entries (fewer than ``size`` are true) read 0, an index that is always in range.
    """
    fn = getattr(torch, "nonzero_static", None)
    if fn is not None and _STATIC_NONZERO.get(flags.device.type, True):
        try:
            return fn(flags, size=size, fill_value=0).view(-1)  # type: ignore[no-any-return]
        except (NotImplementedError, RuntimeError):  # no kernel for this device here
            _STATIC_NONZERO[flags.device.type] = False
    rank = flags.cumsum(0) - 1
    flat = torch.arange(flags.numel(), device=flags.device)
    slot = torch.where(flags & (rank < size), rank, size + flat)
    out = torch.zeros(size + flags.numel(), dtype=torch.int64, device=flags.device)
    return out.scatter_(0, slot, flat)[:size]


_STATIC_NONZERO: dict[str, bool] = {}
