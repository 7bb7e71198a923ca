"""The public allocator scopes: expandable segments on or off, settings, process defaults."""

from __future__ import annotations

from collections.abc import Mapping

from hybridmem._checks import check_bool, refuse_bare_decoration
from hybridmem._env import disabled
from hybridmem._log import info_once, logger
from hybridmem._names import suggests_keywords
from hybridmem._scope import ScopedContext
from hybridmem.allocator.effective import AllocatorState, Effective
from hybridmem.allocator.grammar import KEYS, normalize_value
from hybridmem.allocator.rules import (
    CUDA_ALLOC_CONF,
)
from hybridmem.allocator.state import ENGINE, allocator_state

__all__ = [
    "AllocatorScope",
    "AllocatorSettings",
    "ExpandableSegments",
    "allocator_settings",
    "expandable_segments",
    "set_allocator_defaults",
]


def _respect_env(changes: dict[str, str], *, force: bool, who: str) -> dict[str, str]:
    """Drop an enable of expandable segments that the user's env forbids explicitly."""
    if changes.get("expandable_segments") != "True":
        return changes
    var = ENGINE.env_expandable_false()
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


class AllocatorScope(ScopedContext):
    """A scoped overlay on the process allocator settings."""

    _changes: dict[str, str]
    _release_cache: bool
    _force: bool
    _label: str  # repr, computed once: it is needed on every entry
    _memo: list[Effective | None]  # [view below, view with _changes] (ENGINE.push)

    def __init__(self) -> None:
        super().__init__()
        self._memo = [None, None]

    def __repr__(self) -> str:
        return self._label

    def _enter(self) -> object:
        changes = self._changes
        if "expandable_segments" in changes:
            changes = _respect_env(changes, force=self._force, who=self._label)
        return ENGINE.push(
            changes,
            self._label,
            release_cache=self._release_cache,
            # the merge of these changes, kept for the next entry (shared by the copies
            # a decorator makes: the same changes, the same merge)
            memo=self._memo if changes is self._changes else None,
        )

    def _exit(self, token: object, exc: BaseException | None) -> None:
        ENGINE.pop(token, release_cache=self._release_cache)  # type: ignore[arg-type]


class ExpandableSegments(AllocatorScope):
    """Scoped switch of expandable segments (see :func:`expandable_segments`)."""

    def __init__(self, enabled: bool, *, release_cache: bool = True, force: bool = False) -> None:
        super().__init__()
        refuse_bare_decoration(
            "expandable_segments",
            enabled,
            "@hm.expandable_segments(False) (rollout: classic segments) or "
            "@hm.expandable_segments(True) (training)",
        )
        self.enabled = check_bool("enabled", enabled)
        self._release_cache = check_bool("release_cache", release_cache)
        self._force = check_bool("force", force)
        self._changes = {"expandable_segments": str(enabled)}
        extra = ", force=True" if force else ""
        extra += "" if release_cache else ", release_cache=False"
        self._label = f"expandable_segments({enabled}{extra})"


class AllocatorSettings(AllocatorScope):
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
        changes[key] = normalize_value(key, value, ENGINE.rules())
    return changes


@suggests_keywords
def expandable_segments(
    enabled: bool, *, release_cache: bool = True, force: bool = False
) -> ExpandableSegments:
    """Switch expandable segments on or off for a block or call, keeping every other setting.

    Applies the full merged settings (:func:`allocator_state`) with
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
        TypeError: an argument is not a bool (``@hm.expandable_segments`` without
            its parentheses says how to write it).

    Example:
        >>> with hm.expandable_segments(True):    # doctest: +SKIP
        ...     train_step()
    """
    return ExpandableSegments(enabled, release_cache=release_cache, force=force)


@suggests_keywords
def allocator_settings(*bare: object, **settings: object) -> AllocatorSettings:
    """Change any allocator settings for a block or call, keeping all the others.

    Values: bool for switches (``expandable_segments``, ``release_lock_on_cudamalloc``
    ...), int MB for sizes (``max_split_size_mb`` >= 20), float in (0, 1) for
    ``garbage_collection_threshold``, an int or ``{size_mb | ">": divisions}`` for
    ``roundup_power2_divisions``, on torch 2.15 a fraction or ``"40G"`` for
    ``expandable_segments_reserve`` and ``{class: reserve}`` for
    ``expandable_segments_reserve_by_class``; a string in torch's syntax where it
    has that type.
    Each value is judged by the running torch's rules here, and all of them together
    (with the env's) on entry, before anything is applied; a key whose default torch
    refuses to take back (``pinned_reserve_segment_size_mb``) may only be scoped where
    the env or :func:`set_allocator_defaults` sets it. An enable of
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
        TypeError: a value of the wrong type, or a setting given by position.

    Example:
        >>> import hybridmem as hm
        >>> with hm.allocator_settings(max_split_size_mb=512, garbage_collection_threshold=0.8):
        ...     pass
    """
    if bare:
        write = "@hm.allocator_settings(max_split_size_mb=512), the settings by name"
        refuse_bare_decoration("allocator_settings", bare[0], write)
        raise TypeError(
            f"allocator_settings takes settings by name only, got {bare[0]!r} by position; "
            f"write {write[1:]}"
        )
    return AllocatorSettings(**settings)


@suggests_keywords
def set_allocator_defaults(*, force: bool = False, **settings: object) -> AllocatorState:
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
        The resulting :class:`AllocatorState`.

    Raises:
        ValueError, TypeError: as for :func:`allocator_settings`.

    Example:
        >>> hm.set_allocator_defaults(expandable_segments=True)   # doctest: +SKIP
    """
    check_bool("force", force)
    changes = _normalize(settings, who="set_allocator_defaults")
    if disabled():
        return allocator_state()
    explicit = ENGINE.env_explicit()
    if not force:
        kept = {k: explicit[k] for k in changes if k in explicit}
        for key, var in kept.items():
            logger.info(
                "set_allocator_defaults: kept %s from %s (set explicitly there); pass force=True "
                "to override",
                key,
                var,
            )
        changes = {k: v for k, v in changes.items() if k not in kept}
    else:
        changes = _respect_env(changes, force=True, who="set_allocator_defaults")
    ENGINE.set_defaults(changes, release_cache=True)
    return allocator_state()


def _reset_state_for_tests() -> None:
    ENGINE.reset()
