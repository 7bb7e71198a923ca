"""What a backend profile is: the steps each phase runs for one inference engine.

A :class:`BackendProfile` names, per phase, the :class:`Step` s to run (a scope to
enter, or an action at entry or exit) with their arguments and the evidence behind
them; both are frozen and checked when made (an unknown action or argument names the
nearest known one). :mod:`hybridmem.scopes.recipes` holds the built-in profiles,
:mod:`hybridmem.scopes.registry` the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from hybridmem._names import nearest, suggests_keywords
from hybridmem._phase_names import ALIASES, PHASES, canonical_phase
from hybridmem.scopes.engines import EngineAdapter

__all__ = [
    "ACTIONS",
    "ACTION_ARGS",
    "ALIASES",
    "PHASES",
    "RELOAD_WAYS",
    "WHEN",
    "BackendProfile",
    "Step",
    "When",
    "canonical_phase",
    "check_step_args",
]

#: What a step can do, and when each kind runs.
ACTIONS: Mapping[str, str] = MappingProxyType(
    {
        "expandable_segments": "scope: expandable segments on or off (args: enabled)",
        "ipc_safe": "scope: new allocations IPC-exportable without pidfd (args: fallback)",
        "suspend_communicators": "scope: NCCL communicators' memory given back, collective "
        "(args: enabled, groups, timeout_s)",
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
        "suspend_communicators": ("enabled", "groups", "timeout_s"),
        "release_cache": ("device", "sync", "collect_garbage", "ipc_collect"),
        "await_free": ("device", "timeout_s"),
        "offload": ("offloader", "groups"),
        "reload": ("offloader", "groups", "by"),
    }
)
#: How a ``reload`` step's offloader copies back (``Offloader.reload(by=...)``).
RELOAD_WAYS = ("copy_engine", "kernel")
_SCOPES = ("expandable_segments", "ipc_safe", "suspend_communicators")

When = Literal["enter", "exit", "scope"]
#: When a step runs: entered for the whole phase, or run once on entry or on exit.
WHEN: tuple[When, ...] = ("enter", "exit", "scope")


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


@suggests_keywords
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
        opt_in: left out of the phase unless an override names it (``True`` or a dict
            of its arguments): a step that changes what every rank must do, such as
            ``suspend_communicators``.
    """

    name: str
    action: str
    when: When
    args: Mapping[str, Any] = field(default_factory=dict)
    why: str = ""
    versions: str = ""
    opt_in: bool = False

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
        if self.action == "reload" and args.get("by", "kernel") not in RELOAD_WAYS:
            raise ValueError(
                f"{where}: reload's by must be one of {', '.join(map(repr, RELOAD_WAYS))}, "
                f"got {args['by']!r}"
            )
        _check_str(where, "why", self.why)
        _check_str(where, "versions", self.versions)
        if not isinstance(self.opt_in, bool):
            raise TypeError(f"{where}: opt_in must be True or False, got {self.opt_in!r}")
        object.__setattr__(self, "args", MappingProxyType(dict(args)))


@suggests_keywords
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

    def adapt(self, engine: object) -> EngineAdapter:
        """``engine`` as an :class:`EngineAdapter`: given as one, or wrapped by :attr:`adapter`.

        Raises:
            TypeError: no adapter here and ``engine`` is not one, or the adapter
                returned something else.
        """
        if isinstance(engine, EngineAdapter):
            return engine
        if self.adapter is None:
            raise TypeError(
                f"wrap the engine in an adapter (hm.VLLMEngine, hm.SGLangEngine or an "
                f"hm.EngineAdapter subclass); backend {self.name!r} has no default adapter "
                "(a BackendProfile names one with adapter=...)"
            )
        adapted = self.adapter(engine)
        if not isinstance(adapted, EngineAdapter):
            raise TypeError(
                f"backend {self.name!r}: its adapter returned {adapted!r}, not an hm.EngineAdapter"
            )
        return adapted

    def recipe(self, phase: str) -> tuple[Step, ...]:
        """The steps of ``phase`` (canonical name or alias); empty if none."""
        return self.recipes.get(canonical_phase(phase), ())
