"""The allocator settings' layers: one per active change, each the settings it makes effective.

The engine in :mod:`hybridmem.allocator.state` stacks them. An :class:`Effective` is
shared while a change changes nothing, and a change's merged settings are cached on
the settings they were merged onto, so entering the same scope again costs no copy.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from hybridmem.allocator.effective import Effective, Setting, Source
from hybridmem.allocator.grammar import KEYS

__all__ = ["Layer", "expandable", "overlay", "same_value"]

_get_ident = threading.get_ident  # bound once: a layer is made at every scope entry


class Layer:
    """One active change, with the effective settings once it applies.

    A scope of hybridmem's (``source="runtime"``), or a write torch was given outside
    hybridmem while scopes were active (``source="outside"``): what that write changed,
    kept in force above the scopes entered before it.
    """

    __slots__ = ("changes", "effective", "label", "source", "thread")

    def __init__(
        self,
        changes: dict[str, str],
        label: str,
        effective: Effective,
        source: Source = "runtime",
    ) -> None:
        self.changes = changes
        self.label = label
        self.thread = _get_ident()
        self.effective = effective
        self.source: Source = source

    @property
    def outside(self) -> bool:
        """Whether this layer is a write made outside hybridmem."""
        return self.source == "outside"


def same_value(base: Effective, key: str, value: str) -> bool:
    """Whether ``base`` already has ``key`` at ``value`` (an unset key: at its default)."""
    setting = base.get(key)
    if setting is None:
        spec = KEYS.get(key)
        return spec is not None and spec.default == value
    return setting.value == value


MAX_CHILDREN = 64


def overlay(
    base: Effective, changes: Mapping[str, str], origin: str, source: Source = "runtime"
) -> Effective:
    """``base`` with ``changes`` on top (``base`` itself when they change nothing)."""
    for key, value in changes.items():
        if not same_value(base, key, value):
            break
    else:
        return base  # unchanged: share, so "no change" costs no copy and no setter call
    cache_key = (tuple(changes.items()), f"{source}:{origin}")
    merged = base.children.get(cache_key)
    if merged is not None:
        return merged
    merged = Effective(base)
    for key, value in changes.items():
        merged.pop(key, None)  # moves to the end: a later setting is written later
        merged[key] = Setting(key, value, source, origin)
    if len(base.children) >= MAX_CHILDREN:
        base.children.clear()
    base.children[cache_key] = merged
    return merged


def expandable(effective: Effective) -> bool:
    """Whether ``effective`` turns expandable segments on."""
    setting = effective.get("expandable_segments")
    return setting is not None and setting.value == "True"
