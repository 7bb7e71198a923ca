"""The card's three primitives, stacked on a sharding manager and around a resharding function.

``expandable_segments(False)``, ``aggressive_cache_release()`` and ``ipc_safe()`` are
what a hybrid engine needs around its rollout side: classic segments for the engine's
pool and for CUDA IPC without ``pidfd_getfd``, and the trainer's cached memory handed
back. Decorating the manager class covers every ``with manager:`` block; the same three
as ``with`` blocks cover one function. ``hm.phase(..., backend="vllm")`` or
``"sglang"`` composes the recipe each engine needs from the same primitives.

Runs anywhere: on a machine without a GPU the allocator toggles act on torch's settings
all the same, the cache release has nothing to free, and ``ipc_safe`` says (once) that
tensors would go through host memory.

    python examples/card.py
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import hybridmem as hm


class StandInEngine:
    """What a sharding manager talks to: vLLM's or SGLang's wake/sleep and weight loading."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.tags: list[str] = []

    def wake_up(self, tags: list[str]) -> None:
        self.tags += tags

    def sleep(self, level: int = 1) -> None:
        self.tags.clear()

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights.update((name, tensor.clone()) for name, tensor in named)

    def generate(self, prompt: torch.Tensor) -> torch.Tensor:
        return prompt @ self.weights["weight"].T + self.weights["bias"]


def expandable() -> bool:
    return hm.allocator_state().expandable_segments


def reshard_and_send(model: torch.nn.Module, engine: StandInEngine) -> str:
    """The weight-resharding function: staging tensors made here are IPC-shareable."""
    with (
        hm.expandable_segments(False),
        hm.aggressive_cache_release(),
        hm.ipc_safe() as shareable,
    ):
        staging = {name: p.detach().clone() for name, p in model.named_parameters()}
        engine.load_weights(staging.items())
        return shareable.transport  # "cuda" on a GPU; "host" where CUDA IPC is impossible


@hm.expandable_segments(False)  # the engine's pool and CUDA IPC need classic segments
@hm.aggressive_cache_release()  # the trainer's cached memory goes back on the way out
@hm.ipc_safe()  # what is allocated in the block can be shared without pidfd_getfd
class ShardingManager:
    """A verl-style manager: the three scopes span every ``with manager:`` block."""

    def __init__(self, model: torch.nn.Module, engine: StandInEngine, backend: str) -> None:
        self.model, self.engine, self.backend = model, engine, backend
        self.transport = ""

    def __enter__(self) -> ShardingManager:
        self.engine.wake_up(tags=["weights"])
        with hm.phase("weight_sync", backend=self.backend):
            self.transport = reshard_and_send(self.model, self.engine)
        self.engine.wake_up(tags=["kv_cache"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.sleep(level=1)


def main() -> None:
    if not torch.cuda.is_available():
        print(
            "no CUDA GPU here: the scopes switch torch's settings and the weights go through "
            "host memory; on a GPU they go over CUDA IPC from classic segments"
        )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prompt = torch.randn(2, 8)
    for step, backend in enumerate(("vllm", "sglang")):
        with hm.phase("train", backend=backend):
            loss = model(prompt).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"[{backend}] step {step}: loss {loss.item():.4f}, ", end="")
            print(f"training: expandable={expandable()}")
        engine = StandInEngine()
        with (
            ShardingManager(model, engine, backend) as manager,
            hm.phase("rollout", backend=backend),
        ):
            same = torch.equal(engine.generate(prompt), model(prompt).detach())
            print(
                f"[{backend}] rollout: expandable={expandable()}, engine tags {engine.tags}, "
                f"weights sent over {manager.transport!r}, "
                f"engine output equals the trainer's: {same}"
            )
        scopes = hm.allocator_state().scopes
        print(f"[{backend}] after rollout: expandable={expandable()}, scopes {scopes}")


if __name__ == "__main__":
    main()
