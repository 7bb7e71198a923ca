"""The built-in profiles: ``vllm``, ``sglang`` and ``default``. They never import an engine.

Each step names its evidence; docs/backends/ explains them at length.
"""

from __future__ import annotations

from hybridmem.backends.registry import BackendProfile, Step

__all__ = ["BUILTIN", "DEFAULT", "SGLANG", "VLLM"]

_FRAGMENTATION = (
    "training fragments the caching allocator: verl's FSDP2 PR measured reserved 73.59 GB "
    "vs allocated 5.53 GB without expandable segments, 14.20 vs 4.95 GB with them"
)
_HANDBACK = (
    "cached-but-free trainer memory is invisible to the engine's process: verl #5384 "
    "(vLLM failed its start-up free-memory check); measured on an H200: device free "
    "memory 70% of what could be free before a release, 99.5% after"
)
_PIDFD = (
    "tensors in expandable segments need pidfd_getfd in the consumer, which containers "
    "deny (verl #2846, pytorch #165685, ROLL #417); staging buffers re-exported every "
    "sync leak (verl PR #6958) and reused ones must not be viewed (verl #6688)"
)
_STAGING = "staging buffers and IPC leftovers go back before the KV cache wakes (verl #302)"


def _train(versions: str) -> tuple[Step, ...]:
    return (
        Step(
            "expandable_segments",
            "expandable_segments",
            "scope",
            {"enabled": True},
            why=_FRAGMENTATION,
            versions=versions,
        ),
    )


def _weight_sync(versions: str, extra: str = "") -> tuple[Step, ...]:
    return (
        Step(
            "ipc_safe",
            "ipc_safe",
            "scope",
            {"fallback": "auto"},
            why=_PIDFD + extra,
            versions=versions,
        ),
        Step(
            "release_cache",
            "release_cache",
            "exit",
            {"collect_garbage": False, "ipc_collect": True},
            why=_STAGING,
            versions=versions,
        ),
    )


VLLM = BackendProfile(
    name="vllm",
    description="vLLM with sleep mode (CuMemAllocator pool): LLM.sleep(level) / LLM.wake_up(tags)",
    recipes={
        "train": _train("torch >= 2.1 (runtime expandable segments)"),
        "wake_up": (
            Step(
                "release_cache",
                "release_cache",
                "enter",
                {"collect_garbage": True, "ipc_collect": True},
                why=_HANDBACK,
                versions="all",
            ),
            Step(
                "expandable_segments",
                "expandable_segments",
                "scope",
                {"enabled": False},
                why="vLLM's sleep-mode pool asserts 'Expandable segments are not compatible "
                "with memory pool' (vllm/device_allocator/cumem.py)",
                versions="vLLM with sleep mode (0.7.x and later)",
            ),
        ),
        "weight_sync": _weight_sync("vLLM colocated IPC weight transfer; verl FSDP/Megatron"),
        "rollout": (
            Step(
                "expandable_segments",
                "expandable_segments",
                "scope",
                {"enabled": False},
                why="the KV cache and activations of generation live in vLLM's cumem pool, "
                "which cannot hold expandable blocks",
                versions="vLLM with sleep mode",
            ),
        ),
        "sleep": (
            Step(
                "release_cache",
                "release_cache",
                "exit",
                {"collect_garbage": True, "ipc_collect": True},
                why="what the engine frees in this process stays cached by torch unless released",
                versions="all",
            ),
        ),
    },
    notes={
        "train": "expandable segments on: less fragmentation for variable sequence lengths",
        "wake_up": "release first, then classic segments for vLLM's pool; wake weights, "
        "sync, free staging, then wake the KV cache (vLLM RFC #15254, verl #302)",
        "weight_sync": "classic-segment staging (ipc_safe), then ipc_collect + release",
        "rollout": "classic segments while generating",
        "sleep": "release what sleep freed (level 1 offloads weights to CPU, level 2 drops them)",
    },
)

SGLANG = BackendProfile(
    name="sglang",
    description="SGLang with torch_memory_saver: release_memory_occupation / "
    "resume_memory_occupation(tags)",
    recipes={
        "train": _train("torch >= 2.1 (runtime expandable segments)"),
        "wake_up": (
            Step(
                "release_cache",
                "release_cache",
                "enter",
                {"collect_garbage": True, "ipc_collect": True},
                why=_HANDBACK,
                versions="all",
            ),
            Step(
                "expandable_segments",
                "expandable_segments",
                "scope",
                {"enabled": False},
                why="torch_memory_saver refuses to start with expandable segments, and its "
                "regions cannot hold expandable blocks",
                versions="SGLang with torch_memory_saver (enable_memory_saver=True)",
            ),
        ),
        "weight_sync": _weight_sync(
            "SGLang update_weights_from_tensor",
            "; SGLang serialises CUDA IPC handles of the tensors it is given "
            "(update_weights_from_tensor), so they must not be in expandable segments",
        ),
        "rollout": (
            Step(
                "expandable_segments",
                "expandable_segments",
                "scope",
                {"enabled": False},
                why="torch_memory_saver regions cannot hold expandable blocks",
                versions="SGLang with torch_memory_saver",
            ),
        ),
        "sleep": (
            Step(
                "release_cache",
                "release_cache",
                "exit",
                {"collect_garbage": True, "ipc_collect": True},
                why="what the engine frees in this process stays cached by torch unless released",
                versions="all",
            ),
            Step(
                "await_free",
                "await_free",
                "exit",
                {"timeout_s": 5.0},
                why="release_memory_occupation can return before the scheduler process has "
                "freed the memory: confirm with device free memory before the trainer "
                "takes it back",
                versions="SGLang with torch_memory_saver",
            ),
        ),
    },
    notes={
        "train": "expandable segments on",
        "wake_up": "release first; multi-stage resume (weights, then kv_cache) lowered peak "
        "memory 192 -> 131.8 GB for Qwen-32B in SGLang's measurements",
        "weight_sync": "classic-segment staging, then ipc_collect + release",
        "rollout": "classic segments while generating",
        "sleep": "release, then wait until device free memory stops rising",
    },
)

DEFAULT = BackendProfile(
    name="default",
    description="engine-agnostic: the steps every colocated engine needs",
    recipes={
        "train": _train("torch >= 2.1"),
        "wake_up": (
            Step(
                "release_cache",
                "release_cache",
                "enter",
                {"collect_garbage": True, "ipc_collect": True},
                why=_HANDBACK,
                versions="all",
            ),
            Step(
                "expandable_segments",
                "expandable_segments",
                "scope",
                {"enabled": False},
                why="engine memory pools (vLLM cumem, torch_memory_saver) need classic segments",
                versions="all",
            ),
        ),
        "weight_sync": _weight_sync("all"),
        "rollout": (
            Step(
                "expandable_segments",
                "expandable_segments",
                "scope",
                {"enabled": False},
                why="engine memory pools need classic segments",
                versions="all",
            ),
        ),
        "sleep": (
            Step(
                "release_cache",
                "release_cache",
                "exit",
                {"collect_garbage": True, "ipc_collect": True},
                why="hand back what the engine freed",
                versions="all",
            ),
        ),
    },
    notes={"train": "expandable segments on", "rollout": "classic segments"},
)

BUILTIN: tuple[BackendProfile, ...] = (DEFAULT, SGLANG, VLLM)
