"""CUDA caching-allocator control that never drops a user's settings.

torch's allocator-settings setter resets ``max_split_size_mb``,
``garbage_collection_threshold`` and ``roundup_power2_divisions`` on every call
unless the same call repeats them, and leaves ``expandable_segments`` unchanged
when the string omits it. So every hand-written ``set_expandable_segments`` drops
the user's settings, and "restoring" by re-applying the env string leaves
expandable segments on. hybridmem keeps one merged view (:class:`AllocatorConfig`:
env, then process defaults, then active scopes) and always applies it whole,
writing back explicitly every key torch would otherwise keep.

torch's rules are the running version's own (:mod:`hybridmem._torch_rules`, a
model of its parser checked against torch 2.4 - 2.13): which env variable it
reads, what it accepts, what each call resets. Every string is run through that
model before torch sees it, so a string torch would refuse is refused before
anything is applied; if torch refuses one anyway, the settings before it are
written back (torch keeps the part of a refused string it had read).

Scope: allocator settings are process-global (every device, every thread). One
re-entrant lock serialises changes. Scopes may exit in any order: the settings
are derived from the scopes still active, so the final state is right even when
two threads or tasks interleave, and a :class:`HybridMemWarning` names both.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from hybridmem import _torch
from hybridmem._decorate import ScopedContext
from hybridmem._env import disabled
from hybridmem._errors import AllocatorSettingsError, HybridMemWarning
from hybridmem._log import info_once, logger, warn_once
from hybridmem._settings import KEYS, format_settings, normalize_value
from hybridmem._torch_rules import (
    ALLOC_CONF,
    CUDA_ALLOC_CONF,
    Outcome,
    TorchRules,
)
from hybridmem._validate import check_bool
from hybridmem.cache import drop_cached_blocks

__all__ = [
    "ENV_VARS",
    "AllocatorConfig",
    "AllocatorSettings",
    "ExpandableSegments",
    "Setting",
    "allocator_config",
    "allocator_settings",
    "configure_allocator",
    "expandable_segments",
]

#: The environment variables torch reads, in torch 2.10+'s order of precedence:
#: the first one set is read whole and the other ignored (torch <= 2.9 reads only
#: ``PYTORCH_CUDA_ALLOC_CONF`` for CUDA).
ENV_VARS = (CUDA_ALLOC_CONF, ALLOC_CONF)

Source = Literal["default", "env", "runtime"]


@dataclass(frozen=True)
class Setting:
    """One allocator setting: its value and where that value came from.

    Attributes:
        key: the setting name, as torch spells it.
        value: the value in torch's syntax (``"True"``, ``"256"``, ``"[256:4,>:1]"``),
            as torch reads it (whitespace dropped).
        source: ``"default"``, ``"env"`` or ``"runtime"``.
        origin: the env variable, ``"configure_allocator"``, the scope that set
            it (e.g. ``"expandable_segments(True)"``), ``"set outside hybridmem"``
            or ``"torch default"``.
    """

    key: str
    value: str
    source: Source
    origin: str


class _Effective(dict[str, Setting]):
    """Merged settings by key; never mutated once built, so what it means is cached."""

    __slots__ = ("_state", "children", "memo")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._state: tuple[TorchRules, dict[str, Any]] | None = None
        # (the view torch had, the string that takes torch from it to this one)
        self.memo: tuple[_Effective, str] | None = None
        # overlays built on this view, by (changes, origin): a scope entered again
        # and again (a decorated train_step) reuses its view, state and string
        self.children: dict[tuple[tuple[tuple[str, str], ...], str], _Effective] = {}

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
class AllocatorConfig:
    """The effective, merged CUDA allocator settings and where each came from.

    This is the single truth hybridmem applies: env settings, overlaid by process
    defaults (:func:`configure_allocator`), overlaid by active scopes
    (:func:`expandable_segments`, :func:`allocator_settings`), in entry order.

    Attributes:
        settings: every setting that is set, by key.
        backend: ``"native"`` or ``"cudaMallocAsync"``.
        env: the raw env strings that are set, by variable name.
        applied: the last string hybridmem gave torch's setter (None: never).
        setter: the torch setter in use, or None when this build has none.
        scopes: descriptions of the active scopes, outermost first.
        env_variable: the variable torch reads its settings from (None: neither
            is set).
        ignored_env: variables that are set but that this torch does not read.
        torch: the torch whose rules apply (``"torch 2.11"``).

    Example:
        >>> cfg = hm.allocator_config()
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
        """Return ``"default"``, ``"env"`` or ``"runtime"`` for ``key``."""
        return self.get(key).source

    @property
    def expandable_segments(self) -> bool:
        """Whether new segments are expandable under this configuration."""
        return self.get("expandable_segments").value == "True"

    def to_settings_string(self) -> str:
        """Return the settings as one string in torch's syntax (without defaults)."""
        return format_settings((k, s.value) for k, s in self.settings.items())

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict, every known key included with its source."""
        keys = list(self.settings) + [k for k in KEYS if k not in self.settings]
        return {
            "torch": self.torch,
            "backend": self.backend,
            "env": dict(self.env),
            "env_variable": self.env_variable,
            "ignored_env": list(self.ignored_env),
            "applied": self.applied,
            "setter": self.setter,
            "scopes": list(self.scopes),
            "settings": {
                k: {"value": s.value, "source": s.source, "origin": s.origin}
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
            rows.append(f"  {key:34} {item['value']:>18}  [{item['source']}: {item['origin']}]")
        if self.scopes:
            rows.append("active scopes: " + " > ".join(self.scopes))
        return "\n".join(rows)


# --------------------------------------------------------------------------- #
# Process-global state
# --------------------------------------------------------------------------- #


class _Layer:
    """One active change: a scope, with the effective settings once it applies."""

    __slots__ = ("changes", "effective", "label", "thread")

    def __init__(self, changes: dict[str, str], label: str, effective: _Effective) -> None:
        self.changes = changes
        self.label = label
        self.thread = threading.get_ident()
        self.effective = effective


def _same(base: _Effective, key: str, value: str) -> bool:
    setting = base.get(key)
    if setting is None:
        spec = KEYS.get(key)
        return spec is not None and spec.default == value
    return setting.value == value


_MAX_CHILDREN = 64


def _overlay(base: _Effective, changes: Mapping[str, str], origin: str) -> _Effective:
    for key, value in changes.items():
        if not _same(base, key, value):
            break
    else:
        return base  # unchanged: share, so "no change" costs no copy and no setter call
    cache_key = (tuple(changes.items()), origin)
    merged = base.children.get(cache_key)
    if merged is not None:
        return merged
    merged = _Effective(base)
    for key, value in changes.items():
        merged.pop(key, None)  # moves to the end: a later setting is written later
        merged[key] = Setting(key, value, "runtime", origin)
    if len(base.children) >= _MAX_CHILDREN:
        base.children.clear()
    base.children[cache_key] = merged
    return merged


_SIZE_KEYS = frozenset(
    {
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "large_segment_size_mb",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
    }
)
_FLOAT_KEYS = frozenset({"garbage_collection_threshold", "per_process_memory_fraction"})


def _misreads(outcome: Outcome) -> list[str]:
    """Values in an env string that torch reads differently from how they look."""
    found = list(outcome.notes)
    for key, value in outcome.items:
        if key in _SIZE_KEYS and not re.fullmatch(r"\d+", value):
            read = outcome.state.get(key)
            shown = "unlimited" if read is None or read >= 1 << 40 else read
            found.append(f"{key}:{value} is read as {shown} (write a plain whole number)")
        elif key in _FLOAT_KEYS:
            try:
                float(value)
            except ValueError:
                found.append(f"{key}:{value} is read as {outcome.state.get(key)}")
    return found


class _AllocatorState:
    """The merged allocator view and what has been applied to torch (process-global)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        """Forget every runtime change (tests; a fresh process starts here)."""
        with self.lock:
            self._env_key: tuple[str | None, ...] | None = None
            self._env_effective = _Effective()
            self._env_error: AllocatorSettingsError | None = None
            self._env_variable: str | None = None
            self._env_ignored: tuple[str, ...] = ()
            self._env_explicit: dict[str, str] = {}  # key -> env var
            self._env_frozen = False
            self._env_expandable_false: str | None = None
            self._torch_env_text = ""  # what torch 2.12+'s getter says before any change
            self._defaults: _Effective | None = None  # configure_allocator / external
            self._layers: list[_Layer] = []
            self._applied: str | None = None
            self._current: _Effective | None = None  # what torch has; None = env state
            self._can_apply_cache: bool | None = None
            self._rules: TorchRules | None = None

    # ------------------------------------------------------------------ #
    # The rules of the torch at hand
    # ------------------------------------------------------------------ #
    def rules(self) -> TorchRules:
        """torch's settings rules for this process's torch (version, build, backend)."""
        version, built = _torch.torch_version(), _torch.cuda_built()
        rules = self._rules
        if rules is None or rules.version != version or rules.device != built:
            running = _torch.runtime_allocator_backend() or "native"
            rules = self._rules = TorchRules(version, built, running)
        return rules

    # ------------------------------------------------------------------ #
    # Env
    # ------------------------------------------------------------------ #
    def _read_env(self) -> None:
        if self._env_frozen:
            return
        raw = tuple(os.environ.get(name) for name in ENV_VARS)
        if raw != self._env_key:
            self._parse_env(raw)
        # torch reads these variables once, when its allocator config is first
        # used; asking its getter (2.12+) makes it read them now. From then on
        # changes to os.environ affect neither torch nor hybridmem.
        if self._env_error is None and (
            _torch.last_allocator_settings() is not None or _torch.cuda_initialized()
        ):
            self._env_frozen = True

    def _parse_env(self, raw: tuple[str | None, ...]) -> None:
        rules = self.rules()
        present = {name: text for name, text in zip(ENV_VARS, raw) if text is not None}
        name, ignored = rules.env_variable(present)
        text = present.get(name, "") if name is not None else ""
        effective = _Effective()
        explicit: dict[str, str] = {}
        error: AllocatorSettingsError | None = None
        notes: list[str] = []
        if name is not None:
            outcome = TorchRules(rules.version, rules.device, None).run(text)
            if not outcome.accepted:
                error = AllocatorSettingsError(
                    f"{name}={text!r}: {outcome.error}. torch refuses this value (it raises "
                    f"at its first CUDA allocation); fix it or unset {name} "
                    "(`hybridmem doctor` shows how torch reads it)"
                )
            else:
                for key, value in outcome.items:
                    effective.pop(key, None)  # a later duplicate wins, as in torch
                    effective[key] = Setting(key, value, "env", name)
                    explicit[key] = name
                notes = _misreads(outcome)
        # State first, warnings last: under `-W error` a warning must not leave
        # half-parsed state behind.
        self._env_key = raw
        self._env_variable = name
        self._env_ignored = tuple(ignored)
        self._env_error = error
        self._torch_env_text = text
        self._env_effective = effective
        self._env_explicit = explicit
        setting = effective.get("expandable_segments")
        self._env_expandable_false = (
            name if setting is not None and setting.value == "False" else None
        )
        for other in ignored:
            why = (
                f"{name} is set, and torch reads only the first of {', '.join(ENV_VARS)} that is"
                if name is not None
                else f"{rules.label} reads only {CUDA_ALLOC_CONF} for CUDA"
            )
            warn_once(
                f"env-ignored:{other}",
                f"{other} is set but {rules.label} ignores it: {why}. hybridmem follows "
                f"torch: {other}={present[other]!r} has no effect. Move what you need into "
                f"{name or CUDA_ALLOC_CONF} (or unset {other}).",
                stacklevel=5,
            )
        for note in notes:
            warn_once(
                f"env-misread:{name}:{note}",
                f"{name}={text!r}: with {rules.label}, {note}; hybridmem reads it the same way",
                stacklevel=5,
            )

    # ------------------------------------------------------------------ #
    # Views
    # ------------------------------------------------------------------ #
    def _base(self) -> _Effective:
        if not self._env_frozen:
            self._read_env()
        if self._env_error is not None:
            raise self._env_error
        return self._defaults if self._defaults is not None else self._env_effective

    def _top(self) -> _Effective:
        return self._layers[-1].effective if self._layers else self._base()

    def _recompute(self, start: int = 0) -> None:
        base = self._layers[start - 1].effective if start > 0 else self._base()
        for layer in self._layers[start:]:
            layer.effective = _overlay(base, layer.changes, layer.label)
            base = layer.effective

    def env_expandable_false(self) -> str | None:
        """The env variable holding an explicit ``expandable_segments:False``, if any."""
        with self.lock:
            self._read_env()
            return self._env_expandable_false

    def env_explicit(self) -> dict[str, str]:
        with self.lock:
            self._base()
            return dict(self._env_explicit)

    def backend(self) -> str:
        runtime = _torch.runtime_allocator_backend()
        if runtime is not None:
            return runtime
        with self.lock:
            self._read_env()
            setting = self._env_effective.get("backend")
        return setting.value if setting is not None else "native"

    def classic_blocker(self) -> str | None:
        """Why new allocations cannot be made in classic segments here (None: they can)."""
        if self.backend() == "cudaMallocAsync":
            return (
                "the CUDA allocator backend is cudaMallocAsync, whose pools cannot be "
                "exported with cudaIpcGetMemHandle"
            )
        with self.lock:
            expandable_now = _expandable(self._top())
        if expandable_now and _torch.settings_setter_name() is None:
            return (
                f"expandable segments are on and torch "
                f"{'.'.join(map(str, _torch.torch_version()))} has no allocator-settings "
                "setter to switch them off"
            )
        return None

    def config(self) -> AllocatorConfig:
        with self.lock:
            self._adopt_external()
            top = self._top()
            return AllocatorConfig(
                settings=MappingProxyType(dict(top)),
                backend=self.backend(),
                env=MappingProxyType(
                    {n: os.environ[n] for n in ENV_VARS if os.environ.get(n) is not None}
                ),
                applied=self._applied,
                setter=_torch.settings_setter_name(),
                scopes=tuple(layer.label for layer in self._layers),
                env_variable=self._env_variable,
                ignored_env=self._env_ignored,
                torch=self.rules().label,
            )

    # ------------------------------------------------------------------ #
    # Changes
    # ------------------------------------------------------------------ #
    def _adopt_external(self) -> None:
        """Notice settings that code outside hybridmem gave torch (torch 2.12+ only)."""
        if self._applied is None:
            # The env first: torch reports the env string until a change, and a
            # malformed one is hybridmem's clear error, not the getter's raw one.
            self._base()
        last = _torch.last_allocator_settings()
        if last is None:
            return
        expected = self._applied if self._applied is not None else self._torch_env_text
        if last == expected:
            return
        rules = self.rules()
        current = self._current if self._current is not None else self._env_effective
        outcome = rules.run(last, current.state(rules))
        self._applied = last
        if not outcome.accepted:
            logger.warning(
                "allocator settings %r were given to torch outside hybridmem and refused by "
                "it (%s); hybridmem keeps its own view",
                last,
                outcome.error,
            )
            return
        logger.warning(
            "allocator settings were changed outside hybridmem to %r; hybridmem keeps "
            "every other setting and adopts these as the new process defaults",
            last,
        )
        external = [(k, v) for k, v in outcome.items if k != "backend"]
        self._defaults = _overlay(self._base(), dict(external), "set outside hybridmem")
        # Model what torch now has: the keys it resets went back to their defaults,
        # the string's keys are set, every other key kept its value.
        model = _Effective({k: v for k, v in current.items() if k not in rules.reset_keys})
        for key, value in external:
            model.pop(key, None)
            model[key] = Setting(key, value, "runtime", "set outside hybridmem")
        self._current = model
        self._recompute()

    def _settings_string(self, target: _Effective, current: _Effective) -> str:
        """The string that takes torch from ``current``'s settings to ``target``'s.

        Every key of ``target``, plus its default for each key torch keeps when a
        string omits it and that ``current`` had changed (``expandable_segments``
        above all). The three keys torch resets on every call need nothing.

        Raises:
            AllocatorSettingsError: a key must go back to a default torch refuses, or
                torch would refuse the string.
        """
        memo = target.memo
        if memo is not None and memo[0] is current:
            return memo[1]
        rules = self.rules()
        items = target.items_for()
        named = {k for k, _ in items}
        now, fresh = current.state(rules), rules.defaults
        for key in sorted(rules.kept_keys - named):
            if now.get(key) == fresh.get(key):
                continue
            text = rules.default_text(key)
            if text is None:
                raise AllocatorSettingsError(
                    f"{key} cannot go back to its default ({fresh.get(key)}): {rules.label} "
                    f"refuses {key}:{fresh.get(key)}. Set {key} in {CUDA_ALLOC_CONF} or with "
                    "hm.configure_allocator() instead of in a scope"
                )
            items.append((key, text))
        text = format_settings(items)
        outcome = rules.run(text, now)  # never give torch a string it would refuse
        if not outcome.accepted:  # pragma: no cover - the view's own check runs first
            raise AllocatorSettingsError(f"{outcome.error}; nothing was applied")
        target.memo = (current, text)  # a toggle entered again reuses the checked string
        return text

    def sync(self, *, release_cache: bool) -> None:
        """Apply the top view to torch if it differs from what torch has."""
        target = self._top()
        current = self._current
        if current is None:  # nothing applied yet: torch has what it parsed from the env
            current = self._current = self._env_effective
        if target is current:
            return
        rules = self.rules()
        wanted = target.state(rules)  # refuses settings that cannot hold together
        if wanted == current.state(rules):
            self._current = target  # same torch state; next time the identity check hits
            return
        if not self._can_apply():
            self._current = target
            return
        text = self._settings_string(target, current)  # checked by the model of torch
        if (
            release_cache
            and _torch.cuda_initialized()
            and _expandable(current) != _expandable(target)
        ):
            # Cached free blocks of the old kind would be reused by new tensors.
            drop_cached_blocks(_torch.initialized_devices())
        try:
            _torch.set_allocator_settings(text)
        except AllocatorSettingsError as exc:
            self._roll_back(current, text, exc)
            raise
        self._env_frozen = True
        self._applied = text
        self._current = target
        logger.debug("allocator settings applied: %s", text)

    def _roll_back(self, current: _Effective, refused: str, exc: AllocatorSettingsError) -> None:
        """torch refused ``refused`` after reading part of it: write ``current`` back whole."""
        rules = self.rules()
        items = current.items_for()
        named = {k for k, _ in items}
        fresh = rules.defaults
        tried = dict(rules.run(refused, current.state(rules)).items)
        kept = []
        for key in sorted(rules.kept_keys - named):
            text = rules.default_text(key)
            if text is not None:
                items.append((key, text))
            elif key in tried:
                kept.append(
                    f"torch may keep {key}:{tried[key]} (its default {fresh.get(key)} "
                    "cannot be written back)"
                )
        restore = format_settings(items)
        try:
            _torch.set_allocator_settings(restore)
        except AllocatorSettingsError as again:
            logger.error("could not put the allocator settings back to %r: %s", restore, again)
            exc.args = (
                f"{exc}. Putting the settings before it back failed too ({again}): torch "
                "now has part of the refused string",
            )
            return
        self._applied = restore
        self._env_frozen = True
        extra = f"; {'; '.join(kept)}" if kept else ""
        exc.args = (f"{exc}. hybridmem put the settings before it back{extra}",)

    def _can_apply(self) -> bool:
        if self._can_apply_cache is None or not self._env_frozen:
            self._can_apply_cache = self._check_can_apply()
        return self._can_apply_cache

    def _check_can_apply(self) -> bool:
        if _torch.settings_setter_name() is None:
            warn_once(
                "no-setter",
                f"torch {'.'.join(map(str, _torch.torch_version()))} has no allocator-settings "
                "setter; hybridmem's allocator toggles do nothing in this process",
            )
            return False
        if self.backend() == "cudaMallocAsync":
            warn_once(
                "async-backend",
                "the CUDA allocator backend is cudaMallocAsync, which has no expandable "
                "segments or caching-allocator settings; hybridmem's allocator toggles do "
                "nothing (remove backend:cudaMallocAsync to use them)",
            )
            return False
        return True

    def push(self, changes: dict[str, str], label: str, *, release_cache: bool) -> _Layer:
        with self.lock:
            self._adopt_external()
            layers = self._layers
            top = layers[-1].effective if layers else self._base()
            layer = _Layer(changes, label, _overlay(top, changes, label))
            if layer.effective is not top:
                rules = self.rules()
                # Refuse what torch would refuse, before anything is applied...
                if layer.effective.state(rules) != top.state(rules):
                    # ...including an exit that could not go back.
                    self._settings_string(top, layer.effective)
            layers.append(layer)
            current = self._current if self._current is not None else self._env_effective
            if layer.effective is current:
                return layer  # nothing to apply (the common "no change" entry)
            try:
                self.sync(release_cache=release_cache)
            except BaseException:
                layers.remove(layer)
                raise
            return layer

    def pop(self, layer: _Layer, *, release_cache: bool) -> None:
        with self.lock:
            layers = self._layers
            if layers and layers[-1] is layer:  # the usual, LIFO case
                layers.pop()
                self._adopt_external()
                if (layers[-1].effective if layers else self._base()) is not self._current:
                    self.sync(release_cache=release_cache)
                return
            index = next(i for i, item in enumerate(layers) if item is layer)
            later = layers[index + 1 :]
            del layers[index]
            if later:
                self._recompute(index)
            self._adopt_external()
            # Apply first, warn after: under `-W error` the warning must not keep
            # torch on the settings of a scope that has exited.
            self.sync(release_cache=release_cache)
        if later:
            names = ", ".join(f"{x.label} (thread {x.thread})" for x in later)
            warnings.warn(
                f"{layer.label} (thread {layer.thread}) exited while {names}, "
                "entered after it, is still active: scopes exited out of order, as when "
                "two threads or tasks toggle the allocator at once. The settings are "
                "still correct (derived from the scopes still active), but each scope "
                "no longer sees only its own change.",
                HybridMemWarning,
                stacklevel=4,
            )

    def set_defaults(self, changes: dict[str, str], *, release_cache: bool) -> None:
        with self.lock:
            self._adopt_external()
            previous = self._defaults
            self._defaults = _overlay(self._base(), changes, "configure_allocator")
            try:
                self._defaults.state(self.rules())
                self._recompute()
                self.sync(release_cache=release_cache)
            except BaseException:
                self._defaults = previous
                self._recompute()
                raise


