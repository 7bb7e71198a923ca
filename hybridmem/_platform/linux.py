"""Linux facts and syscalls that CUDA IPC depends on (stdlib only, no torch).

A tensor in an expandable segment is exported as a POSIX file descriptor; the
consumer fetches it from the producer with ``pidfd_open`` + ``pidfd_getfd``
(Linux 5.6+). The kernel allows that only when the consumer may ptrace the
producer (same user and CAP_SYS_PTRACE or a Yama rule that permits it), and a
seccomp filter, as in a default container profile, may deny the syscall
outright. Classic segments go through ``cudaIpcGetMemHandle`` and need none of
this. These helpers answer "which of those applies here", for
:func:`hybridmem.ipc_capabilities` and ``hybridmem doctor``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from pathlib import Path

__all__ = [
    "SYS_PIDFD_GETFD",
    "SYS_PIDFD_OPEN",
    "boot_id",
    "container_hints",
    "errno_name",
    "fetch_fd",
    "is_linux",
    "pid_namespace",
    "seccomp_mode",
    "set_ptracer_any",
    "yama_ptrace_scope",
]

# The generic syscall table (Linux 5.1+) gives new syscalls one number on every
# architecture hybridmem runs on (x86-64, aarch64).
SYS_PIDFD_OPEN = 434
SYS_PIDFD_GETFD = 438

_PR_SET_PTRACER = 0x59616D61  # "Yama": include/uapi/linux/prctl.h
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF)


def is_linux() -> bool:
    """Return whether this is Linux (the only platform with CUDA IPC in torch)."""
    return sys.platform.startswith("linux")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def errno_name(code: int | None) -> str | None:
    """Return ``"EPERM"`` for 1 and so on (None for None)."""
    if code is None:
        return None
    return errno.errorcode.get(code, str(code))


def fetch_fd(pid: int, fd: int) -> int | None:
    """Do what a CUDA IPC consumer does for an expandable segment; return the errno.

    Calls ``pidfd_open(pid)`` and ``pidfd_getfd(pidfd, fd)``, closes what it got,
    and returns None when both succeeded, else the errno of the first failure
    (EPERM: denied by seccomp or ptrace rules; ENOSYS: kernel older than 5.6 or
    a filter that hides the syscall; ESRCH/EBADF: no such process or fd).
    """
    if not is_linux():
        return errno.ENOSYS
    libc = _libc()
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    pidfd = int(syscall(ctypes.c_long(SYS_PIDFD_OPEN), ctypes.c_int(pid), ctypes.c_uint(0)))
    if pidfd < 0:
        return ctypes.get_errno()
    try:
        got = int(
            syscall(
                ctypes.c_long(SYS_PIDFD_GETFD),
                ctypes.c_int(pidfd),
                ctypes.c_int(fd),
                ctypes.c_uint(0),
            )
        )
        if got < 0:
            return ctypes.get_errno()
        os.close(got)
        return None
    finally:
        os.close(pidfd)


def yama_ptrace_scope() -> int | None:
    """Return ``/proc/sys/kernel/yama/ptrace_scope`` (None without Yama).

    0: any process of the same user may ptrace (and pidfd_getfd from) another;
    1: only descendants, or processes the target named with ``PR_SET_PTRACER``;
    2: only with CAP_SYS_PTRACE; 3: never.
    """
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def seccomp_mode() -> int | None:
    """Return this process's seccomp mode (0 none, 1 strict, 2 filter; None unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Seccomp:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def container_hints() -> tuple[str, ...]:
    """Return the signs that this process runs in a container (empty if none seen)."""
    hints: list[str] = []
    if Path("/.dockerenv").exists():
        hints.append("/.dockerenv exists (Docker)")
    if Path("/run/.containerenv").exists():
        hints.append("/run/.containerenv exists (Podman)")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        hints.append("KUBERNETES_SERVICE_HOST is set (Kubernetes pod)")
    try:
        cgroup = Path("/proc/1/cgroup").read_text()
    except OSError:
        cgroup = ""
    for word in ("docker", "kubepods", "containerd", "libpod"):
        if word in cgroup:
            hints.append(f"/proc/1/cgroup mentions {word}")
            break
    return tuple(hints)


def set_ptracer_any() -> int | None:
    """Call ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``; return None or the errno."""
    if not is_linux():
        return errno.ENOSYS
    libc = _libc()
    prctl = libc.prctl
    prctl.restype = ctypes.c_int
    result = int(
        prctl(
            ctypes.c_int(_PR_SET_PTRACER),
            _PR_SET_PTRACER_ANY,
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
    )
    return ctypes.get_errno() if result != 0 else None


def boot_id() -> str | None:
    """Return this boot of this machine's id (``/proc/sys/kernel/random/boot_id``).

    The same in every container of one host (their host names differ), different
    on another host: two processes can share device memory only if theirs match.
    None where the kernel does not say.
    """
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    """Return this process's pid namespace (``pid:[4026531836]``), None where unknown.

    Pids mean the same in two processes only if these match.
    """
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
