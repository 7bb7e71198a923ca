"""Backend registry, the built-in vllm/sglang/default profiles, and engine adapters.

Nothing here imports an inference engine: profiles are data, adapters are duck-typed.
"""

from __future__ import annotations

from hybridmem.engine.backends.adapters import TAGS, EngineAdapter, SGLangEngine, VLLMEngine
from hybridmem.engine.backends.builtin import BUILTIN
from hybridmem.engine.backends.registry import (
    ACTIONS,
    ALIASES,
    ENTRY_POINT_GROUP,
    PHASES,
    BackendProfile,
    Step,
    canonical_phase,
    get_backend,
    list_backends,
    register_backend,
    restore_registry,
)

__all__ = [
    "ACTIONS",
    "ALIASES",
    "ENTRY_POINT_GROUP",
    "PHASES",
    "TAGS",
    "BackendProfile",
    "EngineAdapter",
    "SGLangEngine",
    "Step",
    "VLLMEngine",
    "canonical_phase",
    "get_backend",
    "list_backends",
    "register_backend",
    "reset_registry",
]

for _profile in BUILTIN:
    register_backend(_profile)


def reset_registry() -> None:
    """Forget every registered backend but the built-in ones (and reload entry points)."""
    restore_registry(BUILTIN)
