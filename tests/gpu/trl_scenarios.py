"""The TRL drop-in on a GPU, over vLLM's own sleep-mode pool; one scenario per interpreter.

Usage: ``HYBRIDMEM_VLLM_FILES=<wheel or folder> python -m tests.gpu.trl_scenarios NAME``;
the last line printed is a JSON object of facts.

TRL's ``VLLMGeneration`` is the tests' stand-in (its calls checked against TRL's source
by ``tests/test_trl_colocate.py``); its engine here is vLLM's ``CuMemAllocator`` (loaded
from vLLM's files): the weights and the KV cache are real allocations of the pool,
``sleep(level=2)`` discards both as vLLM's ``LLM.sleep`` does, ``wake_up(tags)`` maps
them again. The trainer is a model with a real AdamW state on the GPU, and ballast
leaves the device short of the KV cache by a set amount once the weights are awake: the
KV wake fits only if the drop-in offloads enough optimizer state first.
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

import hybridmem as hm
from hybridmem.integrations.trl import colocate
from hybridmem.integrations.vllm.sleep_files import load_cumem
from hybridmem.integrations.vllm.sleep_state import asleep_bytes
from tests.trl_standin import Trainer, VLLMGeneration

GiB = 1 << 30


class PoolEngine:
    """vLLM's ``LLM`` as TRL calls it, over vLLM's own pool: weights and KV cache in it."""

    def __init__(self, allocator: Any, weight_bytes: int, kv_bytes: int) -> None:
        self.allocator = allocator
        with allocator.use_memory_pool(tag="weights"):
            self.weights = torch.zeros(weight_bytes // 4, device="cuda")
        with allocator.use_memory_pool(tag="kv_cache"):
            self.kv = torch.zeros(kv_bytes, dtype=torch.uint8, device="cuda")
        self.loaded = 0
        model = types.SimpleNamespace(load_weights=self._load_weights)
        runner = types.SimpleNamespace(model=model)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(model_runner=runner)
            )
        )

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in weights:
            flat = tensor.detach().reshape(-1)
            if self.loaded + flat.numel() > self.weights.numel():
                self.loaded = 0  # the pool's weights are smaller than the model: wrap
            self.weights[self.loaded : self.loaded + flat.numel()].copy_(flat)
            self.loaded += flat.numel()

    def sleep(self, level: int = 1) -> None:
        torch.cuda.synchronize()  # vLLM's worker sleeps between steps, its kernels done
        self.allocator.sleep(offload_tags=() if level == 2 else ("weights",))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.allocator.wake_up(tags)

    def generate(
        self, prompts: list[Any], sampling_params: Any = None, use_tqdm: bool = True
    ) -> Any:
        self.kv.fill_(1)  # the KV cache written: mapped, or the process faults
        torch.cuda.synchronize()
        return [[1] for _ in prompts]

    def reset_prefix_cache(self) -> None:
        return None


def _checksum(optimizer: torch.optim.Optimizer) -> float:
    return float(sum(t.double().sum() for s in optimizer.state.values() for t in s.values()))


def offload_by_need() -> dict[str, Any]:
    """One TRL generate on a device left 1.5 GiB short of the KV cache."""
    torch.zeros(1, device="cuda")
    allocator = load_cumem(os.environ["HYBRIDMEM_VLLM_FILES"]).CuMemAllocator.get_instance()
    weight_bytes, kv_bytes = 1 * GiB, 8 * GiB
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4096, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state_bytes = sum(t.nbytes for s in optimizer.state.values() for t in s.values())
    before = _checksum(optimizer)

    generation = VLLMGeneration(model)
    engine = PoolEngine(allocator, weight_bytes, kv_bytes)
    generation.llm = engine  # type: ignore[assignment]  # vLLM's pool in the stand-in's place
    engine.sleep(level=2)  # as TRL's start-up leaves it
    handle = colocate(Trainer(generation, optimizer), offload_optimizer=True)

    hm.release_cache()
    free, _ = torch.cuda.mem_get_info()
    short = int(1.5 * GiB)
    ballast_bytes = free - weight_bytes - (kv_bytes - short)
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda")
    kv_need = asleep_bytes("kv_cache")
    generation.generate([[1, 2]], None, 1)
    plan = handle.last_plan
    after = _checksum(optimizer)
    del ballast
    return {
        "torch": torch.__version__,
        "state_bytes": state_bytes,
        "kv_need": kv_need,
        "short": short,
        "plan": None if plan is None else plan.as_dict(),
        "offloaded_at_end": handle.offloaded_groups(),
        "state_intact": before == after,
        "loaded": engine.loaded,
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {"offload_by_need": offload_by_need}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
