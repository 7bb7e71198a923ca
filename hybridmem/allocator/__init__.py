"""CUDA caching-allocator control that never drops a user's settings.

Four modules, from the bottom up:

- ``rules``: torch's allocator-settings parser, modelled per torch version (which
  env variable it reads, what it accepts and refuses, what each call resets);
- ``grammar``: the keys hybridmem knows, parsed and written back in torch's syntax;
- ``config`` and ``state``: the merged view (env, process defaults, active scopes)
  and the process-global engine that applies it whole;
- ``scopes``: what users write (:func:`expandable_segments`,
  :func:`allocator_settings`, :func:`configure_allocator`).

Scope: process-global (every device, every thread).
"""

from __future__ import annotations

from hybridmem.allocator.config import ENV_VARS, AllocatorConfig, Setting
from hybridmem.allocator.scopes import (
    AllocatorSettings,
    ExpandableSegments,
    allocator_settings,
    configure_allocator,
    expandable_segments,
)
from hybridmem.allocator.state import allocator_config

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
