"""CUDA caching-allocator control that never drops a user's settings.

torch's allocator-settings setter resets ``max_split_size_mb``,
``garbage_collection_threshold`` and ``roundup_power2_divisions`` on every call
unless the same call repeats them, and leaves ``expandable_segments`` unchanged
when the string omits it. So every hand-written ``set_expandable_segments`` drops
the user's settings, and "restoring" by re-applying the env string leaves
expandable segments on. hybridmem keeps one merged view (:class:`AllocatorState`:
env, then process defaults, then active scopes) and always applies it whole,
writing back explicitly every key torch would otherwise keep.

torch's rules are the running version's own (:mod:`hybridmem.allocator.rules`, a
model of its parser checked against torch 2.4 - 2.15): which env variable it
reads, what it accepts, what each call resets. Every string is run through that
model before torch sees it, so a string torch would refuse is refused before
anything is applied; if torch refuses one anyway, the settings before it are
written back (torch keeps the part of a refused string it had read).

Scope: allocator settings are process-global (every device, every thread). One
re-entrant lock serialises changes. Scopes may exit in any order: the settings
are derived from the scopes still active, so the final state is right even when
two threads or tasks interleave, and a :class:`HybridMemWarning` names both.

Why this module is long: one lock guards one merged state (env, defaults, scopes,
what torch has), and every path that changes it (push, pop, defaults, roll back
after a refusal) must read and write that state under the lock together.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from types import MappingProxyType

from hybridmem import _torch
from hybridmem._errors import AllocatorSettingsError
from hybridmem._log import log_once, logger, warn_once, warn_user
from hybridmem._names import suggests_keywords
from hybridmem.allocator.effective import ENV_VARS, AllocatorState, Effective, Setting
from hybridmem.allocator.grammar import format_settings, keys_of
from hybridmem.allocator.layers import Layer, expandable, overlay
from hybridmem.allocator.rules import (
    CUDA_ALLOC_CONF,
    Outcome,
    TorchRules,
)

__all__ = [
    "ENGINE",
    "SettingsEngine",
    "allocator_state",
    "drop_cached_blocks",
]


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


def _torch_reads(outcome: Outcome) -> dict[str, str]:
    """Env values that torch reads as another value: key -> what torch reads (shown)."""
    reads: dict[str, str] = {}
    for key, value in outcome.items:
        read = outcome.state.get(key)
        if key in _SIZE_KEYS and not re.fullmatch(r"\d+", value):
            reads[key] = "unlimited" if read is None or read >= 1 << 40 else str(read)
        elif key in _FLOAT_KEYS:
            try:
                float(value)
            except ValueError:
                reads[key] = str(read)
    return reads


def _misreads(outcome: Outcome, reads: Mapping[str, str]) -> list[str]:
    """Values in an env string that torch reads differently from how they look.

    ``reads``: :func:`_torch_reads` of ``outcome``.
    """
    found = list(outcome.notes)
    written = dict(outcome.items)
    for key, shown in reads.items():
        value = written[key]
        hint = " (write a plain whole number)" if key in _SIZE_KEYS else ""
        found.append(f"{key}:{value} is read as {shown}{hint}")
    return found


#: The origin of a setting a write from outside hybridmem set (``Setting.origin``).
_OUTSIDE_ORIGIN = "written outside hybridmem"


def _outside_label(changes: dict[str, str]) -> str:
    """How a write from outside is named among the scopes (``allocator_state().scopes``)."""
    return f"outside hybridmem ({format_settings(changes.items())})"


class SettingsEngine:
    """The merged allocator view and what has been applied to torch (process-global)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        """Forget every runtime change (tests; a fresh process starts here)."""
        with self.lock:
            self._env_key: tuple[str | None, ...] | None = None
            self._env_effective = Effective()
            self._env_reads: Mapping[str, str] = MappingProxyType({})
            self._env_error: AllocatorSettingsError | None = None
            self._env_variable: str | None = None
            self._env_ignored: tuple[str, ...] = ()
            self._env_explicit: dict[str, str] = {}  # key -> env var
            self._env_frozen = False
            self._env_expandable_false: str | None = None
            self._torch_env_text = ""  # what torch 2.12+'s getter says before any change
            self._defaults: Effective | None = None  # set_allocator_defaults / external
            self._layers: list[Layer] = []
            self._out_of_order: tuple[int, ...] = ()  # the layers the last warning named
            self._applied: str | None = None
            self._seen: str | None = None  # the last string torch had, as far as hybridmem saw
            self._current: Effective | None = None  # what torch has; None = env state
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
        effective = Effective()
        explicit: dict[str, str] = {}
        error: AllocatorSettingsError | None = None
        notes: list[str] = []
        reads: dict[str, str] = {}
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
                reads = _torch_reads(outcome)
                notes = _misreads(outcome, reads)
        # State first, warnings last: under `-W error` a warning must not leave
        # half-parsed state behind.
        self._env_key = raw
        self._env_variable = name
        self._env_ignored = tuple(ignored)
        self._env_error = error
        self._torch_env_text = text
        self._env_effective = effective
        self._env_explicit = explicit
        self._env_reads = MappingProxyType(reads)
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
            )
        for note in notes:
            warn_once(
                f"env-misread:{name}:{note}",
                f"{name}={text!r}: with {rules.label}, {note}; hybridmem reads it the same way",
            )

    # ------------------------------------------------------------------ #
    # Views
    # ------------------------------------------------------------------ #
    def _base(self) -> Effective:
        if not self._env_frozen:
            self._read_env()
        if self._env_error is not None:
            raise self._env_error
        return self._defaults if self._defaults is not None else self._env_effective

    def _top(self) -> Effective:
        return self._layers[-1].effective if self._layers else self._base()

    def _recompute(self, start: int = 0) -> None:
        base = self._layers[start - 1].effective if start > 0 else self._base()
        for layer in self._layers[start:]:
            layer.effective = overlay(base, layer.changes, layer.label, layer.source)
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
            expandable_now = expandable(self._top())
        if expandable_now and _torch.settings_setter_name() is None:
            return (
                f"expandable segments are on and torch "
                f"{'.'.join(map(str, _torch.torch_version()))} has no allocator-settings "
                "setter to switch them off"
            )
        return None

    def config(self) -> AllocatorState:
        with self.lock:
            self._observe()
            top = self._top()
            # What torch runs with: hybridmem's view, or the model of torch after a
            # write from outside that reset some of the view's settings.
            pending = self._pending()
            now = self._current if pending and self._current is not None else top
            return AllocatorState(
                settings=MappingProxyType(dict(now)),
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
                reads=MappingProxyType(
                    {
                        key: shown
                        for key, shown in self._env_reads.items()
                        if key in now and now[key].source == "env"
                    }
                ),
                pending=MappingProxyType(pending),
                sees_outside=_torch.sees_settings_writes(),
                known=keys_of(self.rules().version),
            )

    def _pending(self) -> dict[str, Setting]:
        """Settings of hybridmem's view that torch is not running with (a write reset them)."""
        top, now = self._top(), self._current
        if now is None or now is top:
            return {}
        rules = self.rules()
        held, running = top.state(rules), now.state(rules)
        return {key: setting for key, setting in top.items() if held.get(key) != running.get(key)}

    # ------------------------------------------------------------------ #
    # Changes
    # ------------------------------------------------------------------ #
    def _observe(self) -> None:
        """See a settings string torch was given outside hybridmem, and keep it in force.

        torch's getter (or snapshot) says the last string it parsed. When that is not
        the one hybridmem last saw, someone else wrote it (vLLM's pool toggle, verl's
        ``set_expandable_segments``, a direct call). What it changed, against
        hybridmem's view under any earlier write from outside, becomes a layer of
        its own on top of the scopes active now: scopes entered later stack above
        it, and scopes that exit under it leave it in force. A write that puts
        hybridmem's view back (vLLM restoring the string it read) removes it.
        Settings the write reset as a side effect (torch's setter resets
        ``max_split_size_mb`` and the like on every call) are not its intent: the
        model of torch drops them, :func:`allocator_state` reports them pending,
        and hybridmem's next change writes them back.
        """
        if self._seen is None:
            # The env first: torch reports the env string until a change, and a
            # malformed one is hybridmem's clear error, not the getter's raw one.
            self._base()
        last = _torch.last_allocator_settings()
        if last is None:
            return
        if last == self._expected():
            return
        self._seen = last
        rules = self.rules()
        current = self._current if self._current is not None else self._env_effective
        outcome = rules.run(last, current.state(rules))
        if not outcome.accepted:
            logger.warning(
                "allocator settings %r were given to torch outside hybridmem and refused by "
                "it (%s); hybridmem keeps its own view",
                last,
                outcome.error,
            )
            return
        written = {k: v for k, v in outcome.items if k != "backend"}
        origin = _OUTSIDE_ORIGIN
        # torch now: the keys it resets went back to their defaults, the string's
        # keys are set, every other key kept its value (an earlier outside write's too).
        model = Effective(
            {k: v for k, v in current.items() if k not in rules.reset_keys and k not in written}
        )
        for key, value in written.items():
            model[key] = Setting(key, value, "outside", origin)
        self._current = model
        layers = self._layers
        while layers and layers[-1].outside:
            layers.pop()
        below = self._top()
        held, running = below.state(rules), outcome.state
        changes = {
            key: setting.value
            for key, setting in model.items()
            if setting.source == "outside" and held.get(key) != running.get(key)
        }
        for key in [k for k, v in model.items() if v.source == "outside" and k not in changes]:
            # written, but as hybridmem's view already had it: that view's, by source
            if key in below:
                model[key] = below[key]
            else:
                del model[key]
        if changes:
            label = _outside_label(changes)
            layers.append(
                Layer(changes, label, overlay(below, changes, origin, "outside"), "outside")
            )
        lost = sorted(self._pending())
        logger.info(
            "allocator settings were written outside hybridmem: %r; hybridmem %s",
            last,
            f"keeps {format_settings(changes.items())} in force while its scopes change around it"
            if changes
            else "sees no change from its own settings",
        )
        if lost:
            log_once(
                f"outside-reset:{last}",
                f"allocator settings {last!r} were written outside hybridmem, and torch's "
                f"setter reset {', '.join(lost)} with it: torch runs without "
                f"{'them' if len(lost) > 1 else 'it'} until hybridmem's next change gives "
                f"{'them' if len(lost) > 1 else 'it'} back (hm.allocator_state().pending). "
                "Write the whole string (hm.allocator_state().to_settings_string()) or use "
                "hm.expandable_segments() to keep them",
                logging.WARNING,
            )

    def _merge_outside(self) -> None:
        """Writes from outside left next to each other (a scope between them exited): one."""
        layers = self._layers
        index = 1
        while index < len(layers):
            if layers[index].outside and layers[index - 1].outside:
                earlier = layers[index - 1]
                earlier.changes = {**earlier.changes, **layers.pop(index).changes}
                earlier.label = _outside_label(earlier.changes)
                self._recompute(index - 1)
            else:
                index += 1

    def _settings_string(self, target: Effective, current: Effective) -> str:
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
                default = fresh.get(key)
                why = (
                    "no settings string gives it back (it is unlimited until set)"
                    if default is None
                    else f"{rules.label} refuses {key}:{default}"
                )
                shown = "unlimited" if default is None else default
                raise AllocatorSettingsError(
                    f"{key} cannot go back to its default ({shown}): {why}. Set {key} in "
                    f"{CUDA_ALLOC_CONF} or with hm.set_allocator_defaults() instead of in a scope"
                )
            items.append((key, text))
        text = format_settings(items)
        outcome = rules.run(text, now)  # never give torch a string it would refuse
        if not outcome.accepted:  # pragma: no cover - the view's own check runs first
            raise AllocatorSettingsError(f"{outcome.error}; nothing was applied")
        wanted = target.state(rules)
        for key in sorted(wanted):
            # a value torch takes and ignores (a bad 2.15 reserve) keeps what was there
            if outcome.state.get(key) != wanted[key]:
                goal = "its default" if wanted[key] == fresh.get(key) else repr(wanted[key])
                raise AllocatorSettingsError(
                    f"{key} cannot go back to {goal}: {text!r} leaves torch at "
                    f"{outcome.state.get(key)!r}. Set {key} in {CUDA_ALLOC_CONF} (to a value "
                    "torch reads) or with hm.set_allocator_defaults() instead of in a scope"
                )
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
            and expandable(current) != expandable(target)
        ):
            # Cached free blocks of the old kind would be reused by new tensors.
            drop_cached_blocks(_torch.initialized_devices())
        try:
            _torch.set_allocator_settings(text)
        except AllocatorSettingsError as exc:
            self._roll_back(current, text, exc)
            raise
        self._env_frozen = True
        self._applied = self._seen = text
        self._current = target
        logger.debug("allocator settings applied: %s", text)

    def _roll_back(self, current: Effective, refused: str, exc: AllocatorSettingsError) -> None:
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
        self._applied = self._seen = restore
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

    def _expected(self) -> str:
        """The string torch reports while nobody else writes: hybridmem's last, else the env's."""
        return self._seen if self._seen is not None else self._torch_env_text

    def _observe_now(self) -> None:
        """:meth:`_observe` at a scope's entry and exit: one read, when nobody wrote."""
        if self._env_frozen:  # the env was read and holds no error
            last = _torch.last_allocator_settings()
            seen = self._seen  # _expected(), inline: every entry and exit runs this
            if last is None or last == (seen if seen is not None else self._torch_env_text):
                return
        self._observe()

    def push(
        self,
        changes: dict[str, str],
        label: str,
        *,
        release_cache: bool,
        memo: list[Effective | None] | None = None,
    ) -> Layer:
        """Enter a scope: its changes on top of the active ones, applied when they change.

        ``memo``: the caller's ``[view below, view with the changes]`` from its last
        entry, for these same ``changes``; reused when the view below is the same object
        (a scope entered again and again costs no merge), updated otherwise.
        """
        with self.lock:
            self._observe_now()
            layers = self._layers
            top = layers[-1].effective if layers else self._base()
            remembered = memo[1] if memo is not None and memo[0] is top else None
            if remembered is not None:
                effective = remembered
            else:
                effective = overlay(top, changes, label)
                if memo is not None:
                    memo[:] = (top, effective)
            layer = Layer(changes, label, effective)
            if effective is not top:
                rules = self.rules()
                # Refuse what torch would refuse, before anything is applied...
                if effective.state(rules) != top.state(rules):
                    # ...including an exit that could not go back.
                    self._settings_string(top, effective)
            layers.append(layer)
            current = self._current
            if effective is current or (current is None and effective is self._env_effective):
                return layer  # nothing to apply (the common "no change" entry)
            try:
                self.sync(release_cache=release_cache)
            except BaseException:
                layers.remove(layer)
                raise
            return layer

    def pop(self, layer: Layer, *, release_cache: bool) -> None:
        with self.lock:
            # First: a write from outside made while the scope was active is a layer
            # above it, and stays in force as the scope exits.
            self._observe_now()
            layers = self._layers
            if layers and layers[-1] is layer:  # the usual, LIFO case
                layers.pop()
                self._out_of_order = ()
                if (layers[-1].effective if layers else self._base()) is not self._current:
                    self.sync(release_cache=release_cache)
                return
            index = next(i for i, item in enumerate(layers) if item is layer)
            later = [x for x in layers[index + 1 :] if not x.outside]
            del layers[index]
            self._recompute(index)
            self._merge_outside()
            # Apply first, warn after: under `-W error` the warning must not keep
            # torch on the settings of a scope that has exited.
            self.sync(release_cache=release_cache)
        if later:
            named = tuple(id(x) for x in later)
            with self.lock:  # a manager's scopes exit together: one warning for them
                if named == self._out_of_order:
                    return
                self._out_of_order = named
            threads = len({x.thread for x in (layer, *later)}) > 1
            said = [f"{x.label} (thread {x.thread})" if threads else x.label for x in later]
            warn_user(
                f"{said[0] if len(said) == 1 else ', '.join(said)}, entered after "
                f"{layer.label if not threads else f'{layer.label} (thread {layer.thread})'}, "
                f"{'is' if len(said) == 1 else 'are'} still active as it exits: scopes "
                "exited out of order (the settings stay those of the scopes still active)"
            )

    def set_defaults(self, changes: dict[str, str], *, release_cache: bool) -> None:
        with self.lock:
            self._observe()
            previous, layers = self._defaults, list(self._layers)
            base = self._base()
            if self._layers and self._layers[0].outside:
                # A write from outside under every scope: the newer process default
                # goes on top of it (it joins the defaults, keeping its source).
                first = self._layers.pop(0)
                base = overlay(base, first.changes, _OUTSIDE_ORIGIN, "outside")
            self._defaults = overlay(base, changes, "set_allocator_defaults")
            try:
                self._defaults.state(self.rules())
                self._recompute()
                self.sync(release_cache=release_cache)
            except BaseException:
                self._defaults = previous
                self._layers[:] = layers
                self._recompute()
                raise


