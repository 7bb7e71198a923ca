"""The ``hybridmem`` logger and once-per-process warning helpers."""

from __future__ import annotations

import logging
import threading
import warnings

from hybridmem._errors import HybridMemWarning

__all__ = ["info_once", "logger", "reset_once", "warn_once"]

logger = logging.getLogger("hybridmem")

_seen: set[str] = set()
_seen_lock = threading.Lock()


def _first_time(key: str) -> bool:
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """Emit ``message`` as a :class:`HybridMemWarning` the first time ``key`` is seen.

    Python's own warning registry deduplicates per call site only; misuse that can
    happen from many call sites (a degraded torch build, say) should still warn once
    per process, which is what ``key`` is for.
    """
    if _first_time("warn:" + key):
        warnings.warn(message, HybridMemWarning, stacklevel=stacklevel)


def info_once(key: str, message: str) -> None:
    """Log ``message`` at INFO on the ``hybridmem`` logger once per process."""
    if _first_time("info:" + key):
        logger.info(message)


def reset_once() -> None:
    """Forget which once-only messages were emitted (for tests)."""
    with _seen_lock:
        _seen.clear()
