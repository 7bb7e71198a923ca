"""CUDA IPC that works in locked-down containers: ipc_safe, ipc_shareable, ptrace opt-in.

A tensor in an expandable segment is exported as a POSIX file descriptor that the
consumer must fetch with ``pidfd_getfd``; containers without ptrace rights deny it
(``RuntimeError: pidfd_getfd: Operation not permitted``; verl #2846, pytorch
#165685, ROLL #417). A tensor in a classic segment goes through
``cudaIpcGetMemHandle`` and needs no pidfd. So: allocate what will be shared in
classic segments (:func:`ipc_safe`), or copy it there (:func:`ipc_shareable`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from hybridmem import _torch
from hybridmem._checks import check_bool
from hybridmem._env import disabled
from hybridmem._errors import IpcUnavailableError
from hybridmem._log import info_once, logger
from hybridmem._platform import linux as _linux
from hybridmem.allocator.scopes import AllocatorScope
from hybridmem.allocator.state import ENGINE, drop_cached_blocks
from hybridmem.ipc.transports.base import Fallback, TransportName, check_fallback
from hybridmem.ipc.transports.choice import choose_transport

__all__ = [
    "Fallback",
    "IpcSafe",
    "allow_ptrace_from_any",
    "check_fallback",
    "ipc_safe",
    "ipc_shareable",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_ptracer_lock = threading.Lock()
_ptracer_set = False


class IpcSafe(AllocatorScope):
    """Scope in which new allocations can be shared without pidfd (see :func:`ipc_safe`)."""

    def __init__(self, *, fallback: Fallback = "auto", release_cache: bool = True) -> None:
        super().__init__()
        self.fallback = check_fallback(fallback)
        self._changes = {"expandable_segments": "False"}
        self._release_cache = check_bool("release_cache", release_cache)
        self._force = False
        self._label = f"ipc_safe(fallback={fallback!r})"
        self.transport: TransportName = "cuda"

    def _enter(self) -> object:
        device = _torch.current_device()
        index = 0 if device is None else device
        # Decided before the switch: "raise" must leave the allocator untouched. The
        # transports decide (issue #27); the scope keeps the chosen one's name.
        chosen = choose_transport(
            "cuda", self.fallback, index, who="ipc_safe", probe="cached", host_without_cuda=True
        )
        self.transport = chosen.name
        return super()._enter()


@overload
def ipc_safe(func: _F, /) -> _F: ...


@overload
def ipc_safe(func: None = None, /, *, fallback: Fallback = "auto") -> IpcSafe: ...


def ipc_safe(func: Any = None, /, *, fallback: Fallback = "auto") -> Any:
    """Make new allocations in a block or call shareable over CUDA IPC without pidfd.

    Inside, expandable segments are off (every other allocator setting kept) and,
    when that changes the mode, cached blocks are released first so no new tensor
    lands in an old expandable block. Tensors allocated inside can be sent to
    another process with ``torch.multiprocessing`` (or :func:`ipc_shareable`,
    :class:`WeightBucket`) even when the consumer may not call ``pidfd_getfd``.
    On exit the previous settings come back.

    ``fallback`` says what happens when classic-segment IPC is impossible here
    (``cudaMallocAsync`` backend, no allocator setter while expandable segments
    are on, or a cached :func:`ipc_capabilities` probe that found CUDA IPC
    broken): ``"auto"`` warns once and sets ``transport`` to ``"host"``,
    ``"host"`` always sets it to ``"host"``, ``"raise"`` raises
    :class:`IpcUnavailableError` before changing anything. Read
    ``scope.transport`` (``"cuda"`` or ``"host"``) to decide how to ship.

    Scope: process-global allocator settings (like :func:`expandable_segments`);
    re-entrant, nests, restores on any exception; context manager and decorator in
    every form, with or without parentheses (``@hm.ipc_safe`` or
    ``@hm.ipc_safe(fallback="raise")``).

    Args:
        func: what ``@hm.ipc_safe`` without parentheses decorates.
        fallback: ``"auto"`` (default), ``"host"`` or ``"raise"``.

    Returns:
        An :class:`IpcSafe` context/decorator (``func`` decorated, when given).

    Raises:
        TypeError, ValueError: ``fallback`` is not one of the three, or ``func`` is
            not something to decorate.

    Example:
        >>> with hm.ipc_safe():                       # doctest: +SKIP
        ...     staging = torch.empty(n, device="cuda")
        ...     queue.put(staging)                    # no pidfd needed by the consumer
    """
    scope = IpcSafe(fallback=fallback)
    return scope if func is None else scope(func)


def _safe_copy(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.detach().clone(memory_format=torch.preserve_format)
    if tensor.requires_grad:
        out.requires_grad_(True)
    return out


def ipc_shareable(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` if CUDA IPC can share it without pidfd, else a copy that can.

    The check is one driver query (``cuPointerGetAttribute``, ~1 us; no allocator
    snapshot). A tensor in an expandable segment is copied into a classic segment:
    a device-to-device copy of the tensor (bandwidth-bound; the copy's memory is
    extra until the original is dropped) plus two allocator toggles (~10 us each).
    The cache is released only if the copy landed in a cached expandable block,
    or if the driver could not be asked. CPU tensors are returned as they are
    (torch shares them through host shared memory, no pidfd involved).

    The copy is detached, contiguous in the tensor's memory format, and keeps
    ``requires_grad`` (a ``Parameter`` comes back as a plain tensor).

    Args:
        tensor: the tensor to share.

    Returns:
        ``tensor`` itself, or a copy in a classic segment on the same device.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        IpcUnavailableError: no classic segment can be had here (``cudaMallocAsync``).

    Scope: current thread; toggles the process-global allocator settings for the
    duration of the copy, like :func:`ipc_safe`.

    Example:
        >>> queue.put(hm.ipc_shareable(model.weight))   # doctest: +SKIP
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"ipc_shareable() takes a torch.Tensor, got {type(tensor).__name__}; "
            "call it once per tensor"
        )
    if disabled() or not _torch.is_device_tensor(tensor):
        return tensor
    capable = _torch.is_legacy_ipc_capable(tensor)
    if capable:
        return tensor
    if tensor.untyped_storage().nbytes() == 0:
        return tensor  # nothing to export
    blocker = ENGINE.classic_blocker()
    if blocker is not None:
        raise IpcUnavailableError(
            f"cannot make a copy of this tensor shareable without pidfd: {blocker}. "
            "Ship it through host memory (WeightBucket(fallback='host')) instead."
        )
    unknown = capable is None
    if unknown:
        info_once(
            "ipc-no-driver-query",
            "ipc_shareable: the CUDA driver cannot tell segment kinds here; copying "
            "with a cache release to be sure",
        )
    # With the driver's answer the cache is released only if the copy needs it (below).
    with IpcSafe(fallback="raise", release_cache=unknown):
        out = _safe_copy(tensor)
        if _torch.is_legacy_ipc_capable(out) is False:
            # The copy reused a cached free block of an expandable segment.
            del out
            drop_cached_blocks([max(tensor.get_device(), 0)])
            out = _safe_copy(tensor)
            if _torch.is_legacy_ipc_capable(out) is False:
                raise IpcUnavailableError(
                    "a copy made with expandable segments off still is not in a classic "
                    "segment; ship this tensor through host memory instead"
                )
    logger.debug("ipc_shareable: copied %d bytes into a classic segment", out.nbytes)
    return out


def allow_ptrace_from_any() -> bool:
    """Let any process of this user fetch this process's file descriptors (opt-in).

    Calls ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` in the *producer*. Under
    Yama ``ptrace_scope=1`` (Ubuntu's default) a consumer may ``pidfd_getfd`` only
    from its own descendants, so a rollout engine started by the trainer cannot
    import the trainer's expandable segments; this lifts that rule for this
    process.

    Security: any process running as the same user can then ptrace this process:
    read and write its memory (model weights, credentials, tokens in memory), and
    inject code. Yama's protection against a compromised same-user process is off
    for it until it exits. It does not help against a seccomp filter (the denial is
    then in the consumer) or ``ptrace_scope`` 2 or 3. Prefer :func:`ipc_safe` /
    :func:`ipc_shareable`, which need no ptrace at all; use this only where every
    process of the user is trusted. Never called by hybridmem itself.

    Returns:
        True when applied; False on non-Linux systems, without Yama (nothing to
        lift), or when the kernel refused (the reason is logged).

    Scope: this process, for the rest of its life (not undone). Thread-safe; a
    second call does nothing.

    Example:
        >>> hm.allow_ptrace_from_any()   # doctest: +SKIP
        True
    """
    global _ptracer_set
    with _ptracer_lock:
        if _ptracer_set:
            return True
        if not _linux.is_linux() or _linux.yama_ptrace_scope() is None:
            logger.info("allow_ptrace_from_any: no Yama here, nothing to allow")
            return False
        error = _linux.set_ptracer_any()
        if error is not None:
            logger.warning(
                "allow_ptrace_from_any: prctl(PR_SET_PTRACER) failed with %s",
                _linux.errno_name(error),
            )
            return False
        _ptracer_set = True
        logger.warning(
            "allow_ptrace_from_any: any process of this user may now ptrace process "
            "%d (needed for pidfd_getfd under Yama ptrace_scope=1)",
            os.getpid(),
        )
        return True


def _reset_for_tests() -> None:
    global _ptracer_set
    _ptracer_set = False
