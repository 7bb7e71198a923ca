"""hybridmem: GPU memory phase switching for hybrid RL engines, done right.

Every primitive is a context manager (``with`` / ``async with``) and a decorator
(functions, coroutine functions, generator functions, context-manager classes)::

    import hybridmem as hm

    with hm.expandable_segments(True):      # training: less fragmentation
        train_step()
    hm.release_cache()                      # hand cached memory to the rollout engine
    with hm.expandable_segments(False):     # rollout: engines' pools need classic segments
        generate()

Importing hybridmem never initialises CUDA and never imports an inference engine.
``HYBRIDMEM_DISABLE=1`` turns every primitive into a no-op that still decorates.
"""

from __future__ import annotations

from hybridmem._bucket_wire import BucketHandle, Channel
from hybridmem._decorate import ScopedContext
from hybridmem._errors import AllocatorSettingsError, HybridMemWarning, IpcUnavailableError
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
from hybridmem.switch import HybridSwitch, HybridSwitchError, StageReport, SwitchReport
from hybridmem.telemetry import MemoryInfo, memory_info
from hybridmem.timeline import Event, Recording, Timeline, events, get_timeline, record

__version__ = "0.1.0"

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
    "OffloadReport",
    "Offloaded",
    "Offloader",
    "Phase",
    "Recording",
    "ReleaseReport",
    "SGLangEngine",
    "ScopedContext",
    "Setting",
    "StageReport",
    "Step",
    "SwitchReport",
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
