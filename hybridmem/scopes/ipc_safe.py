"""ipc_safe: what a block or call allocates can be shared over CUDA IPC without pidfd.

A tensor in an expandable segment is exported as a POSIX file descriptor that the
consumer must fetch with ``pidfd_getfd``; containers without ptrace rights deny it
(``RuntimeError: pidfd_getfd: Operation not permitted``; verl #2846, pytorch #165685,
ROLL #417). A tensor in a classic segment goes through ``cudaIpcGetMemHandle`` and
needs no pidfd. Inside :func:`ipc_safe`, expandable segments are off.

Whether classic-segment CUDA IPC works here is decided in one place,
:func:`classic_ipc_blocker`: a CUDA device, an allocator that can switch, and the IPC
probe's verdict where one was made (:func:`hybridmem.ipc_capabilities` notes it here
with :func:`note_probe`, so this module never imports the probe).

Scope: process-global allocator settings; the probe's verdicts are process-global too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args, overload

from hybridmem import _torch
from hybridmem._checks import check_bool
from hybridmem._errors import IpcUnavailableError
from hybridmem._log import warn_once
from hybridmem._names import suggests_keywords
from hybridmem.allocator.state import ENGINE
from hybridmem.scopes.allocator import AllocatorScope

__all__ = [
    "Fallback",
    "IpcSafe",
    "check_fallback",
    "classic_ipc_blocker",
    "forget_probes",
    "ipc_safe",
    "note_probe",
    "passed_over",
    "refused",
]

_F = TypeVar("_F", bound=Callable[..., Any])

#: What to do when CUDA IPC cannot be used: ``"auto"`` falls back to host memory
#: with one warning, ``"host"`` always uses host memory, ``"raise"`` raises
#: :class:`~hybridmem.IpcUnavailableError`.
Fallback = Literal["auto", "host", "raise"]
_FALLBACKS: tuple[str, ...] = get_args(Fallback)

# device -> why classic CUDA IPC failed the probe there (only failures are kept)
_broken: dict[int, str] = {}
_broken_lock = threading.Lock()


def check_fallback(fallback: object) -> Fallback:
    """Return ``fallback`` if valid, else raise naming the allowed values."""
    if not isinstance(fallback, str):
        raise TypeError(
            f"fallback must be one of {', '.join(map(repr, _FALLBACKS))}; got {fallback!r} "
            f"({type(fallback).__name__})"
        )
    if fallback not in _FALLBACKS:
        raise ValueError(
            f"fallback must be one of {', '.join(map(repr, _FALLBACKS))}; got {fallback!r}"
        )
    return fallback  # type: ignore[return-value]


def note_probe(device: int, classic_ipc: bool | None, reason: str | None) -> None:
    """Record the IPC probe's verdict on classic CUDA IPC for ``device`` (False: broken)."""
    with _broken_lock:
        if classic_ipc is False:
            _broken[device] = reason or "?"
        else:
            _broken.pop(device, None)


def forget_probes() -> None:
    """Forget every probe verdict (a fresh probe notes its own)."""
    with _broken_lock:
        _broken.clear()


def classic_ipc_blocker(device: int, *, probe_verdicts: bool = True) -> str | None:
    """What stops classic-segment CUDA IPC on ``device`` here, or None when it can be used.

    No CUDA device (or a CPU build of torch), an allocator that cannot give classic
    segments (``cudaMallocAsync``; no settings setter while expandable segments are on),
    or, with ``probe_verdicts``, the IPC probe having found it broken.

    Example:
        >>> classic_ipc_blocker(0)   # doctest: +SKIP
        'this torch is built without CUDA'
    """
    if not _torch.cuda_available():
        built = _torch.cuda_built()
        return "no CUDA device is visible" if built else "this torch is built without CUDA"
    blocker = ENGINE.classic_blocker()
    if blocker is None and probe_verdicts:
        why = _broken.get(device)
        if why is not None:
            blocker = f"the IPC probe found CUDA IPC broken here ({why})"
    return blocker


def refused(who: str, device: int, blocker: str) -> str:
    """The error for ``fallback="raise"`` when classic CUDA IPC is blocked."""
    return (
        f"{who}: CUDA IPC cannot be used on device {device}: {blocker}. Pass "
        "fallback='host' (or 'auto') to ship tensors through host shared memory instead."
    )


def passed_over(who: str, device: int, blocker: str) -> str:
    """The warning for ``fallback="auto"`` when classic CUDA IPC is blocked."""
    return (
        f"CUDA IPC cannot be used on device {device} ({blocker}); falling back to host "
        "shared memory, which costs a device-to-host and a host-to-device copy"
    )


class IpcSafe(AllocatorScope):
    """Scope in which new allocations can be shared without pidfd (see :func:`ipc_safe`)."""

    def __init__(self, *, fallback: Fallback = "auto", release_cache: bool = True) -> None:
        super().__init__()
        self.fallback = check_fallback(fallback)
        self._changes = {"expandable_segments": "False"}
        self._release_cache = check_bool("release_cache", release_cache)
        self._force = False
        self._label = f"ipc_safe(fallback={fallback!r})"
        self.transport: Literal["cuda", "host"] = "cuda"

    def _enter(self) -> object:
        # Decided before the switch: "raise" must leave the allocator untouched.
        device = _torch.current_device()
        index = 0 if device is None else device
        blocker = None if self.fallback == "host" else classic_ipc_blocker(index)
        if self.fallback == "host":
            self.transport = "host"
        elif blocker is None:
            self.transport = "cuda"
        elif self.fallback == "raise":
            raise IpcUnavailableError(refused("ipc_safe", index, blocker))
        else:
            if _torch.cuda_available():  # without any GPU, host memory is all there is
                warn_once(f"cuda-blocked:{blocker}", passed_over("ipc_safe", index, blocker))
            self.transport = "host"
        return super()._enter()


@overload
def ipc_safe(func: _F, /) -> _F: ...


@overload
def ipc_safe(func: None = None, /, *, fallback: Fallback = "auto") -> IpcSafe: ...


@suggests_keywords
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
