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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridmem._errors import (
        AllocatorSettingsError,
        HybridMemWarning,
        IpcUnavailableError,
        OffloadError,
        SyncError,
    )
    from hybridmem._scope import ScopedContext
    from hybridmem.allocator import (
        AllocatorConfig,
        AllocatorSettings,
        ExpandableSegments,
        Setting,
        allocator_config,
        allocator_settings,
        configure_allocator,
        expandable_segments,
    )
    from hybridmem.engine.backends import (
        PHASES,
        BackendProfile,
        EngineAdapter,
        SGLangEngine,
        Step,
        VLLMEngine,
        get_backend,
        list_backends,
        register_backend,
    )
    from hybridmem.engine.phases import Phase, phase
    from hybridmem.engine.switch import (
        HybridSwitch,
        HybridSwitchError,
        RankStatus,
        RankSync,
        StageReport,
        SwitchReport,
    )
    from hybridmem.ipc._wire import BucketHandle, Channel
    from hybridmem.ipc.bucket import SyncReport, WeightBucket
    from hybridmem.ipc.capabilities import IpcCapabilities, ipc_capabilities
    from hybridmem.ipc.receiver import BucketReceiver
    from hybridmem.ipc.shareable import IpcSafe, allow_ptrace_from_any, ipc_safe, ipc_shareable
    from hybridmem.memory.offload import Offloaded, Offloader, OffloadReport, offloaded
    from hybridmem.memory.release import (
        CacheRelease,
        DeviceRelease,
        ReleaseReport,
        aggressive_cache_release,
        release_cache,
    )
    from hybridmem.observe.leakwatch import LeakWatch
    from hybridmem.observe.memory import MemoryInfo, memory_info
    from hybridmem.observe.timeline import Event, Recording, Timeline, events, get_timeline, record

__version__ = "0.1.0"

# Where each public name lives; loaded on first access (PEP 562).
_LAZY = {
    "AllocatorConfig": "hybridmem.allocator",
    "AllocatorSettings": "hybridmem.allocator",
    "AllocatorSettingsError": "hybridmem._errors",
    "BackendProfile": "hybridmem.engine.backends",
    "BucketHandle": "hybridmem.ipc._wire",
    "BucketReceiver": "hybridmem.ipc.receiver",
    "CacheRelease": "hybridmem.memory.release",
    "Channel": "hybridmem.ipc._wire",
    "DeviceRelease": "hybridmem.memory.release",
    "EngineAdapter": "hybridmem.engine.backends",
    "Event": "hybridmem.observe.timeline",
    "ExpandableSegments": "hybridmem.allocator",
    "HybridMemWarning": "hybridmem._errors",
    "HybridSwitch": "hybridmem.engine.switch",
    "HybridSwitchError": "hybridmem.engine.switch",
    "IpcCapabilities": "hybridmem.ipc.capabilities",
    "IpcSafe": "hybridmem.ipc.shareable",
    "IpcUnavailableError": "hybridmem._errors",
    "LeakWatch": "hybridmem.observe.leakwatch",
    "MemoryInfo": "hybridmem.observe.memory",
    "OffloadError": "hybridmem._errors",
    "OffloadReport": "hybridmem.memory.offload",
    "Offloaded": "hybridmem.memory.offload",
    "Offloader": "hybridmem.memory.offload",
    "PHASES": "hybridmem.engine.backends",
    "Phase": "hybridmem.engine.phases",
    "RankStatus": "hybridmem.engine.switch",
    "RankSync": "hybridmem.engine.switch",
    "Recording": "hybridmem.observe.timeline",
    "ReleaseReport": "hybridmem.memory.release",
    "SGLangEngine": "hybridmem.engine.backends",
    "ScopedContext": "hybridmem._scope",
    "Setting": "hybridmem.allocator",
    "StageReport": "hybridmem.engine.switch",
    "Step": "hybridmem.engine.backends",
    "SwitchReport": "hybridmem.engine.switch",
    "SyncError": "hybridmem._errors",
    "SyncReport": "hybridmem.ipc.bucket",
    "Timeline": "hybridmem.observe.timeline",
    "VLLMEngine": "hybridmem.engine.backends",
    "WeightBucket": "hybridmem.ipc.bucket",
    "aggressive_cache_release": "hybridmem.memory.release",
    "allocator_config": "hybridmem.allocator",
    "allocator_settings": "hybridmem.allocator",
    "allow_ptrace_from_any": "hybridmem.ipc.shareable",
    "configure_allocator": "hybridmem.allocator",
    "events": "hybridmem.observe.timeline",
    "expandable_segments": "hybridmem.allocator",
    "get_backend": "hybridmem.engine.backends",
    "get_timeline": "hybridmem.observe.timeline",
    "ipc_capabilities": "hybridmem.ipc.capabilities",
    "ipc_safe": "hybridmem.ipc.shareable",
    "ipc_shareable": "hybridmem.ipc.shareable",
    "list_backends": "hybridmem.engine.backends",
    "memory_info": "hybridmem.observe.memory",
    "offloaded": "hybridmem.memory.offload",
    "phase": "hybridmem.engine.phases",
    "record": "hybridmem.observe.timeline",
    "register_backend": "hybridmem.engine.backends",
    "release_cache": "hybridmem.memory.release",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "PHASES",
    "AllocatorConfig",
    "AllocatorSettings",
    "AllocatorSettingsError",
    "BackendProfile",
    "BucketHandle",
    "BucketReceiver",
    "CacheRelease",
    "Channel",
    "DeviceRelease",
    "EngineAdapter",
    "Event",
    "ExpandableSegments",
    "HybridMemWarning",
    "HybridSwitch",
    "HybridSwitchError",
    "IpcCapabilities",
    "IpcSafe",
    "IpcUnavailableError",
    "LeakWatch",
    "MemoryInfo",
    "OffloadError",
    "OffloadReport",
    "Offloaded",
    "Offloader",
    "Phase",
    "RankStatus",
    "RankSync",
    "Recording",
    "ReleaseReport",
    "SGLangEngine",
    "ScopedContext",
    "Setting",
    "StageReport",
    "Step",
    "SwitchReport",
    "SyncError",
    "SyncReport",
    "Timeline",
    "VLLMEngine",
    "WeightBucket",
    "__version__",
    "aggressive_cache_release",
    "allocator_config",
    "allocator_settings",
    "allow_ptrace_from_any",
    "configure_allocator",
    "events",
    "expandable_segments",
    "get_backend",
    "get_timeline",
    "ipc_capabilities",
    "ipc_safe",
    "ipc_shareable",
    "list_backends",
    "memory_info",
    "offloaded",
    "phase",
    "record",
    "register_backend",
    "release_cache",
]
