"""What CUDA IPC can do on this machine, probed once in child processes."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hybridmem import _torch
from hybridmem._checks import check_bool
from hybridmem._devices import DeviceArg, device_index
from hybridmem._log import logger
from hybridmem._names import suggests_keywords
from hybridmem._platform import linux as _linux
from hybridmem.ipc import _launch as _probe_launch
from hybridmem.scopes.ipc_safe import forget_probes, note_probe

__all__ = ["IpcCapabilities", "cached_capabilities", "ipc_capabilities"]

PidfdStatus = Literal["allowed", "denied", "unsupported", "unknown"]

_IPC_ENV = "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC"

_cache: dict[int, IpcCapabilities] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class IpcCapabilities:
    """What CUDA IPC between two processes can do here (see :func:`ipc_capabilities`).

    Attributes:
        device: the device index probed (in this process's numbering).
        cuda: whether the probe could use a CUDA device at all.
        classic_ipc: a tensor in a classic segment (``cudaIpcGetMemHandle``) reached
            the consumer intact; None when not probed (no CUDA).
        expandable_ipc: a tensor in an expandable segment reached the consumer
            intact; None when not probed.
        expandable_handle: how torch exports expandable segments here
            (``"posix_fd"`` needs pidfd_getfd, ``"fabric"`` does not, ``"none"``
            when IPC handles are off); None when unknown.
        pidfd_getfd: whether a consumer may fetch the producer's file descriptor:
            ``"allowed"``, ``"denied"`` (EPERM), ``"unsupported"`` (ENOSYS) or
            ``"unknown"``.
        denied_by: ``"seccomp"`` when the syscall itself is filtered,
            ``"ptrace"`` when the consumer may not ptrace the producer (Yama,
            missing CAP_SYS_PTRACE); None when not denied.
        ptrace_scope: Yama's ``ptrace_scope`` (None without Yama).
        seccomp: the consumer's seccomp mode (0 none, 2 filter).
        container_hints: signs that this runs in a container.
        reason: why something does not work (None when everything does).
        advice: what to do about it.
        elapsed_s: how long the probe took.
        fd_passing: an expandable-segment tensor reached the consumer intact by fd
            passing (:func:`hybridmem.ipc_export`, no ``pidfd_getfd``); None when
            not probed.
        details: the probe's raw facts (errors as text), for bug reports.
    """

    device: int
    cuda: bool
    classic_ipc: bool | None
    expandable_ipc: bool | None
    expandable_handle: str | None
    pidfd_getfd: PidfdStatus
    denied_by: str | None
    ptrace_scope: int | None
    seccomp: int | None
    container_hints: tuple[str, ...]
    reason: str | None
    advice: str
    elapsed_s: float
    fd_passing: bool | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def blocking(self) -> bool:
        """True when no form of CUDA IPC works (weights must go through host memory)."""
        return self.cuda and self.classic_ipc is False

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (for ``hybridmem doctor --json``)."""
        data = asdict(self)
        data["container_hints"] = list(self.container_hints)
        return data

    def __str__(self) -> str:
        def word(value: bool | None) -> str:
            return "not probed" if value is None else ("works" if value else "FAILS")

        lines = [
            f"CUDA IPC on device {self.device}:",
            f"  classic segments:    {word(self.classic_ipc)}",
            f"  expandable segments: {word(self.expandable_ipc)}"
            + (f" (handle {self.expandable_handle})" if self.expandable_handle else ""),
            f"  fd passing:          {word(self.fd_passing)}",
            f"  pidfd_getfd:         {self.pidfd_getfd}"
            + (f" (by {self.denied_by})" if self.denied_by else ""),
        ]
        if self.reason:
            lines.append(f"  reason: {self.reason}")
        lines.append(f"  advice: {self.advice}")
        return "\n".join(lines)


def _pidfd_status(facts: dict[str, Any]) -> tuple[PidfdStatus, str | None, str | None]:
    """Return (status, denied_by, errno name) from the consumer's two syscall checks."""
    own = facts.get("self_fetch_errno")
    cross = facts.get("producer_fetch_errno")
    if "self_fetch_errno" not in facts:
        return "unknown", None, None
    if own == "ENOSYS":
        return "unsupported", None, own
    if own is not None:
        return "denied", "seccomp", own
    if cross is None:
        return "allowed", None, None
    if cross in ("EPERM", "EACCES"):
        return "denied", "ptrace", cross
    return "unknown", None, cross


def _expandable_reason(
    facts: dict[str, Any], pidfd: PidfdStatus, denied_by: str | None, errno: str | None
) -> str:
    export_error = facts.get("expandable_export_error")
    if export_error:
        if os.environ.get(_IPC_ENV, "").strip().lower() in ("0", "false", "no", "off"):
            return f"{_IPC_ENV}=0 turns off IPC handles for expandable segments ({export_error})"
        return (
            f"torch {_torch.torch_version_string()} cannot export tensors from expandable "
            f"segments ({export_error})"
        )
    import_error = str(facts.get("expandable_import_error", ""))
    if pidfd == "denied" and denied_by == "seccomp":
        return (
            f"pidfd_getfd fails with {errno}: a seccomp filter (as in a default container "
            "profile) denies the syscall that imports expandable segments"
        )
    if pidfd == "denied":
        scope = _linux.yama_ptrace_scope()
        why = f"Yama ptrace_scope={scope}" if scope else "ptrace permission rules"
        return (
            f"pidfd_getfd fails with {errno}: the consumer may not ptrace the producer "
            f"({why}; a consumer that is a child of the producer counts too)"
        )
    if pidfd == "unsupported":
        return "pidfd_getfd is not available (Linux 5.6+ needed, or a filter hides it)"
    return import_error or "the expandable-segment tensor did not arrive intact"


def _advice(
    classic: bool | None,
    expandable: bool | None,
    denied_by: str | None,
    fd_passing: bool | None = None,
) -> str:
    if classic is None:
        return "no CUDA IPC to set up here; hybridmem's IPC helpers fall back to host memory"
    if not classic:
        return (
            "CUDA IPC does not work between processes here: check that producer and "
            "consumer see the same GPU and share the IPC and PID namespaces (containers: "
            "--ipc=host); until then use WeightBucket(fallback='host')"
        )
    if expandable:
        return "nothing to do: tensors from either segment kind can be shared"
    if fd_passing:
        return (
            "share expandable-segment tensors by fd passing: hm.ipc_export(tensor), "
            "torch.multiprocessing queues inside hm.ipc_fd_sharing(), or "
            "hm.WeightBucket(transport='fd'); or keep shared tensors in classic segments "
            "(hm.ipc_safe(), hm.ipc_shareable())"
        )
    advice = (
        "share only tensors from classic segments: allocate them inside hm.ipc_safe(), "
        "pass them through hm.ipc_shareable(), or stage weights in a hm.WeightBucket"
    )
    if denied_by == "ptrace":
        advice += (
            "; or let consumers fetch descriptors: hm.allow_ptrace_from_any() in the "
            "producer (read its security note) or CAP_SYS_PTRACE for the consumer"
        )
    elif denied_by == "seccomp":
        advice += "; or allow pidfd_getfd in the container's seccomp profile"
    return advice


def _interpret(device: int, facts: dict[str, Any], elapsed: float) -> IpcCapabilities:
    cuda = "cuda_error" not in facts and ("classic_ok" in facts or "classic_export_error" in facts)
    pidfd, denied_by, errno = _pidfd_status(facts)
    classic: bool | None = None
    expandable: bool | None = None
    fd_passing: bool | None = None
    reason: str | None = None
    if cuda:
        classic = bool(facts.get("classic_ok"))
        expandable = bool(facts.get("expandable_ok"))
        fd_passing = bool(facts.get("fd_ok"))
        if not classic:
            reason = str(
                facts.get("classic_import_error")
                or facts.get("classic_export_error")
                or "the classic-segment tensor did not arrive intact"
            )
        elif not expandable:
            reason = _expandable_reason(facts, pidfd, denied_by, errno)
            if not fd_passing:
                why = facts.get("fd_import_error") or facts.get("fd_export_error")
                reason += f"; fd passing fails too ({why or 'not tried'})"
    else:
        reason = str(facts.get("cuda_error") or "no CUDA device is visible")
        if "consumer_error" in facts:
            reason += f"; consumer: {facts['consumer_error']}"
    return IpcCapabilities(
        device=device,
        cuda=cuda,
        classic_ipc=classic,
        expandable_ipc=expandable,
        expandable_handle=facts.get("expandable_handle"),
        pidfd_getfd=pidfd,
        denied_by=denied_by,
        ptrace_scope=_linux.yama_ptrace_scope(),
        seccomp=facts.get("seccomp"),
        container_hints=_linux.container_hints(),
        reason=reason,
        advice=_advice(classic, expandable, denied_by, fd_passing),
        elapsed_s=elapsed,
        fd_passing=fd_passing,
        details=facts,
    )


def _run_probe(device: int, cuda: bool) -> dict[str, Any]:
    """Run the probe program (or adopt one started early); return its facts."""
    run = _probe_launch.take(device, cuda) or _probe_launch.ProbeRun(device, cuda)
    return run.facts()


@suggests_keywords
def ipc_capabilities(device: DeviceArg = None, *, refresh: bool = False) -> IpcCapabilities:
    """Return what CUDA IPC can do on this machine, probed once per process and device.

    The probe runs in two child processes (a producer and its consumer, the way a
    trainer and its rollout engine are usually related), so this process's CUDA and
    allocator state are never touched: the producer exports one tensor from a
    classic segment and one from an expandable segment; the consumer checks
    ``pidfd_getfd`` on itself (a seccomp filter?) and on the producer (ptrace
    rules?), then imports both tensors and compares their bytes. Restrictions of
    this process (seccomp filters, namespaces) are inherited by the children, so a
    restricted consumer learns about its own restriction.

    Args:
        device: the device to probe: None (the current device, or 0 before CUDA is
            initialised), an index, ``"cuda:N"`` or a ``torch.device``.
        refresh: probe again instead of returning the cached result.

    Returns:
        An :class:`IpcCapabilities`. Without CUDA it says so (``cuda=False``,
        ``classic_ipc=None``) and still reports the pidfd_getfd checks.

    Scope: process-wide cache, thread-safe. Cost: a few seconds the first time
    (two interpreters import torch and create a CUDA context), then free.

    Example:
        >>> caps = hm.ipc_capabilities()          # doctest: +SKIP
        >>> if not caps.expandable_ipc:           # doctest: +SKIP
        ...     print(caps.reason, caps.advice)
    """
    check_bool("refresh", refresh)
    index = device_index(device)
    with _lock:
        cached = _cache.get(index)
        if cached is not None and not refresh:
            return cached
        started = time.perf_counter()
        facts = _run_probe(index, cuda=_torch.cuda_available())
        elapsed = facts.pop("elapsed_s", None)
        caps = _interpret(index, facts, elapsed or time.perf_counter() - started)
        _cache[index] = caps
        note_probe(index, caps.classic_ipc, caps.reason)  # for ipc_safe, which cannot ask
    logger.info(
        "CUDA IPC probe (device %d, %.1f s): classic=%s expandable=%s pidfd_getfd=%s%s",
        index,
        caps.elapsed_s,
        caps.classic_ipc,
        caps.expandable_ipc,
        caps.pidfd_getfd,
        f"; {caps.reason}" if caps.reason else "",
    )
    return caps


def cached_capabilities(device: int) -> IpcCapabilities | None:
    """Return the probe result for ``device`` if one was made, without probing."""
    return _cache.get(device)


def _reset_for_tests() -> None:
    with _lock:
        _cache.clear()
        forget_probes()
