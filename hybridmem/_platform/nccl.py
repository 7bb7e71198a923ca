"""The NCCL library this process already loaded (``libnccl.so.2``), through ctypes.

NCCL 2.29.7 added three calls that free and report a communicator's device memory:
``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` releases its dynamic allocations (its
scratch and staging buffers; topology and connections stay), ``ncclCommResume(comm)``
maps them again, and ``ncclCommMemStats(comm, stat, &value)`` says how much it holds
(``src/nccl.h.in`` and ``src/mem_manager.cc`` of NVIDIA/nccl 2.30.7). Both suspend and
resume are collective: each ends in a barrier over the communicator's bootstrap
network, so every rank must call them.

torch links NCCL by its soname; this module binds that same library (``dlopen`` with
``RTLD_NOLOAD``, then the path ``/proc/self/maps`` shows), never a second copy: a
communicator belongs to the library that made it. With ``LD_PRELOAD`` of a newer
``libnccl.so.2`` torch's communicators are that library's, and so are these calls.

Standard library only; bound once found, lazily. Scope: process-global, thread-safe.
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
from dataclasses import dataclass

__all__ = [
    "SUSPEND_MEM",
    "SUSPEND_VERSION",
    "MemStat",
    "NcclCallError",
    "NcclLibrary",
    "loaded_nccl",
    "version_text",
]

#: ``NCCL_SUSPEND_MEM``: release the communicator's dynamic device memory.
SUSPEND_MEM = 0x01
#: The first NCCL release with suspend, resume and memory statistics (2.29.7).
SUSPEND_VERSION = 22907
_SONAME = "libnccl.so.2"


class MemStat(enum.IntEnum):
    """``ncclCommMemStat_t``: what ``ncclCommMemStats`` reports."""

    SUSPENDABLE = 0  # device bytes a suspend releases (scratch + offload)
    SUSPENDED = 1  # 1 while suspended, else 0
    PERSISTENT = 2  # device bytes a suspend keeps
    TOTAL = 3  # every device byte NCCL tracks for this communicator


class NcclCallError(RuntimeError):
    """An NCCL call returned an error code; ``code`` is NCCL's ``ncclResult_t``."""

    def __init__(self, call: str, code: int, detail: str) -> None:
        super().__init__(f"{call} returned {code} ({detail})")
        self.call = call
        self.code = code


def version_text(code: int) -> str:
    """``NCCL_VERSION_CODE`` as ``"2.30.7"`` (codes before 2.9 are ``major*1000+...``)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


@dataclass(frozen=True)
class NcclLibrary:
    """The loaded NCCL library: its path, version and the suspend calls where it has them.

    Attributes:
        path: where the library was found (the soname when ``dlopen`` found it loaded).
        version: ``ncclGetVersion``'s code (2.30.7 is 23007).
        has_suspend: the library exports ``ncclCommSuspend``, ``ncclCommResume`` and
            ``ncclCommMemStats`` (NCCL 2.29.7+).
    """

    path: str
    version: int
    has_suspend: bool
    _lib: ctypes.CDLL

    @property
    def version_text(self) -> str:
        """The version as ``"2.30.7"``."""
        return version_text(self.version)

    def _error(self, call: str, code: int, comm: int | None) -> NcclCallError:
        detail = self._lib.ncclGetErrorString(code).decode(errors="replace")
        if comm:
            last = self._lib.ncclGetLastError(ctypes.c_void_p(comm))
            if last:
                detail += f"; NCCL: {last.decode(errors='replace').strip()}"
        return NcclCallError(call, code, detail)

    def suspend(self, comm: int) -> None:
        """``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)``: collective; raises NcclCallError."""
        code = self._lib.ncclCommSuspend(ctypes.c_void_p(comm), SUSPEND_MEM)
        if code:
            raise self._error("ncclCommSuspend", code, comm)

    def resume(self, comm: int) -> None:
        """``ncclCommResume(comm)``: collective; raises NcclCallError."""
        code = self._lib.ncclCommResume(ctypes.c_void_p(comm))
        if code:
            raise self._error("ncclCommResume", code, comm)

    def mem_stat(self, comm: int, stat: MemStat) -> int:
        """``ncclCommMemStats(comm, stat)``: local, no collective; raises NcclCallError."""
        value = ctypes.c_uint64(0)
        code = self._lib.ncclCommMemStats(ctypes.c_void_p(comm), int(stat), ctypes.byref(value))
        if code:
            raise self._error("ncclCommMemStats", code, comm)
        return int(value.value)


_lock = threading.Lock()


def _bind(lib: ctypes.CDLL, path: str) -> NcclLibrary | None:
    get_version = getattr(lib, "ncclGetVersion", None)
    if get_version is None:
        return None
    get_version.restype = ctypes.c_int
    get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
    code = ctypes.c_int(0)
    if get_version(ctypes.byref(code)) != 0:
        return None
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [ctypes.c_int]
    lib.ncclGetLastError.restype = ctypes.c_char_p
    lib.ncclGetLastError.argtypes = [ctypes.c_void_p]
    names = ("ncclCommSuspend", "ncclCommResume", "ncclCommMemStats")
    has_suspend = all(hasattr(lib, name) for name in names)
    if has_suspend:
        lib.ncclCommSuspend.restype = ctypes.c_int
        lib.ncclCommSuspend.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ncclCommResume.restype = ctypes.c_int
        lib.ncclCommResume.argtypes = [ctypes.c_void_p]
        lib.ncclCommMemStats.restype = ctypes.c_int
        lib.ncclCommMemStats.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint64),
        ]
    return NcclLibrary(path, int(code.value), has_suspend, lib)


def _mapped_paths(maps: str = "/proc/self/maps") -> list[str]:
    """Files named ``libnccl.so*`` mapped into this process, in order of appearance."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths: list[str] = []
    for line in lines:
        parts = line.split(maxsplit=5)
        name = parts[5] if len(parts) == 6 else ""
        if os.path.basename(name).startswith("libnccl.so") and name not in paths:
            paths.append(name)
    return paths


_found: list[NcclLibrary] = []  # once found, for the process's life (it cannot unload)


def loaded_nccl() -> NcclLibrary | None:
    """Return the NCCL library already in this process, or None (it never loads one).

    None is not remembered: torch may load NCCL later (at its first process group).

    Example:
        >>> lib = loaded_nccl()   # doctest: +SKIP
        >>> lib.version_text, lib.has_suspend   # doctest: +SKIP
        ('2.30.7', True)
    """
    if _found:
        return _found[0]
    with _lock:
        if _found:
            return _found[0]
        for path in [_SONAME, *_mapped_paths()]:
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            bound = _bind(lib, path)
            if bound is not None:
                _found.append(bound)
                return bound
        return None
