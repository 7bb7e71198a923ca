"""A tensor shareable without pidfd after the fact (ipc_shareable), and the ptrace opt-in.

What a block allocates is made shareable by :func:`hybridmem.scopes.ipc_safe.ipc_safe`;
a tensor that already lives in an expandable segment is copied into a classic one
here (:func:`ipc_shareable`), under the same scope.
"""

from __future__ import annotations

import os
import threading

import torch

from hybridmem import _torch
from hybridmem._env import disabled
from hybridmem._errors import IpcUnavailableError
from hybridmem._log import info_once, logger
from hybridmem._names import suggests_keywords
from hybridmem._platform import linux as _linux
from hybridmem.allocator.state import ENGINE, drop_cached_blocks
from hybridmem.scopes.ipc_safe import IpcSafe

__all__ = ["allow_ptrace_from_any", "ipc_shareable"]

_ptracer_lock = threading.Lock()
_ptracer_set = False


def _safe_copy(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.detach().clone(memory_format=torch.preserve_format)
    if tensor.requires_grad:
        out.requires_grad_(True)
    return out


@suggests_keywords
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


@suggests_keywords
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