def _expandable(effective: _Effective) -> bool:
    setting = effective.get("expandable_segments")
    return setting is not None and setting.value == "True"


_STATE = _AllocatorState()


def allocator_config() -> AllocatorConfig:
    """Return the effective allocator settings and the source of each.

    Reads the env the way this torch does: torch 2.10+ reads
    ``PYTORCH_CUDA_ALLOC_CONF`` when it is set (even empty), else
    ``PYTORCH_ALLOC_CONF``, and ignores the other (``ignored_env`` names it, and a
    :class:`HybridMemWarning` says so once); torch <= 2.9 reads only
    ``PYTORCH_CUDA_ALLOC_CONF``. Values are as torch reads them. Merged with the
    process defaults and the active scopes. Cheap: no CUDA call, no snapshot.

    Returns:
        An immutable :class:`AllocatorConfig`.

    Raises:
        AllocatorSettingsError: the env variable torch reads is malformed or holds
            a value torch refuses (the message names the variable, the value and
            the fix).

    Example:
        >>> print(hm.allocator_config())   # doctest: +SKIP
    """
    return _STATE.config()


def _respect_env(changes: dict[str, str], *, force: bool, who: str) -> dict[str, str]:
    """Drop an enable of expandable segments that the user's env forbids explicitly."""
    if changes.get("expandable_segments") != "True":
        return changes
    var = _STATE.env_expandable_false()
    if var is None:
        return changes
    if force:
        info_once(
            "force-enable",
            f"{who}: force=True overrides the explicit expandable_segments:False in {var}",
        )
        return changes
    info_once(
        "respect-env",
        f"{who}: kept expandable segments off because {var} sets expandable_segments:False "
        "explicitly; pass force=True to override",
    )
    return {k: v for k, v in changes.items() if k != "expandable_segments"}


