"""hybridmem: GPU memory phase switching for hybrid RL engines, done right.

Every primitive is a context manager (``with`` / ``async with``) and a decorator
(functions, coroutine functions, generator functions, context-manager classes)::

    import hybridmem as hm

    with hm.expandable_segments(True):      # training: less fragmentation
        train_step()
    hm.release_cache()                      # hand cached memory to the rollout engine
    with hm.expandable_segments(False):     # rollout: engines' pools need classic segments
        generate()

Importing hybridmem never initialises CUDA and never imports an inference engine;
its names load on first use, so ``import hybridmem`` does not import torch either
(``hybridmem doctor`` starts its IPC probe before paying for that import).
``HYBRIDMEM_DISABLE=1`` turns every primitive into a no-op that still decorates.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridmem._errors import (
        AllocatorSettingsError,
        CommunicatorError,
        CommunicatorSuspendedError,
        EngineAsleepError,
        HybridMemWarning,
        HybridSwitchError,
        IpcUnavailableError,
        OffloadError,
        SleepPoolError,
        SyncError,
    )
    from hybridmem.allocator.state import allocator_state
    from hybridmem.engine.switch import HybridSwitch
    from hybridmem.ipc.bucket import WeightBucket
    from hybridmem.ipc.capabilities import ipc_capabilities
    from hybridmem.ipc.export import TensorHandle, ipc_export
    from hybridmem.ipc.fd_reducer import ipc_fd_sharing
    from hybridmem.ipc.receiver import BucketReceiver
    from hybridmem.ipc.shareable import allow_ptrace_from_any, ipc_shareable
    from hybridmem.memory.compact import compact
    from hybridmem.memory.offload import Offloader
    from hybridmem.memory.offload_scope import offloaded
    from hybridmem.memory.one_segment import one_segment
    from hybridmem.observe.communicators import communicator_memory
    from hybridmem.observe.leakwatch import LeakWatch
    from hybridmem.observe.memory import memory_info
    from hybridmem.observe.timeline import get_timeline, record
    from hybridmem.scopes.allocator import (
        allocator_settings,
        expandable_segments,
        set_allocator_defaults,
    )
    from hybridmem.scopes.communicators import suspend_communicators
    from hybridmem.scopes.engines import EngineAdapter, SGLangEngine, VLLMEngine
    from hybridmem.scopes.ipc_safe import ipc_safe
    from hybridmem.scopes.phases import phase
    from hybridmem.scopes.profiles import BackendProfile, Step
    from hybridmem.scopes.registry import get_backend, list_backends, register_backend
    from hybridmem.scopes.release import aggressive_cache_release, release_cache

from hybridmem._version import __version__

# Where each public name lives; loaded on first access (PEP 562). Everything else
# (report and scope classes, for typing) is reachable from its module: see
# docs/api.md and docs/architecture.md.
_LAZY = {
    "AllocatorSettingsError": "hybridmem._errors",
    "BackendProfile": "hybridmem.scopes.profiles",
    "BucketReceiver": "hybridmem.ipc.receiver",
    "CommunicatorError": "hybridmem._errors",
    "CommunicatorSuspendedError": "hybridmem._errors",
    "EngineAdapter": "hybridmem.scopes.engines",
    "HybridMemWarning": "hybridmem._errors",
    "HybridSwitch": "hybridmem.engine.switch",
    "HybridSwitchError": "hybridmem._errors",
    "IpcUnavailableError": "hybridmem._errors",
    "LeakWatch": "hybridmem.observe.leakwatch",
    "OffloadError": "hybridmem._errors",
    "Offloader": "hybridmem.memory.offload",
    "SGLangEngine": "hybridmem.scopes.engines",
    "Step": "hybridmem.scopes.profiles",
    "SleepPoolError": "hybridmem._errors",
    "SyncError": "hybridmem._errors",
    "EngineAsleepError": "hybridmem._errors",
    "TensorHandle": "hybridmem.ipc.export",
    "VLLMEngine": "hybridmem.scopes.engines",
    "WeightBucket": "hybridmem.ipc.bucket",
    "aggressive_cache_release": "hybridmem.scopes.release",
    "allocator_settings": "hybridmem.scopes.allocator",
    "allocator_state": "hybridmem.allocator.state",
    "allow_ptrace_from_any": "hybridmem.ipc.shareable",
    "communicator_memory": "hybridmem.observe.communicators",
    "compact": "hybridmem.memory.compact",
    "expandable_segments": "hybridmem.scopes.allocator",
    "get_backend": "hybridmem.scopes.registry",
    "get_timeline": "hybridmem.observe.timeline",
    "ipc_capabilities": "hybridmem.ipc.capabilities",
    "ipc_export": "hybridmem.ipc.export",
    "ipc_fd_sharing": "hybridmem.ipc.fd_reducer",
    "ipc_safe": "hybridmem.scopes.ipc_safe",
    "ipc_shareable": "hybridmem.ipc.shareable",
    "list_backends": "hybridmem.scopes.registry",
    "memory_info": "hybridmem.observe.memory",
    "offloaded": "hybridmem.memory.offload_scope",
    "one_segment": "hybridmem.memory.one_segment",
    "phase": "hybridmem.scopes.phases",
    "record": "hybridmem.observe.timeline",
    "register_backend": "hybridmem.scopes.registry",
    "release_cache": "hybridmem.scopes.release",
    "set_allocator_defaults": "hybridmem.scopes.allocator",
    "suspend_communicators": "hybridmem.scopes.communicators",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise _unknown(name)
    if "torch" not in sys.modules and module != "hybridmem._errors":
        _check_env_before_torch()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def _check_env_before_torch() -> None:
    """Refuse, before torch is first imported, an env that makes ``import torch`` abort."""
    from hybridmem.allocator.import_check import env_kills_torch

    reason = env_kills_torch()
    if reason is not None:
        from hybridmem._errors import AllocatorSettingsError

        raise AllocatorSettingsError(reason)


# Names a user guesses from other libraries or the docs' headings -> what they want.
_GUESSES = {
    "backends": "hm.list_backends(), hm.get_backend(name) or hm.register_backend(profile)",
    "backend": "hm.get_backend(name)",
    "switch": "hm.HybridSwitch(engine, backend, offloader)",
    "offload": "hm.Offloader(model, optimizer) or hm.offloaded(model, optimizer)",
    "timeline": "hm.record(path) or hm.get_timeline()",
    "empty_cache": "hm.release_cache()",
    "aggressive_empty_cache": "hm.release_cache() or @hm.aggressive_cache_release",
    "set_expandable_segments": "hm.expandable_segments(False) as a scope or decorator",
}


def _unknown(name: str) -> AttributeError:
    """The error for ``hm.<name>``: the name a user most likely wanted, when one is close."""
    import difflib

    message = f"module 'hybridmem' has no attribute {name!r}"
    wanted = _GUESSES.get(name)
    if wanted is None:
        close = difflib.get_close_matches(name, __all__, n=1, cutoff=0.75)
        wanted = f"hm.{close[0]}" if close else None
    if wanted is None:
        return AttributeError(message + "; the public names are in hm.__all__ (docs/api.md)")
    error = AttributeError(f"{message}; did you mean {wanted}?")
    error.obj = None  # Python's own hint would add a second, different guess
    return error


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AllocatorSettingsError",
    "BackendProfile",
    "BucketReceiver",
    "CommunicatorError",
    "CommunicatorSuspendedError",
    "EngineAdapter",
    "EngineAsleepError",
    "HybridMemWarning",
    "HybridSwitch",
    "HybridSwitchError",
    "IpcUnavailableError",
    "LeakWatch",
    "OffloadError",
    "Offloader",
    "SGLangEngine",
    "SleepPoolError",
    "Step",
    "SyncError",
    "TensorHandle",
    "VLLMEngine",
    "WeightBucket",
    "__version__",
    "aggressive_cache_release",
    "allocator_settings",
    "allocator_state",
    "allow_ptrace_from_any",
    "communicator_memory",
    "compact",
    "expandable_segments",
    "get_backend",
    "get_timeline",
    "ipc_capabilities",
    "ipc_export",
    "ipc_fd_sharing",
    "ipc_safe",
    "ipc_shareable",
    "list_backends",
    "memory_info",
    "offloaded",
    "one_segment",
    "phase",
    "record",
    "register_backend",
    "release_cache",
    "set_allocator_defaults",
    "suspend_communicators",
]
