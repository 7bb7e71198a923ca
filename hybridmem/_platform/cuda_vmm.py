"""The CUDA driver's virtual memory API: export, import and map physical allocations.

torch's expandable segments are made of physical allocations (``cuMemCreate``, one
per page: 20 MiB in the large pool, 2 MiB in the small one) mapped side by side in
one reserved address range. Each allocation can be exported as a POSIX file
descriptor (``cuMemExportToShareableHandle``) that another process imports and maps
into an address range of its own, viewing the same memory. torch sends the
consumer the producer's pid and fd numbers and lets it copy the fds with
``pidfd_getfd`` (pytorch#165685), which a container's seccomp profile denies;
hybridmem passes the fds themselves over a Unix socket instead (see
:mod:`hybridmem._platform.unix_socket`). Every call here is public driver API
(CUDA 10.2+ for POSIX fds).

Stdlib only (ctypes), so the IPC probe child can use it without torch.

Scope: process-global; thread-safe (the driver is; the library is loaded once).
Addresses are plain ints, as the driver takes them.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hybridmem._platform.cuda_driver import (
    POINTER_ALLOWED_HANDLE_TYPES,
    DriverError,
    error_name,
    libcuda,
    pointer_attribute,
)
from hybridmem._platform.cuda_driver import check as _check
from hybridmem._platform.cuda_driver import function as _fn

__all__ = [
    "HANDLE_TYPE_FABRIC",
    "HANDLE_TYPE_POSIX_FD",
    "DriverError",
    "PageMap",
    "allocation_range",
    "allowed_handle_types",
    "export_fd",
    "has_vmm",
    "initialize",
    "on_device",
    "primary_context",
    "release_primary_context",
    "synchronize_context",
]

#: ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` (cuda.h).
HANDLE_TYPE_POSIX_FD = 0x1
#: ``CU_MEM_HANDLE_TYPE_FABRIC`` (cuda.h, CUDA 12.3+).
HANDLE_TYPE_FABRIC = 0x8
_LOCATION_TYPE_DEVICE = 0x1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READWRITE = 0x3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE

# The driver functions this module needs, under the symbol names libcuda exports
# (the ``_v2`` ones replaced their originals in CUDA 3.2/4.0; the headers' macros
# map the plain names to them).
_SYMBOLS = (
    "cuMemRetainAllocationHandle",
    "cuMemGetAddressRange_v2",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxSynchronize",
    "cuGetErrorName",
)

_u64 = ctypes.c_uint64
_size = ctypes.c_size_t


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def has_vmm() -> bool:
    """Return whether the driver has every call this module needs (CUDA 10.2+).

    Example:
        >>> has_vmm()   # doctest: +SKIP
        True
    """
    lib = libcuda()
    return lib is not None and all(hasattr(lib, name) for name in _SYMBOLS)


def allowed_handle_types(address: int) -> int | None:
    """Return the shareable handle types of the allocation at ``address`` (a bit mask).

    :data:`HANDLE_TYPE_POSIX_FD` set: exportable as a file descriptor. 0: not
    exportable (torch with ``TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0``, or a
    ``cudaMallocAsync`` pool made without handle types). None: the driver cannot say.
    """
    return pointer_attribute(address, POINTER_ALLOWED_HANDLE_TYPES)


def allocation_range(address: int) -> tuple[int, int]:
    """Return ``(base, size)`` of the mapped allocation that holds ``address``.

    For memory mapped with ``cuMemMap`` this is one physical allocation (one page
    of an expandable segment); for ``cudaMalloc`` memory, the whole allocation.

    Raises:
        DriverError: ``address`` is not device memory of this process.
    """
    base, size = _u64(0), _size(0)
    _check(
        "cuMemGetAddressRange",
        _fn("cuMemGetAddressRange_v2")(ctypes.byref(base), ctypes.byref(size), _u64(address)),
    )
    return int(base.value), int(size.value)


def export_fd(address: int) -> int:
    """Export the physical allocation mapped at ``address`` as a new POSIX fd.

    The caller owns the fd (close it once sent). The allocation stays alive while
    the fd or any import of it exists, whatever the producer does with its mapping.

    Raises:
        DriverError: the allocation was not created exportable as a POSIX fd
            (``CUDA_ERROR_INVALID_VALUE`` or ``CUDA_ERROR_NOT_SUPPORTED``), or
            ``address`` is not mapped with ``cuMemMap``.
    """
    handle = _u64(0)
    _check(
        "cuMemRetainAllocationHandle",
        _fn("cuMemRetainAllocationHandle")(ctypes.byref(handle), ctypes.c_void_p(address)),
    )
    try:
        fd = ctypes.c_int(-1)
        _check(
            "cuMemExportToShareableHandle",
            _fn("cuMemExportToShareableHandle")(
                ctypes.byref(fd), handle, ctypes.c_int(HANDLE_TYPE_POSIX_FD), _u64(0)
            ),
        )
        return int(fd.value)
    finally:
        # Retain took a reference of its own; the mapping keeps the allocation.
        _fn("cuMemRelease")(handle)


def initialize() -> None:
    """Initialise the driver (``cuInit``), as the runtime does before its first call.

    Needed only where nothing has used CUDA yet in this process: the IPC probe
    creates its context in a thread while it imports torch (ctypes releases the GIL
    for the calls), and torch then adopts that primary context.
    """
    _check("cuInit", _fn("cuInit")(ctypes.c_uint(0)))


def primary_context(device: int) -> int:
    """Retain device ``device``'s primary context (the one torch uses); return it.

    Pair with :func:`release_primary_context`.
    """
    dev = ctypes.c_int(0)
    _check("cuDeviceGet", _fn("cuDeviceGet")(ctypes.byref(dev), ctypes.c_int(device)))
    ctx = ctypes.c_void_p(0)
    _check(
        "cuDevicePrimaryCtxRetain",
        _fn("cuDevicePrimaryCtxRetain")(ctypes.byref(ctx), dev),
    )
    return int(ctx.value or 0)


def release_primary_context(device: int) -> None:
    """Drop one reference taken by :func:`primary_context`."""
    dev = ctypes.c_int(0)
    if _fn("cuDeviceGet")(ctypes.byref(dev), ctypes.c_int(device)) == 0:
        _fn("cuDevicePrimaryCtxRelease_v2")(dev)


def synchronize_context(context: int) -> None:
    """Wait, on this thread, for all work queued in ``context`` to finish.

    The context is pushed for the call and popped after it, so this works from
    any thread (a tensor's deleter runs in whichever thread dropped it).
    """
    with _pushed(context):
        _check("cuCtxSynchronize", _fn("cuCtxSynchronize")())


@contextlib.contextmanager
def _pushed(context: int) -> Iterator[None]:
    """``context`` current on this thread for the block (pushed, then popped)."""
    _check("cuCtxPushCurrent", _fn("cuCtxPushCurrent_v2")(ctypes.c_void_p(context)))
    try:
        yield
    finally:
        popped = ctypes.c_void_p(0)
        _fn("cuCtxPopCurrent_v2")(ctypes.byref(popped))


def _prefix(sizes: Sequence[int], nbytes: int) -> list[int]:
    """The leading ``sizes`` that add up to ``nbytes`` (the pages mapped so far)."""
    taken: list[int] = []
    for size in sizes:
        if sum(taken) + size > nbytes:
            break
        taken.append(size)
    return taken


def _unmap(address: int, sizes: Sequence[int], *, check: bool = False) -> None:
    """Unmap pages one by one: ``cuMemUnmap`` takes whole mappings, not a span of several."""
    offset = 0
    first: DriverError | None = None
    for size in sizes:
        code = _fn("cuMemUnmap")(_u64(address + offset), _size(size))
        if code != 0 and first is None:
            first = DriverError("cuMemUnmap", code, error_name(code))
        offset += size
    if check and first is not None:
        raise first


@contextlib.contextmanager
def on_device(device: int) -> Iterator[int]:
    """Make ``device``'s primary context current on this thread for the block; yield it.

    Address queries (``cuMemGetAddressRange``, ``cuMemRetainAllocationHandle``) and
    reservations need a current context, and a thread that never ran CUDA work
    has none: a ``multiprocessing`` queue's feeder thread, which pickles, is one.
    torch's device guard does not help there (it skips ``cudaSetDevice`` when the
    index already matches). The primary context is the one torch uses.
    """
    context = primary_context(device)
    try:
        with _pushed(context):
            yield context
    finally:
        release_primary_context(device)


@dataclass
class PageMap:
    """Imported allocations mapped side by side in one address range of this process.

    Made by :meth:`open`; :meth:`close` unmaps and frees the range (the physical
    memory is freed when its last holder, in any process, lets it go).
    """

    address: int
    sizes: tuple[int, ...]
    device: int

    @property
    def nbytes(self) -> int:
        """The mapped range's size."""
        return sum(self.sizes)

    @classmethod
    def open(cls, fds: Sequence[int], sizes: Sequence[int], device: int) -> PageMap:
        """Import ``fds`` (one per allocation, of ``sizes``) and map them for ``device``.

        The fds are not closed (the caller closes them: the mapping does not need
        them). On any failure, everything imported or mapped so far is undone.

        Raises:
            ValueError: ``fds`` and ``sizes`` differ in length, or are empty.
            DriverError: an import, reservation, map or access call failed.
        """
        if len(fds) != len(sizes) or not fds:
            raise ValueError(f"{len(fds)} fds for {len(sizes)} allocations")
        total = sum(sizes)
        base = _u64(0)
        _check(
            "cuMemAddressReserve",
            _fn("cuMemAddressReserve")(
                ctypes.byref(base), _size(total), _size(0), _u64(0), _u64(0)
            ),
        )
        address = int(base.value)
        mapped = 0
        try:
            offset = 0
            for fd, size in zip(fds, sizes, strict=True):
                handle = _u64(0)
                _check(
                    "cuMemImportFromShareableHandle",
                    _fn("cuMemImportFromShareableHandle")(
                        ctypes.byref(handle),
                        ctypes.c_void_p(fd),
                        ctypes.c_int(HANDLE_TYPE_POSIX_FD),
                    ),
                )
                try:
                    _check(
                        "cuMemMap",
                        _fn("cuMemMap")(
                            _u64(address + offset), _size(size), _size(0), handle, _u64(0)
                        ),
                    )
                finally:
                    # The mapping holds the allocation; our handle is not needed.
                    _fn("cuMemRelease")(handle)
                mapped = offset = offset + size
            access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, device), _ACCESS_READWRITE)
            _check(
                "cuMemSetAccess",
                _fn("cuMemSetAccess")(_u64(address), _size(total), ctypes.byref(access), _size(1)),
            )
        except BaseException:
            _unmap(address, _prefix(sizes, mapped))
            _fn("cuMemAddressFree")(_u64(address), _size(total))
            raise
        return cls(address, tuple(sizes), device)

    def close(self) -> None:
        """Unmap the allocations and free the address range (idempotent).

        The caller must make sure no queued work still reads or writes it
        (:func:`synchronize_context` first).
        """
        if not self.sizes:
            return
        total = self.nbytes
        try:
            _unmap(self.address, self.sizes, check=True)
        finally:
            _fn("cuMemAddressFree")(_u64(self.address), _size(total))
            self.sizes = ()