class _AllocatorScope(ScopedContext):
    """A scoped overlay on the process allocator settings."""

    _changes: dict[str, str]
    _release_cache: bool
    _force: bool
    _label: str  # repr, computed once: it is needed on every entry

    def __repr__(self) -> str:
        return self._label

    def _enter(self) -> object:
        changes = self._changes
        if "expandable_segments" in changes:
            changes = _respect_env(changes, force=self._force, who=self._label)
        return _STATE.push(changes, self._label, release_cache=self._release_cache)

    def _exit(self, token: object, exc: BaseException | None) -> None:
        _STATE.pop(token, release_cache=self._release_cache)  # type: ignore[arg-type]


class ExpandableSegments(_AllocatorScope):
    """Scoped switch of expandable segments (see :func:`expandable_segments`)."""

    def __init__(self, enabled: bool, *, release_cache: bool = True, force: bool = False) -> None:
        super().__init__()
        self.enabled = check_bool("enabled", enabled)
        self._release_cache = check_bool("release_cache", release_cache)
        self._force = check_bool("force", force)
        self._changes = {"expandable_segments": str(enabled)}
        extra = ", force=True" if force else ""
        extra += "" if release_cache else ", release_cache=False"
        self._label = f"expandable_segments({enabled}{extra})"


class AllocatorSettings(_AllocatorScope):
    """Scoped allocator settings (see :func:`allocator_settings`)."""

    def __init__(self, **settings: object) -> None:
        super().__init__()
        self._changes = _normalize(settings, who="allocator_settings")
        self._release_cache = True
        self._force = False
        inner = ", ".join(f"{k}={v}" for k, v in self._changes.items())
        self._label = f"allocator_settings({inner})"


