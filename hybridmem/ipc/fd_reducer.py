"""Multiprocessing queues and pipes that carry expandable-segment tensors by fd.

``torch.multiprocessing`` pickles a CUDA tensor with its own reducer, which for an
expandable segment sends pid and fd numbers that the consumer must fetch with
``pidfd_getfd`` (denied in containers). Inside :func:`ipc_fd_sharing` the
producer's pickler uses hybridmem's reducer instead, registered with the public
``multiprocessing.reduction.ForkingPickler.register`` (torch is not patched): a
CUDA tensor in an expandable segment is sent as an :func:`hybridmem.ipc_export`
handle and rebuilt in the consumer by :meth:`TensorHandle.open`; every other
tensor goes through torch's reducer, unchanged. The consumer needs nothing but
hybridmem installed (the rebuild function is found by name when it unpickles).

Scope: process-global (the pickler registry), in the producer; re-entrant and
thread-safe (a count of entries under a lock: the first entry registers, the last
exit restores the reducers that were there before).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar, overload

import torch

from hybridmem import _torch
from hybridmem._log import logger
from hybridmem._names import suggests_keywords
from hybridmem._platform.stdlib import forking_reducer
from hybridmem._scope import ScopedContext
from hybridmem.ipc.export import TensorHandle, ipc_export

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["IpcFdSharing", "ipc_fd_sharing", "rebuild_exported"]

_lock = threading.Lock()
_depth = 0
_saved: dict[type, Any] = {}


def rebuild_exported(handle: TensorHandle, parameter: bool) -> torch.Tensor:
    """Open ``handle`` where a queue unpickles it (the consumer's half of the reducer)."""
    tensor = handle.open()
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=handle.requires_grad)
    return tensor


def _reduce(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    if _torch.is_device_tensor(tensor) and _torch.is_legacy_ipc_capable(tensor) is False:
        if tensor.requires_grad and not tensor.is_leaf:
            raise RuntimeError(
                "ipc_fd_sharing: a non-leaf tensor that requires grad cannot cross "
                "processes (its graph stays here, as torch.multiprocessing says too); "
                "send tensor.detach()"
            )
        parameter = isinstance(tensor, torch.nn.Parameter)
        try:
            handle = ipc_export(tensor)  # reads the storage and metadata only
        except Exception as exc:
            # A queue pickles in its feeder thread, which prints the traceback and
            # drops the item: say here what was lost, in hybridmem's log too.
            logger.error(
                "ipc_fd_sharing: a %s tensor of %s could not be exported and was not sent: %s",
                tensor.dtype,
                list(tensor.shape),
                exc,
            )
            raise
        return rebuild_exported, (handle, parameter)
    previous = _saved.get(type(tensor)) or _saved.get(torch.Tensor)
    if previous is None:  # nothing was registered before: torch's own reducer
        return _torch.export_cuda_tensor(tensor)
    result: tuple[Any, tuple[Any, ...]] = previous(tensor)
    return result


_TYPES: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)


class IpcFdSharing(ScopedContext):
    """Scope in which pickled expandable-segment tensors travel by fd (:func:`ipc_fd_sharing`)."""

    def __repr__(self) -> str:
        return "ipc_fd_sharing()"

    def _enter(self) -> object:
        global _depth
        import torch.multiprocessing  # noqa: F401  (registers torch's reducers first)

        with _lock:
            if _depth == 0:
                for cls in _TYPES:
                    _saved[cls] = forking_reducer(cls)
                    ForkingPickler.register(cls, _reduce)
            _depth += 1
        return None

    def _exit(self, token: object, exc: BaseException | None) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0:
                for cls in _TYPES:
                    previous = _saved.pop(cls, None)
                    if previous is not None:
                        ForkingPickler.register(cls, previous)


@overload
def ipc_fd_sharing(func: _F, /) -> _F: ...


@overload
def ipc_fd_sharing(func: None = None, /) -> IpcFdSharing: ...


@suggests_keywords
def ipc_fd_sharing(func: Any = None, /) -> Any:
    """Send expandable-segment CUDA tensors through multiprocessing queues and pipes by fd.

    Inside, a CUDA tensor in an expandable segment that a ``torch.multiprocessing``
    queue, pipe or ``Connection.send`` pickles is exported with
    :func:`hybridmem.ipc_export` and opened in the consumer from the handle (no
    ``pidfd_getfd``: works where a container denies it). Other tensors pickle as
    torch pickles them. Each pickled tensor is one export, opened once.

    A ``multiprocessing.Queue`` pickles in a feeder thread after ``put()``
    returns: keep the scope open until the consumer got the tensor (wrap the
    whole loop), or use a ``SimpleQueue`` or ``Pipe``, which pickle inside
    ``put()``/``send()``.

    Scope: process-global, in the producer; re-entrant, thread-safe; context
    manager and decorator in every form, with or without parentheses.

    Args:
        func: what ``@hm.ipc_fd_sharing`` without parentheses decorates.

    Returns:
        An :class:`IpcFdSharing` context/decorator (``func`` decorated, when given).

    Example:
        >>> with hm.ipc_fd_sharing():                 # doctest: +SKIP
        ...     with hm.expandable_segments(True):
        ...         weight = torch.randn(1 << 26, device="cuda")
        ...     queue.put(weight)                     # consumer: queue.get() is the same memory
        ...     done.wait()
    """
    scope = IpcFdSharing()
    return scope if func is None else scope(func)
