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
    from hybridmem._bucket_wire import BucketHandle, Channel
    from hybridmem._decorate import ScopedContext
    from hybridmem._errors import (
        AllocatorSettingsError,
        HybridMemWarning,
        IpcUnavailableError,
        OffloadError,
        SyncError,
    )
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
    from hybridmem.backends import (
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
    from hybridmem.bucket import SyncReport, WeightBucket
    from hybridmem.cache import (
        CacheRelease,
        DeviceRelease,
        ReleaseReport,
        aggressive_cache_release,
        release_cache,
    )
    from hybridmem.capabilities import IpcCapabilities, ipc_capabilities
    from hybridmem.ipc import IpcSafe, allow_ptrace_from_any, ipc_safe, ipc_shareable
    from hybridmem.leakwatch import LeakWatch
    from hybridmem.offload import Offloaded, Offloader, OffloadReport, offloaded
    from hybridmem.phases import Phase, phase
    from hybridmem.receiver import BucketReceiver
    from hybridmem.switch import (
        HybridSwitch,
        HybridSwitchError,
        RankStatus,
        RankSync,
        StageReport,
        SwitchReport,
    )
    from hybridmem.telemetry import MemoryInfo, memory_info
    from hybridmem.timeline import Event, Recording, Timeline, events, get_timeline, record

__version__ = "0.1.0"

# Where each public name lives; loaded on first access (PEP 562).
_LAZY = {
    "AllocatorConfig": "hybridmem.allocator",
    "AllocatorSettings": "hybridmem.allocator",
    "AllocatorSettingsError": "hybridmem._errors",
    "BackendProfile": "hybridmem.backends",
    "BucketHandle": "hybridmem._bucket_wire",
    "BucketReceiver": "hybridmem.receiver",
    "CacheRelease": "hybridmem.cache",
    "Channel": "hybridmem._bucket_wire",
    "DeviceRelease": "hybridmem.cache",
    "EngineAdapter": "hybridmem.backends",
    "Event": "hybridmem.timeline",
    "ExpandableSegments": "hybridmem.allocator",
    "HybridMemWarning": "hybridmem._errors",
    "HybridSwitch": "hybridmem.switch",
    "HybridSwitchError": "hybridmem.switch",
    "IpcCapabilities": "hybridmem.capabilities",
    "IpcSafe": "hybridmem.ipc",
    "IpcUnavailableError": "hybridmem._errors",
    "LeakWatch": "hybridmem.leakwatch",
    "MemoryInfo": "hybridmem.telemetry",
    "OffloadError": "hybridmem._errors",
    "OffloadReport": "hybridmem.offload",
    "Offloaded": "hybridmem.offload",
    "Offloader": "hybridmem.offload",
    "PHASES": "hybridmem.backends",
    "Phase": "hybridmem.phases",
    "RankStatus": "hybridmem.switch",
    "RankSync": "hybridmem.switch",
    "Recording": "hybridmem.timeline",
    "ReleaseReport": "hybridmem.cache",
    "SGLangEngine": "hybridmem.backends",
    "ScopedContext": "hybridmem._decorate",
    "Setting": "hybridmem.allocator",
    "StageReport": "hybridmem.switch",
    "Step": "hybridmem.backends",
    "SwitchReport": "hybridmem.switch",
    "SyncError": "hybridmem._errors",
    "SyncReport": "hybridmem.bucket",
    "Timeline": "hybridmem.timeline",
    "VLLMEngine": "hybridmem.backends",
    "WeightBucket": "hybridmem.bucket",
    "aggressive_cache_release": "hybridmem.cache",
    "allocator_config": "hybridmem.allocator",
    "allocator_settings": "hybridmem.allocator",
    "allow_ptrace_from_any": "hybridmem.ipc",
    "configure_allocator": "hybridmem.allocator",
    "events": "hybridmem.timeline",
    "expandable_segments": "hybridmem.allocator",
    "get_backend": "hybridmem.backends",
    "get_timeline": "hybridmem.timeline",
    "ipc_capabilities": "hybridmem.capabilities",
    "ipc_safe": "hybridmem.ipc",
    "ipc_shareable": "hybridmem.ipc",
    "list_backends": "hybridmem.backends",
    "memory_info": "hybridmem.telemetry",
    "offloaded": "hybridmem.offload",
    "phase": "hybridmem.phases",
    "record": "hybridmem.timeline",
    "register_backend": "hybridmem.backends",
    "release_cache": "hybridmem.cache",
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
