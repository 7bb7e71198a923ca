"""The ``hybridmem`` logger and once-per-process warning helpers."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
import types
import warnings

from hybridmem._errors import HybridMemWarning

__all__ = [
    "info_once",
    "log_once",
    "logger",
    "reset_once",
    "user_stacklevel",
    "warn_at",
    "warn_once",
    "warn_user",
]

logger = logging.getLogger("hybridmem")

_seen: set[str] = set()
_seen_lock = threading.Lock()


def _first_time(key: str) -> bool:
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


# Frames a warning must not point at: hybridmem's own, the import machinery (a warning
# raised while hybridmem's lazy face imports a module), and contextlib's wrappers
# (ExitStack.enter_context, @contextmanager) between a user's line and a scope.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIPPED_FILES = tuple(os.path.abspath(m.__file__ or "") for m in (contextlib, importlib))


def _skipped(frame: types.FrameType) -> bool:
    filename = frame.f_code.co_filename
    return filename.startswith((_PACKAGE_DIR, "<frozen importlib")) or filename in _SKIPPED_FILES


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by our caller name the user's line.

    Counted for a ``warnings.warn`` call made by the function that calls this one:
    the first frame outside hybridmem (and outside the import machinery and
    contextlib), wherever in the package the warning starts, so no call site counts
    its own depth (hand-counted depths drift as code moves). Python 3.12's
    ``skip_file_prefixes`` does the same for one prefix; 3.10 and 3.11 lack it.
    """
    frame = sys._getframe(1)  # the caller of warnings.warn
    level = 1
    while _skipped(frame) and frame.f_back is not None:
        frame = frame.f_back
        # warnings.warn itself steps over the import machinery's frames: not counted.
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):
            level += 1
    return level


def warn_user(message: str) -> None:
    """Emit ``message`` as a :class:`HybridMemWarning` pointing at the user's line."""
    warnings.warn(message, HybridMemWarning, stacklevel=user_stacklevel())


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a :class:`HybridMemWarning` the first time ``key`` is seen.

    Python's own warning registry deduplicates per call site only; misuse that can
    happen from many call sites (a degraded torch build, say) should still warn once
    per process, which is what ``key`` is for. The warning names the user's line
    (:func:`user_stacklevel`).
    """
    if _first_time("warn:" + key):
        warnings.warn(message, HybridMemWarning, stacklevel=user_stacklevel())


def warn_at(key: str, message: str, code: types.CodeType) -> None:
    """Emit ``message`` once, pointing at where ``code`` is defined (the user's function).

    For misuse seen at call time whose cause is in a definition (a decorator stacked
    in the wrong order): the call's stack runs through the user's other wrappers, so
    no stack level names the line to change; the definition does.
    """
    if _first_time("warn:" + key):
        warnings.warn_explicit(
            message,
            HybridMemWarning,
            filename=code.co_filename,
            lineno=code.co_firstlineno,
            module=code.co_filename,
        )


def log_once(key: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` on the ``hybridmem`` logger the first time ``key`` is seen.

    For facts (a WARNING here is something outside hybridmem, not misuse of it: misuse
    goes through :func:`warn_once`).
    """
    if _first_time(f"log{level}:{key}"):
        logger.log(level, message)


def info_once(key: str, message: str) -> None:
    """Log ``message`` at INFO once per process (:func:`log_once` at INFO)."""
    log_once(key, message)


def reset_once() -> None:
    """Forget which once-only messages were emitted (for tests)."""
    with _seen_lock:
        _seen.clear()
