"""A stand-in of TRL 1.16.0's ``VLLMGeneration`` (colocate mode) over a recording engine.

Its ``_init_vllm``, ``sync_weights`` and ``generate`` make TRL's engine calls in TRL's
order, with TRL's arguments: ``tests/test_trl_colocate.py`` checks that against TRL's
own source (:func:`tests.trl_source.engine_calls` reads both), so the drop-in's tests
that run on this stand-in run on TRL's sequence. The engine records each call and can
be told to fail one.
"""

from __future__ import annotations

import types
from typing import Any

import torch


class Engine:
    """vLLM's ``LLM`` as TRL calls it: sleep, wake_up, generate, load_weights; recorded."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.fail: dict[str, BaseException] = {}  # call name -> raised once
        model = types.SimpleNamespace(load_weights=self._load_weights)
        runner = types.SimpleNamespace(model=model)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(model_runner=runner)
            )
        )

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise self.fail.pop(name)

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, _ in weights:
            self._call("load_weights", name)

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", None if tags is None else tuple(tags))

    def generate(
        self, prompts: list[Any], sampling_params: Any = None, use_tqdm: bool = True
    ) -> list[Any]:
        self._call("generate", len(prompts))
        return [[*list(p), 7] for p in prompts]

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")


def empty_cache() -> None:
    """TRL's ``empty_cache()`` (the accelerator's cache emptied), recorded."""
    CALLS.append(("empty_cache",))


CALLS: list[tuple[Any, ...]] = []


class VLLMGeneration:
    """TRL 1.16.0's VLLMGeneration, colocate mode, reduced to its engine calls."""

    def __init__(
        self, model: torch.nn.Module, *, enable_sleep_mode: bool = True, mode: str = "colocate"
    ) -> None:
        self.model = model
        self.mode = mode
        self.enable_sleep_mode = enable_sleep_mode
        self._init_vllm()

    def _init_vllm(self) -> None:
        self.llm = Engine(CALLS)
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
        self._llm_weights_sleeping = self.enable_sleep_mode

    def sync_weights(self) -> None:
        if self.mode == "colocate" and self.enable_sleep_mode:
            empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        for name, param in self.model.named_parameters():
            self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(
                [(name, param)]
            )
        self.llm.reset_prefix_cache()

    def generate(
        self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None
    ) -> Any:
        if self.mode == "colocate" and self.enable_sleep_mode and self._llm_weights_sleeping:
            self.sync_weights()
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        sampling_params = None
        outputs = self.llm.generate(prompts, sampling_params=sampling_params, use_tqdm=False)
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
            self._llm_weights_sleeping = True
        return outputs


class Trainer:
    """What the drop-in reads of a TRL trainer: ``vllm_generation`` and ``optimizer``."""

    def __init__(self, generation: VLLMGeneration, optimizer: Any = None) -> None:
        self.vllm_generation = generation
        self.optimizer = optimizer
