"""The backend registry: the registered profiles by name, built-in ones and plugins'.

The built-in profiles (:mod:`hybridmem.scopes.recipes`) are registered when this
module loads; third-party ones come from the ``hybridmem.backends`` entry points at
the first :func:`list_backends` / :func:`get_backend`. Nothing here imports an
inference engine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from importlib import metadata

from hybridmem._log import logger, warn_once
from hybridmem._names import nearest, suggests_keywords
from hybridmem.scopes.profiles import BackendProfile
from hybridmem.scopes.recipes import BUILTIN

__all__ = [
    "ENTRY_POINT_GROUP",
    "get_backend",
    "list_backends",
    "register_backend",
    "reset_registry",
    "restore_registry",
]

# The group the docs name (docs/phases.md).
ENTRY_POINT_GROUP = "hybridmem.backends"
_BACKEND_ENV = "HYBRIDMEM_BACKEND"
_registry: dict[str, BackendProfile] = {}
_lock = threading.Lock()
_entry_points_loaded = False


@suggests_keywords
def register_backend(profile: BackendProfile, *, replace: bool = False) -> BackendProfile:
    """Register ``profile`` under its name.

    Args:
        profile: the :class:`BackendProfile`.
        replace: allow replacing a registered profile of the same name.

    Returns:
        ``profile``.

    Raises:
        TypeError: ``profile`` is not a BackendProfile.
        ValueError: the name is taken and ``replace`` is false.

    Scope: process-wide, thread-safe.

    Example:
        >>> hm.register_backend(hm.BackendProfile("mine", "my engine", {}))  # doctest: +SKIP
    """
    if not isinstance(profile, BackendProfile):
        raise TypeError(f"register_backend takes a BackendProfile, got {type(profile).__name__}")
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be True or False, got {replace!r}")
    with _lock:
        if profile.name in _registry and not replace:
            raise ValueError(
                f"a backend named {profile.name!r} is registered already; pass replace=True "
                "to replace it"
            )
        _registry[profile.name] = profile
    logger.debug("backend %r registered", profile.name)
    return profile


def _distribution(point: metadata.EntryPoint) -> str:
    """``name version`` of the distribution that declares ``point``, as pip names it."""
    dist = getattr(point, "dist", None)  # None for an EntryPoint made by hand
    if dist is None:
        return "an unknown distribution"
    return f"the distribution {dist.metadata['Name']} {dist.version}"


def _load_profile(point: metadata.EntryPoint) -> tuple[BackendProfile | None, str, str]:
    """Load one entry point: (profile, "", "") or (None, what went wrong, the fix)."""
    entry = f"{point.name} = {point.value}"
    try:
        loaded = point.load()
    except Exception as exc:
        return (
            None,
            f"importing {point.value} failed ({type(exc).__name__}: {exc})",
            f"install what it needs, or correct its entry point ({entry})",
        )
    if callable(loaded) and not isinstance(loaded, BackendProfile):
        try:
            loaded = loaded()
        except Exception as exc:
            return (
                None,
                f"calling {point.value}() failed ({type(exc).__name__}: {exc})",
                "fix that function, which must return a BackendProfile",
            )
    if not isinstance(loaded, BackendProfile):
        return (
            None,
            f"it gave a {type(loaded).__name__}, not a BackendProfile",
            f"make its entry point ({entry}) name a BackendProfile or a function returning one",
        )
    return loaded, "", ""


def _load_entry_points() -> None:
    """Register third-party profiles from the ``hybridmem.backends`` entry points, once.

    A plugin that fails to load (import error, wrong type, a name already taken) is
    one warning naming its distribution and the fix; the others still load.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        profile, problem, fix = _load_profile(point)
        if profile is not None:
            with _lock:
                taken = profile.name in _registry
                if not taken:
                    _registry[profile.name] = profile
            if not taken:
                logger.debug("backend %r registered from entry point %r", profile.name, point.name)
                continue
            problem = f"its backend name {profile.name!r} is taken already"
            fix = "give its BackendProfile another name"
        where = _distribution(point)
        warn_once(
            f"entry-point:{point.name}:{point.value}",
            f"backend plugin {point.name!r} from {where} (entry-point group "
            f"{ENTRY_POINT_GROUP!r}) was not loaded: {problem}. Fix: {fix}, or uninstall "
            "that distribution. The other backends are loaded.",
        )


@suggests_keywords
def list_backends() -> list[str]:
    """Return the names of the registered backends (built-in and entry points), sorted."""
    _load_entry_points()
    with _lock:
        return sorted(_registry)


@suggests_keywords
def get_backend(name: str | None = None) -> BackendProfile:
    """Return the registered profile ``name``.

    Args:
        name: a backend name; None means ``HYBRIDMEM_BACKEND`` if set, else ``"default"``.

    Raises:
        TypeError: ``name`` is not a str or None.
        ValueError: no such backend (the message lists the known ones).
    """
    from_env = name is None and bool(os.environ.get(_BACKEND_ENV, "").strip())
    if name is None:
        name = os.environ.get(_BACKEND_ENV, "").strip() or "default"
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str or None, got {name!r}")
    _load_entry_points()
    with _lock:
        profile = _registry.get(name)
        known = sorted(_registry)
    if profile is None:
        where = f"{_BACKEND_ENV}={name}" if from_env else f"unknown backend {name!r}"
        fix = f"; set {_BACKEND_ENV} to one of them or unset it" if from_env else ""
        raise ValueError(
            f"{where}{' names an unknown backend' if from_env else ''}{nearest(name, known)}; "
            f"known: {', '.join(known)}{fix} (backend names are case-sensitive; register "
            f"others with hm.register_backend or the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    return profile


def restore_registry(builtin: Iterable[BackendProfile]) -> None:
    """Forget every registered backend but ``builtin``; entry points load again on next use.

    Scope: process-wide, thread-safe. For test suites that register profiles.
    """
    global _entry_points_loaded
    with _lock:
        _registry.clear()
        for profile in builtin:
            _registry[profile.name] = profile
    _entry_points_loaded = False


def reset_registry() -> None:
    """Forget every registered backend but the built-in ones (and reload entry points)."""
    restore_registry(BUILTIN)


for _profile in BUILTIN:
    register_backend(_profile)
