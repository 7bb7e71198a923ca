"""The CUDA driver library (``libcuda.so.1``), loaded once, without torch.

hybridmem asks the driver what torch does not expose: a pointer's attributes, and
(through :mod:`~hybridmem._platform.cuda_vmm` and
:mod:`~hybridmem._platform.cuda_streams`) memory mappings and single streams. The IPC
probe asks in a child that must not pay for more than it needs, so this module
imports only the standard library. :func:`function` binds one driver call and
:func:`check` turns its ``CUresult`` into a :class:`DriverError`.

Scope: process-global; thread-safe (the library is loaded once under a lock).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

__all__ = [
    "POINTER_ALLOWED_HANDLE_TYPES",
    "POINTER_IS_LEGACY_CUDA_IPC_CAPABLE",
    "DriverError",
    "check",
    "error_name",
    "function",
    "host_device_pointer",
    "libcuda",
    "pointer_attribute",
]

#: ``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`` (cuda.h, CUDA 10.1+).
POINTER_IS_LEGACY_CUDA_IPC_CAPABLE = 10
#: ``CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES`` (cuda.h, CUDA 11.1+).
POINTER_ALLOWED_HANDLE_TYPES = 14


@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.CDLL | None:
    """Return the CUDA driver library (the one torch already loaded), or None.

    Example:
        >>> lib = libcuda()   # doctest: +SKIP
    """
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


def pointer_attribute(pointer: int, attribute: int) -> int | None:
    """Return one integer attribute of a device pointer (``cuPointerGetAttribute``).

    Args:
        pointer: a device address.
        attribute: a ``CU_POINTER_ATTRIBUTE_*`` value, e.g.
            :data:`POINTER_IS_LEGACY_CUDA_IPC_CAPABLE`.

    Returns:
        The attribute's value, or None where the driver is missing or refuses.

    Example:
        >>> pointer_attribute(ptr, POINTER_IS_LEGACY_CUDA_IPC_CAPABLE)   # doctest: +SKIP
        1
    """
    lib = libcuda()
    if lib is None:
        return None
    value = ctypes.c_int(0)
    if lib.cuPointerGetAttribute(ctypes.byref(value), attribute, pointer) != 0:
        return None
    return int(value.value)


def host_device_pointer(address: int) -> int | None:
    """The device address of registered, mapped host memory (``cuMemHostGetDevicePointer``).

    Kernels read such memory over the bus through this address (the host address
    itself where unified addressing allows). It needs a current context, as in any
    thread that has made a CUDA runtime call.

    Args:
        address: an address inside host memory registered with the mapped flag
            (``cudaHostRegister(..., cudaHostRegisterMapped)``) or ``cudaHostAlloc``'d.

    Returns:
        The device address, or None where the driver is missing or refuses (the
        memory not mapped, no current context).

    Example:
        >>> host_device_pointer(pool.data_ptr())   # doctest: +SKIP
        140211716505600
    """
    try:
        get = function("cuMemHostGetDevicePointer_v2")
    except KeyError:
        return None
    pointer = ctypes.c_uint64(0)
    if get(ctypes.byref(pointer), ctypes.c_void_p(address), ctypes.c_uint(0)) != 0:
        return None
    return int(pointer.value)


class DriverError(OSError):
    """A CUDA driver call failed; ``code`` is its ``CUresult`` and ``call`` its name."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed with {name} ({code})")
        self.call = call
        self.code = code
        self.result_name = name


_lock = threading.Lock()
_bound: dict[str, object] = {}


def function(name: str) -> Any:
    """One driver function, its return type set once (KeyError: the driver lacks it).

    Example:
        >>> check("cuCtxSynchronize", function("cuCtxSynchronize")())   # doctest: +SKIP
    """
    lib = libcuda()
    if lib is None or not hasattr(lib, name):
        raise KeyError(name)
    with _lock:
        if name not in _bound:
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            _bound[name] = fn
    return _bound[name]


def error_name(code: int) -> str:
    """The driver's name of a ``CUresult`` (``CUDA_ERROR_INVALID_VALUE``)."""
    text = ctypes.c_char_p()
    try:
        if function("cuGetErrorName")(code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
    except KeyError:
        pass
    return f"CUresult {code}"


def check(call: str, code: int) -> None:
    """Raise :class:`DriverError` naming ``call`` unless ``code`` is ``CUDA_SUCCESS``."""
    if code != 0:
        raise DriverError(call, code, error_name(code))
