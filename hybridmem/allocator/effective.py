"""What the allocator runs with: each setting, its value as torch reads it, and its source."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridmem._errors import AllocatorSettingsError
from hybridmem.allocator.grammar import KEYS, format_settings
from hybridmem.allocator.rules import (
    ALLOC_CONF,
    CUDA_ALLOC_CONF,
    TorchRules,
)

__all__ = [
    "ENV_VARS",
    "AllocatorState",
    "Effective",
    "Setting",
    "Source",
]


#: The environment variables torch reads, in torch 2.10+'s order of precedence:
#: the first one set is read whole and the other ignored (torch <= 2.9 reads only
#: ``PYTORCH_CUDA_ALLOC_CONF`` for CUDA).
ENV_VARS = (CUDA_ALLOC_CONF, ALLOC_CONF)

Source = Literal["default", "env", "runtime", "outside"]


@dataclass(frozen=True)
class Setting:
    """One allocator setting: its value and where that value came from.

    Attributes:
        key: the setting name, as torch spells it.
        value: the value in torch's syntax (``"True"``, ``"256"``, ``"[256:4,>:1]"``),
            as torch reads it (whitespace dropped).
        source: ``"default"``, ``"env"``, ``"runtime"`` (hybridmem set it) or
            ``"outside"`` (a write torch was given outside hybridmem: vLLM's pool,
            verl's ``set_expandable_segments``, a direct call).
        origin: the env variable, ``"set_allocator_defaults"``, the scope that set
            it (e.g. ``"expandable_segments(True)"``), ``"written outside hybridmem"``
            or ``"torch default"``.
    """

    key: str
    value: str
    source: Source
    origin: str


class Effective(dict[str, Setting]):
    """Merged settings by key; never mutated once built, so what it means is cached."""

    __slots__ = ("_state", "children", "memo")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._state: tuple[TorchRules, dict[str, Any]] | None = None
        # (the view torch had, the string that takes torch from it to this one)
        self.memo: tuple[Effective, str] | None = None
        # overlays built on this view, by (changes, origin): a scope entered again
        # and again (a decorated train_step) reuses its view, state and string
        self.children: dict[tuple[tuple[tuple[str, str], ...], str], Effective] = {}

    def items_for(self) -> list[tuple[str, str]]:
        """What torch is given for this view: every runtime key with its value."""
        return [
            (k, s.value)
            for k, s in self.items()
            if k not in KEYS or KEYS[k].runtime  # "backend" is fixed at start-up
        ]

    def state(self, rules: TorchRules) -> dict[str, Any]:
        """torch's settings once this view is applied (every other key at its default).

        Raises:
            AllocatorSettingsError: this torch refuses the view's settings together.
        """
        cached = self._state
        if cached is not None and cached[0] is rules:  # one TorchRules per torch
            return cached[1]
        outcome = rules.run(format_settings(self.items_for()))
        if not outcome.accepted:
            names = ", ".join(f"{k}={s.value} [{s.origin}]" for k, s in self.items())
            raise AllocatorSettingsError(
                f"{outcome.error}; these settings cannot hold together ({names})"
            )
        self._state = (rules, outcome.state)
        return outcome.state


@dataclass(frozen=True)
class AllocatorState:
    """The effective, merged CUDA allocator settings and where each came from.

    What torch runs with, layer by layer: env settings, overlaid by process defaults
    (:func:`set_allocator_defaults`), overlaid by active scopes
    (:func:`expandable_segments`, :func:`allocator_settings`) and by writes torch was
    given outside hybridmem (vLLM's pool toggle, verl's ``set_expandable_segments``,
    a direct call), in the order they happened. A write from outside stays in force
    while hybridmem's scopes enter and exit around it; each setting's ``source``
    says which layer set it.

    Attributes:
        settings: every setting that is set, by key: what torch runs with.
        backend: ``"native"`` or ``"cudaMallocAsync"``.
        env: the raw env strings that are set, by variable name.
        applied: the last string hybridmem gave torch's setter (None: never).
        setter: the torch setter in use, or None when this build has none.
        scopes: descriptions of the active scopes, outermost first.
        env_variable: the variable torch reads its settings from (None: neither
            is set).
        ignored_env: variables that are set but that this torch does not read.
        torch: the torch whose rules apply (``"torch 2.11"``).
        reads: env values that torch reads as another value, by key: what torch
            reads (``max_split_size_mb:-3`` is ``"unlimited"``, ``25.5`` is ``"25"``);
            :meth:`shown` puts it first, with the raw value beside it.
        pending: settings of hybridmem's layers that torch is not running with now,
            by key: a write from outside reset them (torch's setter resets
            ``max_split_size_mb`` and the like on every call); hybridmem gives them
            back at its next change. Empty almost always.
        sees_outside: whether this process can see a write made outside hybridmem
            (torch 2.12+'s getter; on torch 2.10 - 2.11, once CUDA is initialised,
            hybridmem's watch on torch's setter). Where it cannot, ``settings`` is what
            hybridmem and the env set.
        known: the settings this torch version has (torch's order; empty: every
            setting hybridmem knows), listed with their defaults by :meth:`as_dict`.

    Example:
        >>> import hybridmem as hm
        >>> cfg = hm.allocator_state()
        >>> cfg.expandable_segments, cfg.source("max_split_size_mb")   # doctest: +SKIP
        (False, 'env')
    """

    settings: Mapping[str, Setting]
    backend: str
    env: Mapping[str, str]
    applied: str | None
    setter: str | None
    scopes: tuple[str, ...] = field(default=())
    env_variable: str | None = None
    ignored_env: tuple[str, ...] = field(default=())
    torch: str = ""
    reads: Mapping[str, str] = field(default_factory=dict)
    pending: Mapping[str, Setting] = field(default_factory=dict)
    sees_outside: bool = True
    known: tuple[str, ...] = field(default=())

    def __getitem__(self, key: str) -> str:
        return self.get(key).value

    def __contains__(self, key: object) -> bool:
        return key in self.settings

    def __iter__(self) -> Iterator[str]:
        return iter(self.settings)

    def get(self, key: str) -> Setting:
        """Return the setting for ``key``: its value or torch's default, and source.

        Raises:
            KeyError: ``key`` is neither set nor a setting hybridmem knows.
        """
        if key in self.settings:
            return self.settings[key]
        spec = KEYS.get(key)
        if spec is None:
            raise KeyError(f"{key!r} is not set and not a known allocator setting")
        return Setting(key, spec.shown_default, "default", "torch default")

    def source(self, key: str) -> Source:
        """Return ``"default"``, ``"env"``, ``"runtime"`` or ``"outside"`` for ``key``."""
        return self.get(key).source

    @property
    def expandable_segments(self) -> bool:
        """Whether new segments are expandable under this configuration."""
        return self.get("expandable_segments").value == "True"

    def to_settings_string(self) -> str:
        """Return the settings as one string in torch's syntax (without defaults)."""
        return format_settings((k, s.value) for k, s in self.settings.items())

    def shown(self, key: str) -> str:
        """``key``'s value as torch reads it; a misread raw value beside it.

        Example:
            >>> # PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:-3 in the environment
            >>> cfg.shown("max_split_size_mb")  # doctest: +SKIP
            'unlimited (written -3)'
        """
        value = self.get(key).value
        read = self.reads.get(key)
        return value if read is None else f"{read} (written {value})"

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict, every setting of this torch included with its source."""
        known = self.known or tuple(KEYS)
        keys = list(self.settings) + [k for k in known if k not in self.settings]
        return {
            "torch": self.torch,
            "backend": self.backend,
            "env": dict(self.env),
            "env_variable": self.env_variable,
            "ignored_env": list(self.ignored_env),
            "applied": self.applied,
            "setter": self.setter,
            "scopes": list(self.scopes),
            "sees_outside": self.sees_outside,
            "pending": {
                k: {"value": s.value, "source": s.source, "origin": s.origin}
                for k, s in self.pending.items()
            },
            "settings": {
                k: {
                    "value": s.value,
                    "reads": self.reads.get(k, s.value),
                    "shown": self.shown(k),
                    "source": s.source,
                    "origin": s.origin,
                }
                for k in keys
                for s in (self.get(k),)
            },
        }

    def __str__(self) -> str:
        reads = self.env_variable or "no env variable (none is set)"
        rows = [f"backend: {self.backend}   {self.torch} reads {reads}"]
        rows += [
            f"  ignored: {name} (set, but this torch does not read it)" for name in self.ignored_env
        ]
        for key, item in self.as_dict()["settings"].items():
            rows.append(f"  {key:34} {item['shown']:>18}  [{item['source']}: {item['origin']}]")
        for key, setting in self.pending.items():
            rows.append(
                f"  pending: {key}:{setting.value} [{setting.origin}] (reset by a write "
                "outside hybridmem; given back at hybridmem's next change)"
            )
        if self.scopes:
            rows.append("active scopes: " + " > ".join(self.scopes))
        if not self.sees_outside:
            rows.append("writes outside hybridmem: not seen by this torch until CUDA is up")
        return "\n".join(rows)
