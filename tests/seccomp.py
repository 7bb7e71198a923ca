"""Deny ``pidfd_getfd`` to the calling process, as a default container seccomp profile does.

Used by tests (CPU and GPU) to play a consumer in a locked-down container: after
:func:`deny_pidfd_getfd`, syscall 438 fails with EPERM in this process and every
child it starts (filters are inherited and cannot be removed).
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["deny_pidfd_getfd"]

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_EPERM = 1
_SYS_PIDFD_GETFD = 438  # x86-64 and aarch64 alike
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_RET_K = 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [
        ("len", ctypes.c_ushort),
        ("filter", ctypes.POINTER(_SockFilter)),
    ]


def deny_pidfd_getfd() -> None:
    """Install a seccomp filter that makes ``pidfd_getfd`` fail with EPERM here.

    Raises:
        OSError: the kernel refused the filter.
        RuntimeError: an architecture this helper does not know.
    """
    arch = _AUDIT_ARCH.get(platform.machine())
    if arch is None:
        raise RuntimeError(f"no seccomp filter for {platform.machine()}")
    program = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, arch),  # our architecture: go on; else allow
        (_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JEQ_K, 0, 1, _SYS_PIDFD_GETFD),
        (_RET_K, 0, 0, _SECCOMP_RET_ERRNO | _EPERM),
        (_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    filters = (_SockFilter * len(program))(*(_SockFilter(*op) for op in program))
    prog = _SockFprog(len(program), ctypes.cast(filters, ctypes.POINTER(_SockFilter)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
