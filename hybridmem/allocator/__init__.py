"""CUDA caching-allocator control that never drops a user's settings.

Four modules, from the bottom up:

- ``rules``: torch's allocator-settings parser, modelled per torch version (which
  env variable it reads, what it accepts and refuses, what each call resets);
- ``grammar``: the keys hybridmem knows, parsed and written back in torch's syntax;
- ``effective`` and ``state``: the merged view (env, process defaults, active scopes)
  and the process-global engine that applies it whole;
- ``scopes``: what users write (:func:`expandable_segments`,
  :func:`allocator_settings`, :func:`set_allocator_defaults`).

Scope: process-global (every device, every thread).
"""

from __future__ import annotations

from hybridmem.allocator.effective import ENV_VARS, AllocatorState, Setting
from hybridmem.allocator.scopes import (
    AllocatorSettings,
    ExpandableSegments,
    allocator_settings,
    expandable_segments,
    set_allocator_defaults,
)
from hybridmem.allocator.state import allocator_state

__all__ = [
    "ENV_VARS",
    "AllocatorSettings",
    "AllocatorState",
    "ExpandableSegments",
    "Setting",
    "allocator_settings",
    "allocator_state",
    "expandable_segments",
    "set_allocator_defaults",
]
