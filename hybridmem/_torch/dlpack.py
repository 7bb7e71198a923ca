"""A torch tensor over memory torch did not allocate, with a callback when torch lets go.

The consumer of an exported expandable segment maps the producer's allocations at
an address of its own and needs a tensor there that calls back when its last view
dies (to unmap and tell the producer). ``torch.from_dlpack`` (public, torch 1.10+)
takes a DLPack capsule and calls the capsule's deleter when the storage is freed;
the capsule is built here with ctypes, so neither numpy (which
``__cuda_array_interface__`` needs in torch) nor any other package is required.
The legacy (unversioned) ``"dltensor"`` capsule is what every torch from 1.10 to
2.13 accepts.

Scope: process-global registry of live capsules; thread-safe (the deleter may run
in any thread that drops the last reference; ctypes takes the GIL for it).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.utils.dlpack

from hybridmem._log import logger

# torch.utils.dlpack.from_dlpack (public since torch 1.10) takes a capsule directly.
_FROM_DLPACK = cast(Callable[[object], torch.Tensor], torch.utils.dlpack.from_dlpack)

__all__ = ["live_external_tensors", "tensor_from_memory"]

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_lock = threading.Lock()
# address of a _DLManagedTensor -> (the struct, its shape array, the callback)
_live: dict[int, tuple[_DLManagedTensor, ctypes.Array[ctypes.c_int64], Callable[[], None]]] = {}


def _deleted(
    managed: ctypes._Pointer[_DLManagedTensor],
    _addressof: Callable[[Any], int] = ctypes.addressof,
    _lock: threading.Lock = _lock,
    _live: dict[int, Any] = _live,
    _logger: logging.Logger = logger,
) -> None:
    # The defaults hold what it needs: a tensor alive at interpreter exit is freed after
    # this module's globals are cleared, and the deleter still runs then.
    key = _addressof(managed.contents)
    with _lock:
        entry = _live.pop(key, None)
    if entry is None:
        return
    try:
        entry[2]()
    except BaseException:  # a deleter must not raise into torch's C++
        _logger.exception("hybridmem: releasing an external tensor's memory failed")


_DELETER_FN = _DELETER(_deleted)  # kept alive for the process's lifetime


def tensor_from_memory(
    address: int, nbytes: int, device: int | None, on_free: Callable[[], None]
) -> torch.Tensor:
    """Return a 1-D uint8 tensor of ``nbytes`` at ``address``; ``on_free()`` runs when it dies.

    Args:
        address: where the memory starts (a device address for ``device``, or a
            host address when ``device`` is None).
        nbytes: its length, at least 1.
        device: the CUDA device index the memory belongs to, or None for host memory.
        on_free: called once, with no arguments, when torch frees the storage
            (the last view of it gone), in whichever thread let it go; its
            exceptions are logged, never raised.

    Returns:
        The tensor; view it as another dtype with ``.view(dtype)``.

    Example:
        >>> t = tensor_from_memory(addr, 1 << 20, 0, unmap)   # doctest: +SKIP
    """
    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed.dl_tensor.data = address
    managed.dl_tensor.device = _DLDevice(
        _KDL_CPU if device is None else _KDL_CUDA, 0 if device is None else device
    )
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None  # compact row-major
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _DELETER_FN
    key = ctypes.addressof(managed)
    with _lock:
        _live[key] = (managed, shape, on_free)
    try:
        capsule = _PyCapsule_New(key, b"dltensor", None)
        tensor = _FROM_DLPACK(capsule)
    except BaseException:
        with _lock:
            _live.pop(key, None)
        raise
    return tensor


def live_external_tensors() -> int:
    """Return how many tensors made by :func:`tensor_from_memory` are still alive."""
    with _lock:
        return len(_live)
