"""The backend registry: which primitives each phase runs, per inference engine."""

from __future__ import annotations

import difflib
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any, Literal

from hybridmem._log import logger, warn_once
from hybridmem._phase_names import ALIASES, PHASES, canonical_phase
from hybridmem.engine.backends.adapters import EngineAdapter

__all__ = [
    "ACTIONS",
    "ACTION_ARGS",
    "ALIASES",
    "ENTRY_POINT_GROUP",
    "PHASES",
    "WHEN",
    "BackendProfile",
    "Step",
    "canonical_phase",
    "get_backend",
    "list_backends",
    "register_backend",
    "restore_registry",
]

#: What a step can do, and when each kind runs.
ACTIONS: Mapping[str, str] = MappingProxyType(
    {
        "expandable_segments": "scope: expandable segments on or off (args: enabled)",
        "ipc_safe": "scope: new allocations IPC-exportable without pidfd (args: fallback)",
        "release_cache": "action: release cached memory (args: collect_garbage, ipc_collect)",
        "await_free": "action: wait until device free memory stops rising (args: timeout_s)",
        "offload": "action: offload the trainer state (args: offloader, groups)",
        "reload": "action: reload the trainer state (args: offloader, groups, by)",
    }
)
#: The arguments each action takes (a step's ``args``, an override's dict keys).
ACTION_ARGS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "expandable_segments": ("enabled", "release_cache", "force"),
        "ipc_safe": ("fallback",),
        "release_cache": ("device", "sync", "collect_garbage", "ipc_collect"),
        "await_free": ("device", "timeout_s"),
        "offload": ("offloader", "groups"),
        "reload": ("offloader", "groups", "by"),
    }
)
_SCOPES = ("expandable_segments", "ipc_safe")
# The group the docs name (docs/phases.md). The code once read
# "hybridmem.engine.backends", which no doc named, and ignored plugins silently (#22).
ENTRY_POINT_GROUP = "hybridmem.backends"
_BACKEND_ENV = "HYBRIDMEM_BACKEND"

When = Literal["enter", "exit", "scope"]
#: When a step runs: entered for the whole phase, or run once on entry or on exit.
WHEN: tuple[When, ...] = ("enter", "exit", "scope")


def nearest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_step_args(where: str, action: str, args: object) -> Mapping[str, Any]:
    """Return ``args`` if it is a mapping of ``action``'s own argument names; else raise.

    Raises:
        TypeError: ``args`` is not a mapping, or a key is not a str.
        ValueError: a key ``action`` does not take (the message names the nearest one).
    """
    if not isinstance(args, Mapping):
        raise TypeError(
            f"{where}: args must be a dict of {action}'s arguments, got {args!r} "
            f"({type(args).__name__})"
        )
    known = ACTION_ARGS[action]
    for key in args:
        if not isinstance(key, str):
            raise TypeError(f"{where}: argument names are str, got {key!r}")
        if key not in known:
            raise ValueError(
                f"{where}: {action} takes no argument {key!r}{nearest(key, known)}; "
                f"it takes {', '.join(known)}"
            )
    return args


