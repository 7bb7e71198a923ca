"""Allocator settings: the setter and getter of each torch version, the snapshot, the backend."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

from hybridmem._errors import AllocatorSettingsError
from hybridmem._format import first_line
from hybridmem._torch.device import cuda_built, cuda_initialized
from hybridmem._torch.version import torch_version
from hybridmem._torch.write_watch import WriteWatch

# torch 2.10+ moved the setter to the accelerator-generic binding; the old
# ``torch.cuda.memory._set_allocator_settings`` still exists there but emits a
# FutureWarning. torch <= 2.9 only has the old one.
NEW_SETTER = "_accelerator_setAllocatorSettings"
# torch 2.12+ only: returns the *last string set* (env or setter), not the
# effective configuration.
GETTER = "_accelerator_getAllocatorSettings"


# Called on every real toggle: no typing constructs at run time (a ``cast`` to a
# subscripted Callable builds a new alias object on each call).
_SetterFn = Callable[[str], None]


def _new_setter() -> _SetterFn | None:
    fn: Any = getattr(torch._C, NEW_SETTER, None)
    return fn if callable(fn) else None


def _old_setter() -> Callable[[str], None] | None:
    # torch 2.1 - 2.9: a Python wrapper over ``torch._C._cuda_cudaCachingAllocator_
    # set_allocator_settings``, which CPU-only builds of those versions lack.
    fn = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if not callable(fn):
        return None
    if torch_version() < (2, 10) and not hasattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings"
    ):
        return None
    return cast(Callable[[str], None], fn)


def settings_setter_name() -> str | None:
    """Return the dotted name of the allocator-settings setter torch offers, or None."""
    if _new_setter() is not None:
        return "torch._C." + NEW_SETTER
    if _old_setter() is not None:
        return "torch.cuda.memory._set_allocator_settings"
    return None


def set_allocator_settings(settings: str) -> bool:
    """Apply an allocator settings string through torch's setter.

    Works before CUDA is initialised (torch parses the string into its config
    singleton; the allocator reads it when it creates segments).

    Args:
        settings: a ``key:value,...`` string in torch's grammar.

    Returns:
        True if a setter existed and accepted the string, False if this torch
        build has no setter.

    Raises:
        AllocatorSettingsError: torch rejected the string (``ValueError`` on
            torch 2.10+, ``RuntimeError`` before; both are mapped here).
    """
    new = _new_setter()
    try:
        if new is not None:
            new(settings)
            return True
        old = _old_setter()
        if old is None:
            return False
        if _OLD_NAME_WARNS:
            # On 2.10+ this path is never taken (the new setter exists); the filter
            # only guards odd builds so that torch's FutureWarning never reaches users.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                old(settings)
        else:  # torch <= 2.9: the old name is the only one, and says nothing
            old(settings)
        return True
    except _REFUSALS as exc:
        raise AllocatorSettingsError(
            f"torch rejected the allocator settings {settings!r}: {first_line(exc)}"
        ) from exc


# What torch's parser raises: ValueError (TORCH_CHECK_VALUE, 2.10+), RuntimeError
# (TORCH_CHECK and INTERNAL ASSERT; all errors before 2.10), IndexError (a C++
# std::out_of_range, e.g. stoull on "99999999999999999999").
_REFUSALS = (ValueError, RuntimeError, IndexError)


def last_allocator_settings() -> str | None:
    """Return the last settings string torch parsed, where this torch says it; else None.

    This is the env string at start-up or the last string given to the setter, by
    anyone, not the effective configuration; hybridmem uses it to see settings
    written outside it, at every scope entry and exit (hot path). torch 2.12+: its
    getter (microseconds). torch 2.10 - 2.11, once CUDA is initialised: the string
    noted where it is written (:class:`~hybridmem._torch.write_watch.WriteWatch`,
    started at the first read; nanoseconds), or, where a reference to the setter
    bypasses that, the ``PYTORCH_CUDA_ALLOC_CONF`` entry of the allocator snapshot's
    settings (a walk of every block). The getter's first call makes torch parse its
    env variable.

    Raises:
        AllocatorSettingsError: torch refused the env string on that first parse.
    """
    if _GETTER_FN is None:
        return _WATCH.last() if _WATCHED and (_WATCH.started or cuda_initialized()) else None
    try:
        value = _GETTER_FN()
    except _REFUSALS as exc:  # its first call parses the env, which may be malformed
        raise AllocatorSettingsError(
            f"torch refuses the allocator settings in its env: {first_line(exc)}"
        ) from exc
    return value if isinstance(value, str) else None


def _snapshot_settings_string() -> str | None:
    """The last settings string, from the snapshot (torch 2.10 - 2.11 with CUDA up)."""
    if not cuda_initialized():
        return None
    settings = snapshot_allocator_settings()
    value = settings.get("PYTORCH_CUDA_ALLOC_CONF") if settings is not None else None
    return value if isinstance(value, str) else None


def settings_writes_watched() -> bool:
    """Whether this process sees settings writes without reading the snapshot (hot path).

    True on torch 2.12+ (its getter) and on torch 2.10 - 2.11 once the write watch is in
    place; False where reads go to the allocator snapshot or nothing can be read.
    """
    return _GETTER_FN is not None or _WATCH.watching


def stop_watching_settings_writes() -> None:
    """Put torch's own setter back where the write watch replaced it (tests; teardown)."""
    _WATCH.stop()


