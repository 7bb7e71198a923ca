"""The names of a hybrid engine's phases: the canonical five and their aliases.

The ground floor, so that the timeline's readers (the leak watch) and the engine
room agree on them without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from hybridmem._names import nearest

__all__ = ["ALIASES", "PHASES", "canonical_phase"]

#: The canonical phases, in the order a hybrid engine goes through them.
PHASES: tuple[str, ...] = ("train", "wake_up", "weight_sync", "rollout", "sleep")
#: Other names accepted for the canonical phases.
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "training": "train",
        "wakeup": "wake_up",
        "resume": "wake_up",
        "update_weights": "weight_sync",
        "sync_weights": "weight_sync",
        "generate": "rollout",
        "generation": "rollout",
        "inference": "rollout",
        "release": "sleep",
    }
)


def canonical_phase(name: str) -> str:
    """Return the canonical phase for ``name`` (an alias or a canonical name).

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: unknown phase (the message lists phases and aliases).
    """
    if not isinstance(name, str):
        raise TypeError(f"a phase name must be a str, got {name!r}")
    if name in PHASES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(
        f"unknown phase {name!r}{nearest(name, (*PHASES, *ALIASES))}; phases: "
        f"{', '.join(PHASES)}; aliases: " + ", ".join(f"{a}={c}" for a, c in ALIASES.items())
    )
