"""A verl-style sharding manager, decorated with hybridmem instead of hand-written lines.

The manager's ``__enter__`` wakes the engine and syncs weights, ``__exit__`` puts it to
sleep: the ``rollout`` phase spans every ``with manager:`` block, and the weight sync is
its own phase. The engine here is a stand-in with vLLM's method names, so this runs
anywhere (on the CPU the allocator steps are applied to torch's CPU settings and the
cache steps have nothing to release); replace it with ``vllm.LLM(...,
enable_sleep_mode=True)`` on a GPU.

Run: ``python examples/sharding_manager.py``.
"""

from __future__ import annotations

import logging

import torch

import hybridmem as hm

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
BACKEND = "vllm"


class StandInLLM:
    """Has what hybridmem calls on a vLLM ``LLM``: ``sleep(level)`` and ``wake_up(tags)``."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def sleep(self, level: int = 1) -> None:
        print(f"  engine: sleep(level={level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        print(f"  engine: wake_up(tags={tags})")

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        self.weights = {k: v.clone() for k, v in named.items()}

    def generate(self, prompts: list[str]) -> list[str]:
        return [p + " ..." for p in prompts]


@hm.phase("rollout", backend=BACKEND)  # classic segments for the whole `with manager:` block
class ShardingManager:
    """What verl's FSDP-vLLM sharding manager does, without the memory bookkeeping."""

    def __init__(self, model: torch.nn.Module, llm: StandInLLM) -> None:
        self.model = model
        self.llm = llm

    def __enter__(self) -> ShardingManager:
        with hm.phase("wake_up", backend=BACKEND):  # trainer cache released first
            self.llm.wake_up(tags=["weights"])
            self.update_weights()
            self.llm.wake_up(tags=["kv_cache"])
        return self

    def __exit__(self, *exc: object) -> None:
        with hm.phase("sleep", backend=BACKEND):  # what sleep frees is released after
            self.llm.sleep(level=1)

    @hm.phase("weight_sync", backend=BACKEND)  # IPC-safe staging, then ipc_collect + release
    def update_weights(self) -> None:
        self.llm.load_weights(self.model.state_dict())


@hm.phase("train", backend=BACKEND)  # expandable segments while training
def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    loss = model(torch.randn(16, 64)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"  in training: expandable={hm.allocator_state().expandable_segments}")
    return float(loss.item())


def main() -> None:
    if not torch.cuda.is_available():
        print(
            "no CUDA GPU here: the phases switch torch's settings around a stand-in engine; "
            "on a GPU their releases also hand the trainer's cached memory to the engine"
        )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    llm = StandInLLM()
    manager = ShardingManager(model, llm)
    for step in range(2):
        loss = train_step(model, optimizer)
        with manager:
            outputs = llm.generate(["hello"])
            print(f"  in rollout: expandable={hm.allocator_state().expandable_segments}")
        same = all(torch.equal(llm.weights[k], v) for k, v in model.state_dict().items())
        print(f"step {step}: loss {loss:.4f}; {outputs[0]!r}; engine has the new weights: {same}")


if __name__ == "__main__":
    main()
