"""The built-in profiles: ``vllm``, ``sglang`` and ``default``. They never import an engine.

Each step names its evidence; docs/backends/ explains them at length.
"""

from __future__ import annotations

from hybridmem.scopes.engines import SGLangEngine, VLLMEngine
from hybridmem.scopes.profiles import BackendProfile, Step, When

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
_ENGINE_FREED = "what the engine frees in this process stays cached by torch unless released"
_TORCH = "torch >= 2.1 (runtime expandable segments)"
_COMMUNICATORS = (
    "the trainer's NCCL communicators hold device memory through the rollout, outside "
    "torch's allocator: 7-10 GB a rank in a Megatron 3D+EP MoE run (verl#6266), ~7 GB "
    "dense and ~9.5 GB MoE given back by ncclCommSuspend (verl#6408); opt-in "
    "(suspend_communicators=True): collective, every rank must enter the phase"
)
_NCCL = "NCCL >= 2.29.7 (ncclCommSuspend); older: one warning, nothing changes"


def _expandable(enabled: bool, why: str, versions: str) -> Step:
    return Step(
        "expandable_segments", "expandable_segments", "scope", {"enabled": enabled}, why, versions
    )


def _release(when: When, why: str, *, collect_garbage: bool = True) -> Step:
    args = {"collect_garbage": collect_garbage, "ipc_collect": True}
    return Step("release_cache", "release_cache", when, args, why, "all")


def _recipes(
    classic_why: str, classic_versions: str, sync_versions: str, sync_why: str = ""
) -> dict[str, tuple[Step, ...]]:
    """The recipe every colocated engine shares; engines differ in the evidence."""
    return {
        "train": (_expandable(True, _FRAGMENTATION, _TORCH),),
        "wake_up": (
            _release("enter", _HANDBACK),
            _expandable(False, classic_why, classic_versions),
        ),
        "weight_sync": (
            Step(
                "ipc_safe",
                "ipc_safe",
                "scope",
                {"fallback": "auto"},
                _PIDFD + sync_why,
                sync_versions,
            ),
            _release("exit", _STAGING, collect_garbage=False),
        ),
        "rollout": (
            _expandable(False, classic_why, classic_versions),
            Step(
                "suspend_communicators",
                "suspend_communicators",
                "scope",
                {},
                _COMMUNICATORS,
                _NCCL,
                opt_in=True,
            ),
        ),
        "sleep": (_release("exit", _ENGINE_FREED),),
    }


_VLLM_POOL = (
    "vLLM's sleep-mode pool cannot use expandable segments (torch#147851): vLLM up to 0.19 "
    "asserts, 0.22 to 0.30 turn them off inside it dropping the other settings, 0.31 and "
    "later keeping them (vllm/device_allocator/cumem.py); "
    "weights, KV cache and generation live in it"
)
VLLM = BackendProfile(
    name="vllm",
    description="vLLM with sleep mode (CuMemAllocator pool): LLM.sleep(level) / LLM.wake_up(tags)",
    recipes=_recipes(
        _VLLM_POOL,
        "vLLM with sleep mode (0.7.x and later)",
        "vLLM colocated IPC weight transfer; verl FSDP/Megatron",
    ),
    notes={
        "train": "expandable segments on: less fragmentation for variable sequence lengths",
        "wake_up": "release first, then classic segments for vLLM's pool; wake weights, "
        "sync, free staging, then wake the KV cache (vLLM RFC #15254, verl #302)",
        "weight_sync": "classic-segment staging (ipc_safe), then ipc_collect + release",
        "rollout": "classic segments while generating",
        "sleep": "release what sleep freed (level 1 offloads weights to CPU, level 2 drops them); "
        "level 1: integrations.vllm.sleep_backup.PoolBackup pins their host copy once at "
        "start-up (vLLM pins it at the first sleep: 6.6 s at 16 GiB on an H100, 0.4 s after)",
    },
    adapter=VLLMEngine,
)

_SGLANG_RECIPES = _recipes(
    "torch_memory_saver refuses to start with expandable segments, and its regions "
    "cannot hold expandable blocks",
    "SGLang with torch_memory_saver (enable_memory_saver=True)",
    "SGLang update_weights_from_tensor",
    "; SGLang serialises CUDA IPC handles of the tensors it is given "
    "(update_weights_from_tensor), so they must not be in expandable segments",
)
_SGLANG_RECIPES["sleep"] = (
    _release("exit", _ENGINE_FREED),
    Step(
        "await_free",
        "await_free",
        "exit",
        {"timeout_s": 5.0},
        "release_memory_occupation can return before the scheduler process has freed the "
        "memory: confirm with device free memory before the trainer takes it back",
        "SGLang with torch_memory_saver",
    ),
)
SGLANG = BackendProfile(
    name="sglang",
    description="SGLang with torch_memory_saver: release_memory_occupation / "
    "resume_memory_occupation(tags)",
    recipes=_SGLANG_RECIPES,
    adapter=SGLangEngine,
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
    recipes=_recipes(
        "engine memory pools (vLLM cumem, torch_memory_saver) need classic segments",
        "all",
        "all",
    ),
    notes={"train": "expandable segments on", "rollout": "classic segments"},
)

BUILTIN: tuple[BackendProfile, ...] = (DEFAULT, SGLANG, VLLM)