def _normalize(settings: Mapping[str, object], *, who: str) -> dict[str, str]:
    changes: dict[str, str] = {}
    for key, value in settings.items():
        spec = KEYS.get(key)
        if spec is not None and not spec.runtime:
            raise ValueError(
                f"{who}: {key!r} cannot change after start-up; set it in "
                f"{CUDA_ALLOC_CONF} before the process starts"
            )
        changes[key] = normalize_value(key, value, _STATE.rules())
    return changes


def expandable_segments(
    enabled: bool, *, release_cache: bool = True, force: bool = False
) -> ExpandableSegments:
    """Switch expandable segments on or off for a block or call, keeping every other setting.

    Applies the full merged settings (:func:`allocator_config`) with
    ``expandable_segments`` changed, so ``max_split_size_mb``,
    ``garbage_collection_threshold``, ``roundup_power2_divisions`` and the rest
    survive; on exit the previous value is written back explicitly. When the mode
    really changes and ``release_cache`` is true, cached free blocks are returned
    first: otherwise new tensors land in cached blocks of the old kind.

    An explicit ``expandable_segments:False`` in ``PYTORCH_ALLOC_CONF`` or
    ``PYTORCH_CUDA_ALLOC_CONF`` is never overridden by an enable unless
    ``force=True`` (logged once); disabling is always allowed.

    Scope: process-global (all devices, all threads); re-entrant; nests; restores
    on any exception. A context manager and a decorator (function, coroutine,
    generator, async generator, context-manager class). Costs a few microseconds
    when nothing changes (see benchmarks/overhead.py).

    Args:
        enabled: True for expandable segments (training), False for classic
            segments (rollout engines' memory pools, CUDA IPC without pidfd).
        release_cache: release cached blocks when the mode changes.
        force: override an explicit ``expandable_segments:False`` in the env.

    Returns:
        An :class:`ExpandableSegments` context/decorator.

    Raises:
        TypeError: an argument is not a bool.

    Example:
        >>> with hm.expandable_segments(True):    # doctest: +SKIP
        ...     train_step()
    """
    return ExpandableSegments(enabled, release_cache=release_cache, force=force)


