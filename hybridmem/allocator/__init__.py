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

The names below load on first use (PEP 562), so that reaching ``rules`` (pure Python)
never imports torch: ``hybridmem doctor`` reads the env with it before torch is
imported, since some env values make ``import torch`` abort the interpreter.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridmem.allocator.effective import ENV_VARS, AllocatorState, Setting
    from hybridmem.allocator.scopes import (
        AllocatorSettings,
        ExpandableSegments,
        allocator_settings,
        expandable_segments,
        set_allocator_defaults,
    )
    from hybridmem.allocator.state import allocator_state

_LAZY = {
    "ENV_VARS": "hybridmem.allocator.effective",
    "AllocatorSettings": "hybridmem.allocator.scopes",
    "AllocatorState": "hybridmem.allocator.effective",
    "ExpandableSegments": "hybridmem.allocator.scopes",
    "Setting": "hybridmem.allocator.effective",
    "allocator_settings": "hybridmem.allocator.scopes",
    "allocator_state": "hybridmem.allocator.state",
    "expandable_segments": "hybridmem.allocator.scopes",
    "set_allocator_defaults": "hybridmem.allocator.scopes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridmem.allocator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
