"""Exception and warning classes raised by hybridmem."""

from __future__ import annotations

__all__ = ["AllocatorSettingsError", "HybridMemWarning", "IpcUnavailableError"]


class HybridMemWarning(UserWarning):
    """Warning category for misuse and degraded operation in hybridmem.

    Filter it like any other warning category::

        import warnings, hybridmem as hm
        warnings.simplefilter("error", hm.HybridMemWarning)
    """


class AllocatorSettingsError(ValueError):
    """A CUDA caching-allocator setting was malformed or refused by torch.

    It subclasses :class:`ValueError`, so ``except ValueError`` catches it on
    every torch version (torch itself raises ``ValueError`` on 2.10+ and
    ``RuntimeError`` before).
    """


class IpcUnavailableError(RuntimeError):
    """CUDA IPC cannot carry a tensor here, and no fallback was allowed.

    The message says why (allocator backend, probe result, pidfd denial) and what
    to do (usually ``fallback="host"`` or :func:`hybridmem.ipc_safe`).
    """