def allocator_settings(**settings: object) -> AllocatorSettings:
    """Change any allocator settings for a block or call, keeping all the others.

    Values: bool for switches (``expandable_segments``, ``release_lock_on_cudamalloc``
    ...), int MB for sizes (``max_split_size_mb`` >= 20), float in (0, 1) for
    ``garbage_collection_threshold``, an int or ``{size_mb | ">": divisions}`` for
    ``roundup_power2_divisions``; a string in torch's syntax where it has that type.
    Each value is judged by the running torch's rules here, and all of them together
    (with the env's) on entry, before anything is applied; a key whose default torch
    refuses to take back (``pinned_reserve_segment_size_mb``) may only be scoped where
    the env or :func:`configure_allocator` sets it. An enable of
    ``expandable_segments`` respects an explicit env False (use
    :func:`expandable_segments` with ``force=True`` to override). Cached blocks are
    released when the expandable mode changes.

    Scope: process-global; re-entrant; nests; restores on any exception.

    Args:
        **settings: allocator setting names and values.

    Returns:
        An :class:`AllocatorSettings` context/decorator.

    Raises:
        ValueError: unknown setting (the message lists the known ones), a key this
            torch lacks, a value it refuses (:class:`AllocatorSettingsError`, here
            or on entry), or ``backend`` (fixed at start-up).
        TypeError: a value of the wrong type.

    Example:
        >>> with hm.allocator_settings(max_split_size_mb=512, garbage_collection_threshold=0.8):
        ...     pass
    """
    return AllocatorSettings(**settings)


