"""What the docs' code blocks leave to the reader, made small and real, for tests/test_docs.py.

The blocks in README.md and docs/ name a model, an optimizer, an engine, prompts and a
training step without building them, as docs do. :func:`namespace` builds each of
them the smallest way that still runs the block on the CPU: a real ``torch.nn``
model and optimizer (one step taken, so optimizer state exists), an engine with
vLLM's and SGLang's method names that records what it was asked, a real
``hm.HybridSwitch`` over it. Blocks that need a GPU are marked in the docs
(``<!-- docs: gpu -->``) and only compiled and imported.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue as queue_module
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

import hybridmem
import hybridmem as hm

__all__ = ["namespace"]


class StandInEngine:
    """vLLM's ``LLM`` and SGLang's ``Engine`` as hybridmem and the docs call them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}

    # vLLM
    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({tags})")

    # SGLang
    def release_memory_occupation(self) -> None:
        self.calls.append("release_memory_occupation()")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"resume_memory_occupation({tags})")

    # both
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]] | dict[str, Any]) -> None:
        pairs = named.items() if isinstance(named, dict) else named
        self.weights.update((name, tensor.detach().clone()) for name, tensor in pairs)

    def generate(self, prompts: list[str]) -> list[str]:
        self.calls.append("generate")
        return [f"{prompt} ..." for prompt in prompts]


class MyEngineAdapter(hm.EngineAdapter):
    """A plugin's adapter, as docs/phases.md registers one."""

    def __init__(self, engine: object) -> None:
        super().__init__(engine, ("sleep", "wake_up"))


@dataclass
class PackedSeqParams:
    """Megatron's ``PackedSeqParams``: the fields ``PackedBatch.seq_params()`` fills."""

    qkv_format: str = "thd"
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: Any = None
    max_seqlen_kv: Any = None


def _trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()  # the optimizer's state exists, as after a warm-up step
    optimizer.zero_grad()
    return model, optimizer


def namespace(doc: str) -> dict[str, Any]:
    """The names the blocks of ``doc`` (a path relative to the repository) may use."""
    model, optimizer = _trainer()
    engine = StandInEngine()

    def train_step(*args: object) -> None:
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def generate(*args: object) -> list[str]:
        return engine.generate(["hello"])

    names: dict[str, Any] = {
        "__name__": "__docs__",
        "hm": hm,
        "hybridmem": hybridmem,
        "torch": torch,
        "logger": logging.getLogger("docs"),
        "model": model,
        "optimizer": optimizer,
        "build_model": lambda: _trainer()[0],
        "build_trainer": _trainer,
        "engine": engine,
        "llm": engine,
        "prompts": ["hello", "world"],
        "steps": 2,
        "train_step": train_step,
        "generate": generate,
        "rollout": generate,
        "reshard_and_send": lambda module: engine.load_weights(module.state_dict()),
        "push_weights": lambda adapter: engine.load_weights(model.state_dict()),
        "queue": queue_module.Queue(),
        "conn": multiprocessing.Pipe()[0],
        "MyEngineAdapter": MyEngineAdapter,
        "PackedSeqParams": PackedSeqParams,
    }
    names["switch"] = hm.HybridSwitch(
        hm.VLLMEngine(engine),
        "vllm",
        hm.Offloader(optimizer),
        sync_weights=lambda adapter: engine.load_weights(model.state_dict()),
    )
    if doc == "docs/packing.md":
        names.update(_packing())
    return names


def _packing() -> dict[str, Any]:
    """A right-padded batch and a model that takes the packed layout, for docs/packing.md."""
    lengths = [3, 5, 2]
    input_ids = torch.zeros(3, 6, dtype=torch.long)
    attention_mask = torch.zeros(3, 6, dtype=torch.bool)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.arange(1, length + 1)
        attention_mask[row, :length] = True
    embed = torch.nn.Embedding(16, 8)

    def model(tokens: torch.Tensor, packed_seq_params: PackedSeqParams) -> torch.Tensor:
        assert packed_seq_params.cu_seqlens_q is not None
        out: torch.Tensor = embed(tokens)
        return out

    packed_model: Callable[..., torch.Tensor] = model
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "lengths": lengths,
        "tp": 2,
        "model": packed_model,
    }