def _check_str(where: str, field_name: str, value: object, *, empty: bool = True) -> None:
    if not isinstance(value, str) or (not empty and not value):
        kind = "a str" if empty else "a non-empty str"
        raise TypeError(f"{where}: {field_name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class Step:
    """One primitive in a phase's recipe.

    Attributes:
        name: the step's name in this recipe (what overrides refer to).
        action: one of :data:`ACTIONS`.
        when: ``"scope"`` (active for the whole phase; scopes are entered in recipe
            order and left in reverse), ``"enter"`` or ``"exit"`` (run once there).
        args: keyword arguments of the action.
        why: the evidence for the step (issue, PR or code reference).
        versions: the engine versions it applies to.
    """

    name: str
    action: str
    when: When
    args: Mapping[str, Any] = field(default_factory=dict)
    why: str = ""
    versions: str = ""

    def __post_init__(self) -> None:
        _check_str("a step", "name", self.name, empty=False)
        where = f"step {self.name!r}"
        _check_str(where, "action", self.action)
        if self.action not in ACTIONS:
            raise ValueError(
                f"{where}: unknown action {self.action!r}{nearest(self.action, ACTIONS)}; "
                f"known: {', '.join(sorted(ACTIONS))}"
            )
        scope = self.action in _SCOPES
        if self.when not in WHEN or scope != (self.when == "scope"):
            need = "'scope'" if scope else "'enter' or 'exit'"
            raise ValueError(
                f"{where}: action {self.action!r} needs when={need}, got {self.when!r}"
            )
        args = check_step_args(where, self.action, self.args)
        _check_str(where, "why", self.why)
        _check_str(where, "versions", self.versions)
        object.__setattr__(self, "args", MappingProxyType(dict(args)))


@dataclass(frozen=True)
class BackendProfile:
    """What each phase does for one inference engine, and why.

    Attributes:
        name: the backend's name (``"vllm"``, ``"sglang"``, ...).
        description: one line.
        recipes: phase name -> steps (phases left out do nothing).
        notes: phase name -> the versions and evidence behind its recipe.
        adapter: what wraps a raw engine of this backend (a vLLM ``LLM``, an
            SGLang ``Engine``) in an :class:`EngineAdapter` for
            :class:`hybridmem.HybridSwitch`; None: callers pass an adapter. A plugin
            that brings an engine brings its adapter here.

    Example:
        >>> hm.register_backend(hm.BackendProfile(   # doctest: +SKIP
        ...     "myengine", "my engine", {"rollout": (...)}, adapter=MyEngineAdapter))
    """

    name: str
    description: str
    recipes: Mapping[str, tuple[Step, ...]]
    notes: Mapping[str, str] = field(default_factory=dict)
    adapter: Callable[[Any], EngineAdapter] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"a backend's name must be a str, got {self.name!r}")
        if not self.name:
            raise ValueError("a backend needs a non-empty name")
        where = f"backend {self.name!r}"
        _check_str(where, "description", self.description)
        for field_name in ("recipes", "notes"):
            value = getattr(self, field_name)
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"{where}: {field_name} must be a dict keyed by phase name, got "
                    f"{value!r} ({type(value).__name__})"
                )
        for phase, note in self.notes.items():
            _check_str(f"{where}, notes[{phase!r}]", "the note", note)
        if self.adapter is not None and not callable(self.adapter):
            raise TypeError(
                f"backend {self.name!r}: adapter must be callable (an EngineAdapter "
                f"subclass or a function returning one) or None, got {self.adapter!r}"
            )
        recipes: dict[str, tuple[Step, ...]] = {}
        for phase, steps in self.recipes.items():
            if phase not in PHASES:
                hint = nearest(phase, PHASES) if isinstance(phase, str) else ""
                raise ValueError(
                    f"{where}: unknown phase {phase!r}{hint}; phases: {', '.join(PHASES)}"
                )
            if isinstance(steps, Step) or not isinstance(steps, (tuple, list)):
                raise TypeError(
                    f"{where}, phase {phase!r}: the recipe must be a tuple of Step, got "
                    f"{steps!r}; a single step is written (step,)"
                )
            steps = tuple(steps)
            if not all(isinstance(s, Step) for s in steps):
                raise TypeError(f"{where}, phase {phase!r}: steps must be Step")
            names = [s.name for s in steps]
            if len(set(names)) != len(names):
                raise ValueError(f"{where}, phase {phase!r}: step names repeat")
            recipes[phase] = steps
        object.__setattr__(self, "recipes", MappingProxyType(recipes))
        object.__setattr__(self, "notes", MappingProxyType(dict(self.notes)))

    def recipe(self, phase: str) -> tuple[Step, ...]:
        """The steps of ``phase`` (canonical name or alias); empty if none."""
        return self.recipes.get(canonical_phase(phase), ())


_registry: dict[str, BackendProfile] = {}
_lock = threading.Lock()
_entry_points_loaded = False


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


def list_backends() -> list[str]:
    """Return the names of the registered backends (built-in and entry points), sorted."""
    _load_entry_points()
    with _lock:
        return sorted(_registry)


def get_backend(name: str | None = None) -> BackendProfile:
    """Return the registered profile ``name``.

    Args:
        name: a backend name; None means ``HYBRIDMEM_BACKEND`` if set, else ``"default"``.

    Raises:
        TypeError: ``name`` is not a str or None.
        ValueError: no such backend (the message lists the known ones).
    """
    if name is None:
        name = os.environ.get(_BACKEND_ENV, "").strip() or "default"
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str or None, got {name!r}")
    _load_entry_points()
    with _lock:
        profile = _registry.get(name)
        known = sorted(_registry)
    if profile is None:
        raise ValueError(
            f"unknown backend {name!r}; known: {', '.join(known)} (register others with "
            f"hm.register_backend or the {ENTRY_POINT_GROUP!r} entry-point group)"
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