def configure_allocator(*, force: bool = False, **settings: object) -> AllocatorConfig:
    """Set process-wide allocator defaults, at start-up or later, respecting the user's env.

    Keys the user set explicitly in ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``
    win over these defaults unless ``force=True`` (each skip is logged at INFO).
    Works before CUDA is initialised (the usual place: the top of a training
    script) and after it (new segments follow; cached blocks are released when the
    expandable mode changes). Scopes active at the time stay on top.

    Args:
        force: override keys the env sets explicitly.
        **settings: as for :func:`allocator_settings`.

    Returns:
        The resulting :class:`AllocatorConfig`.

    Raises:
        ValueError, TypeError: as for :func:`allocator_settings`.

    Example:
        >>> hm.configure_allocator(expandable_segments=True)   # doctest: +SKIP
    """
    check_bool("force", force)
    changes = _normalize(settings, who="configure_allocator")
    if disabled():
        return allocator_config()
    explicit = _STATE.env_explicit()
    if not force:
        kept = {k: explicit[k] for k in changes if k in explicit}
        for key, var in kept.items():
            logger.info(
                "configure_allocator: kept %s from %s (set explicitly there); pass force=True "
                "to override",
                key,
                var,
            )
        changes = {k: v for k, v in changes.items() if k not in kept}
    else:
        changes = _respect_env(changes, force=True, who="configure_allocator")
    _STATE.set_defaults(changes, release_cache=True)
    return allocator_config()


def _reset_state_for_tests() -> None:
    _STATE.reset()