def sees_settings_writes() -> bool:
    """Whether :func:`last_allocator_settings` can see a string set by anyone, now.

    True on torch 2.12+ (its getter), and on torch 2.10 - 2.11 once CUDA is
    initialised (the write watch, or the snapshot where the watch cannot start); False
    otherwise (earlier torch, or no CUDA yet).
    """
    return _GETTER_FN is not None or (_WATCHED and cuda_initialized())


# Bound once: it is called on every scope entry and exit (hot path).
_GETTER_FN: Callable[[], object] | None = getattr(torch._C, GETTER, None)
if not callable(_GETTER_FN):
    _GETTER_FN = None
# torch 2.10+ deprecated the old setter's name (a FutureWarning); catching it costs
# microseconds, so only where it can be raised.
_OLD_NAME_WARNS = torch_version() >= (2, 10)
# torch 2.10 - 2.11 (the setter exists, the getter does not): writes are watched.
_WATCHED = _GETTER_FN is None and torch_version() >= (2, 10)
_WATCH = WriteWatch(torch._C, NEW_SETTER, _snapshot_settings_string)


def snapshot() -> dict[str, Any] | None:
    """Return ``torch.cuda.memory._snapshot()`` when CUDA is initialised, else None.

    Costly (walks every segment): for diagnostics and tests, never a hot path.
    """
    if not cuda_initialized():
        return None
    fn = getattr(torch.cuda.memory, "_snapshot", None)
    if not callable(fn):
        return None
    result = fn()
    return result if isinstance(result, dict) else None


def record_memory_history(enabled: bool) -> bool:
    """Record (or stop recording) where each allocation was made, for :func:`snapshot`.

    ``torch.cuda.memory._record_memory_history`` (torch 2.1+; private, and the one
    way to get stack frames per block). Costs a few microseconds per allocation:
    diagnostics only. Returns False where this torch lacks it.
    """
    fn = getattr(torch.cuda.memory, "_record_memory_history", None)
    if not callable(fn):
        return False
    try:
        fn("all" if enabled else None, max_entries=100_000)
    except (TypeError, RuntimeError):
        return False
    return True


def snapshot_allocator_settings() -> dict[str, Any] | None:
    """Return the effective allocator settings torch reports in a snapshot.

    Available on torch builds whose snapshot carries ``allocator_settings``
    (2.5+), once CUDA is initialised; None otherwise.
    """
    snap = snapshot()
    if snap is None:
        return None
    settings = snap.get("allocator_settings")
    return dict(settings) if isinstance(settings, dict) else None


def runtime_allocator_backend() -> str | None:
    """Return the CUDA allocator backend torch is running (``native`` / ``cudaMallocAsync``).

    None on CPU-only builds. Does not create a CUDA context.
    """
    if not cuda_built():
        return None
    fn = getattr(torch._C, "_cuda_getAllocatorBackend", None)
    if not callable(fn):
        return None
    try:
        value = fn()
    except RuntimeError:
        return None
    return value if isinstance(value, str) else None
