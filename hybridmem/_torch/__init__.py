"""The one seam between hybridmem and torch.

Every private or version-dependent torch call lives in this package, guarded, with
the torch version it applies to; one module per concern:

- ``version``: torch's version, read once;
- ``settings``: the allocator-settings setter and getter of each version, the
  memory snapshot, the allocator backend;
- ``device``: CUDA state (built, available, current device, contexts, memory
  statistics), read without ever creating a context;
- ``blocks``: where the caching allocator puts a request (rounding, pools);
- ``tensors``: storages, sharded and sparse tensors, streams, pinned host memory,
  batched copies;
- ``mapped``: copies by kernels reading pinned host memory through its device
  mapping (a reload right after another process's free);
- ``ipc``: CUDA IPC export and import of tensors and events, segment kind, device
  identity;
- ``dist``: torch.distributed;
- ``nccl``: the process groups' NCCL communicators (suspend, resume, what they hold),
  the store the ranks agree through, the collective methods a suspended group refuses.

Some wrappers here are one line over a public API (CUDA streams and events, storage
resizing): torch ships those untyped, and the typed wrapper keeps ``mypy --strict``
honest in one place instead of a ``cast`` at every call.

Other modules call these functions through this face (``_torch.empty_cache()``),
so CPU tests can monkeypatch them here; real behaviour is checked by the GPU tests.
Nothing here initialises CUDA: functions that need a CUDA context say so and are
only called by hybridmem once :func:`cuda_initialized` is true.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridmem._torch.blocks import (
        MIN_BLOCK_BYTES,
        SMALL_REQUEST_BYTES,
        block_bytes,
        hold_block,
        private_pool_ranges,
        storage_address,
    )
    from hybridmem._torch.device import (
        clear_blas_workspaces,
        cuda_available,
        cuda_built,
        cuda_initialized,
        cuda_version,
        current_device,
        device_count,
        empty_cache,
        has_context,
        initialized_devices,
        ipc_collect,
        mem_get_info,
        memory_stats,
        synchronize,
    )
    from hybridmem._torch.dist import (
        dist_all_gather_object,
        dist_all_gather_tensors,
        dist_barrier,
        dist_initialized,
        dist_rank,
        process_rank,
    )
    from hybridmem._torch.dlpack import live_external_tensors, tensor_from_memory
    from hybridmem._torch.ipc import (
        device_index_by_uuid,
        device_uuid,
        event_seconds,
        export_cuda_tensor,
        import_cuda_tensor,
        ipc_event_handle,
        is_legacy_ipc_capable,
        new_event,
        new_ipc_event,
        new_timed_event,
        open_ipc_event,
        query_event,
        record_event,
        synchronize_event,
        wait_event,
    )
    from hybridmem._torch.mapped import copy_by_kernel, host_device_view
    from hybridmem._torch.nccl import (
        default_store,
        group_communicators,
        group_is_alive,
        is_non_member,
        is_process_group,
        nccl_calls,
        nccl_version,
        store_get,
        store_has,
        store_set,
        store_wait,
        torch_suspends,
        unwrap_collectives,
        wrap_collectives,
    )
    from hybridmem._torch.settings import (
        last_allocator_settings,
        record_memory_history,
        runtime_allocator_backend,
        sees_settings_writes,
        set_allocator_settings,
        settings_setter_name,
        settings_writes_watched,
        snapshot,
        snapshot_allocator_settings,
        stop_watching_settings_writes,
    )
    from hybridmem._torch.tensors import (
        copy_many,
        current_stream,
        dense_parts,
        is_device_tensor,
        local_tensor,
        new_stream,
        nonzero_static,
        pin_host_tensor,
        release_stream,
        resize_storage,
        storage_bytes,
        storage_key,
        storage_of,
        storage_resizable,
        stream_scope,
        synchronize_stream,
        unpin_host_tensor,
        wait_stream,
    )
    from hybridmem._torch.version import (
        torch_version,
        torch_version_string,
    )

# Where each name lives, loaded on first use (PEP 562): a process that uses only the
# allocator scopes never loads the IPC, mapping or distributed modules.
_LAZY = {
    "MIN_BLOCK_BYTES": "hybridmem._torch.blocks",
    "SMALL_REQUEST_BYTES": "hybridmem._torch.blocks",
    "block_bytes": "hybridmem._torch.blocks",
    "clear_blas_workspaces": "hybridmem._torch.device",
    "copy_by_kernel": "hybridmem._torch.mapped",
    "copy_many": "hybridmem._torch.tensors",
    "cuda_available": "hybridmem._torch.device",
    "cuda_built": "hybridmem._torch.device",
    "cuda_initialized": "hybridmem._torch.device",
    "cuda_version": "hybridmem._torch.device",
    "current_device": "hybridmem._torch.device",
    "current_stream": "hybridmem._torch.tensors",
    "default_store": "hybridmem._torch.nccl",
    "dense_parts": "hybridmem._torch.tensors",
    "device_count": "hybridmem._torch.device",
    "device_index_by_uuid": "hybridmem._torch.ipc",
    "device_uuid": "hybridmem._torch.ipc",
    "dist_all_gather_object": "hybridmem._torch.dist",
    "dist_all_gather_tensors": "hybridmem._torch.dist",
    "dist_barrier": "hybridmem._torch.dist",
    "dist_initialized": "hybridmem._torch.dist",
    "dist_rank": "hybridmem._torch.dist",
    "empty_cache": "hybridmem._torch.device",
    "event_seconds": "hybridmem._torch.ipc",
    "export_cuda_tensor": "hybridmem._torch.ipc",
    "group_communicators": "hybridmem._torch.nccl",
    "group_is_alive": "hybridmem._torch.nccl",
    "has_context": "hybridmem._torch.device",
    "hold_block": "hybridmem._torch.blocks",
    "host_device_view": "hybridmem._torch.mapped",
    "import_cuda_tensor": "hybridmem._torch.ipc",
    "initialized_devices": "hybridmem._torch.device",
    "ipc_collect": "hybridmem._torch.device",
    "ipc_event_handle": "hybridmem._torch.ipc",
    "is_device_tensor": "hybridmem._torch.tensors",
    "is_legacy_ipc_capable": "hybridmem._torch.ipc",
    "is_non_member": "hybridmem._torch.nccl",
    "is_process_group": "hybridmem._torch.nccl",
    "last_allocator_settings": "hybridmem._torch.settings",
    "live_external_tensors": "hybridmem._torch.dlpack",
    "local_tensor": "hybridmem._torch.tensors",
    "mem_get_info": "hybridmem._torch.device",
    "memory_stats": "hybridmem._torch.device",
    "nccl_calls": "hybridmem._torch.nccl",
    "nccl_version": "hybridmem._torch.nccl",
    "new_event": "hybridmem._torch.ipc",
    "new_ipc_event": "hybridmem._torch.ipc",
    "new_stream": "hybridmem._torch.tensors",
    "new_timed_event": "hybridmem._torch.ipc",
    "nonzero_static": "hybridmem._torch.tensors",
    "open_ipc_event": "hybridmem._torch.ipc",
    "pin_host_tensor": "hybridmem._torch.tensors",
    "private_pool_ranges": "hybridmem._torch.blocks",
    "process_rank": "hybridmem._torch.dist",
    "query_event": "hybridmem._torch.ipc",
    "record_event": "hybridmem._torch.ipc",
    "record_memory_history": "hybridmem._torch.settings",
    "release_stream": "hybridmem._torch.tensors",
    "resize_storage": "hybridmem._torch.tensors",
    "runtime_allocator_backend": "hybridmem._torch.settings",
    "sees_settings_writes": "hybridmem._torch.settings",
    "set_allocator_settings": "hybridmem._torch.settings",
    "settings_setter_name": "hybridmem._torch.settings",
    "settings_writes_watched": "hybridmem._torch.settings",
    "snapshot": "hybridmem._torch.settings",
    "snapshot_allocator_settings": "hybridmem._torch.settings",
    "stop_watching_settings_writes": "hybridmem._torch.settings",
    "storage_address": "hybridmem._torch.blocks",
    "storage_bytes": "hybridmem._torch.tensors",
    "storage_key": "hybridmem._torch.tensors",
    "storage_of": "hybridmem._torch.tensors",
    "storage_resizable": "hybridmem._torch.tensors",
    "store_get": "hybridmem._torch.nccl",
    "store_has": "hybridmem._torch.nccl",
    "store_set": "hybridmem._torch.nccl",
    "store_wait": "hybridmem._torch.nccl",
    "stream_scope": "hybridmem._torch.tensors",
    "synchronize": "hybridmem._torch.device",
    "synchronize_event": "hybridmem._torch.ipc",
    "synchronize_stream": "hybridmem._torch.tensors",
    "tensor_from_memory": "hybridmem._torch.dlpack",
    "torch_suspends": "hybridmem._torch.nccl",
    "torch_version": "hybridmem._torch.version",
    "torch_version_string": "hybridmem._torch.version",
    "unpin_host_tensor": "hybridmem._torch.tensors",
    "unwrap_collectives": "hybridmem._torch.nccl",
    "wait_event": "hybridmem._torch.ipc",
    "wait_stream": "hybridmem._torch.tensors",
    "wrap_collectives": "hybridmem._torch.nccl",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridmem._torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups (and monkeypatching) see it here
    return value


__all__ = [
    "MIN_BLOCK_BYTES",
    "SMALL_REQUEST_BYTES",
    "api_report",
    "block_bytes",
    "clear_blas_workspaces",
    "copy_by_kernel",
    "copy_many",
    "cuda_available",
    "cuda_built",
    "cuda_initialized",
    "cuda_version",
    "current_device",
    "current_stream",
    "default_store",
    "dense_parts",
    "device_count",
    "device_index_by_uuid",
    "device_uuid",
    "dist_all_gather_object",
    "dist_all_gather_tensors",
    "dist_barrier",
    "dist_initialized",
    "dist_rank",
    "empty_cache",
    "event_seconds",
    "export_cuda_tensor",
    "group_communicators",
    "group_is_alive",
    "has_context",
    "hold_block",
    "host_device_view",
    "import_cuda_tensor",
    "initialized_devices",
    "ipc_collect",
    "ipc_event_handle",
    "is_device_tensor",
    "is_legacy_ipc_capable",
    "is_non_member",
    "is_process_group",
    "last_allocator_settings",
    "live_external_tensors",
    "local_tensor",
    "mem_get_info",
    "memory_stats",
    "nccl_calls",
    "nccl_version",
    "new_event",
    "new_ipc_event",
    "new_stream",
    "new_timed_event",
    "nonzero_static",
    "open_ipc_event",
    "pin_host_tensor",
    "private_pool_ranges",
    "process_rank",
    "query_event",
    "record_event",
    "record_memory_history",
    "release_stream",
    "resize_storage",
    "runtime_allocator_backend",
    "sees_settings_writes",
    "set_allocator_settings",
    "settings_setter_name",
    "settings_writes_watched",
    "snapshot",
    "snapshot_allocator_settings",
    "stop_watching_settings_writes",
    "storage_address",
    "storage_bytes",
    "storage_key",
    "storage_of",
    "storage_resizable",
    "store_get",
    "store_has",
    "store_set",
    "store_wait",
    "stream_scope",
    "synchronize",
    "synchronize_event",
    "synchronize_stream",
    "tensor_from_memory",
    "torch_suspends",
    "torch_version",
    "torch_version_string",
    "unpin_host_tensor",
    "unwrap_collectives",
    "wait_event",
    "wait_stream",
    "wrap_collectives",
]


def api_report() -> dict[str, bool]:
    """Return which version-dependent torch APIs this build offers (for ``doctor``)."""
    import torch

    from hybridmem._torch.settings import GETTER, NEW_SETTER

    return {
        "torch._C._accelerator_setAllocatorSettings": callable(getattr(torch._C, NEW_SETTER, None)),
        "torch.cuda.memory._set_allocator_settings": callable(
            getattr(torch.cuda.memory, "_set_allocator_settings", None)
        ),
        "torch._C._accelerator_getAllocatorSettings": callable(getattr(torch._C, GETTER, None)),
        "torch.cuda.memory._snapshot": callable(getattr(torch.cuda.memory, "_snapshot", None)),
        "torch._C._cuda_hasPrimaryContext": callable(
            getattr(torch._C, "_cuda_hasPrimaryContext", None)
        ),
        "torch._C._cuda_getAllocatorBackend": callable(
            getattr(torch._C, "_cuda_getAllocatorBackend", None)
        ),
        "torch._foreach_copy_": callable(getattr(torch, "_foreach_copy_", None)),
        "torch.multiprocessing.reductions.rebuild_cuda_tensor": _has_rebuild(),
    }


def _has_rebuild() -> bool:
    from torch.multiprocessing import reductions

    return callable(getattr(reductions, "rebuild_cuda_tensor", None))