ENGINE = SettingsEngine()


@suggests_keywords
def allocator_state() -> AllocatorState:
    """Return the effective allocator settings and the source of each.

    Reads the env the way this torch does: torch 2.10+ reads
    ``PYTORCH_CUDA_ALLOC_CONF`` when it is set (even empty), else
    ``PYTORCH_ALLOC_CONF``, and ignores the other (``ignored_env`` names it, and a
    :class:`HybridMemWarning` says so once); torch <= 2.9 reads only
    ``PYTORCH_CUDA_ALLOC_CONF``. Values are as torch reads them. Merged with the
    process defaults and the active scopes. Cheap: no CUDA call, no snapshot.

    Returns:
        An immutable :class:`AllocatorState`.

    Raises:
        AllocatorSettingsError: the env variable torch reads is malformed or holds
            a value torch refuses (the message names the variable, the value and
            the fix).

    Example:
        >>> print(hm.allocator_state())   # doctest: +SKIP
    """
    return ENGINE.config()


def drop_cached_blocks(devices: list[int]) -> None:
    """Synchronise ``devices`` and empty the cache, without measuring (hot path).

    What an allocator mode switch needs: cached free blocks of the old segment
    kind must go, or new tensors land in them.
    """
    for d in devices:
        _torch.synchronize(d)
    _torch.empty_cache()
