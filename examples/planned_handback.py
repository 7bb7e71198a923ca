"""Hand the rollout only what it needs: a HybridSwitch planned by need.

Offloading the whole optimizer state at every switch moves bytes the rollout may not
need: the device often has part of its need free already. Told what the rollout needs
(``rollout_need=``: bytes, a callable asked each cycle, or ``"engine"`` for the engine's
own memory setting), the switch releases its cache, reads what is free, and offloads
only the deficit plus a 256 MiB margin: optimizer state first, parameters last (the
weight sync reads them); nothing when nothing is short. ``switch.plan`` says what moved
and why. The engine here is a stand-in with SGLang's method names that holds a KV cache
as large as it is told; the rollout it serves lacks a quarter of the optimizer state.

Run on a GPU: ``python examples/planned_handback.py``. (Without one it says so and exits.)
"""

from __future__ import annotations

import logging

import torch

import hybridmem as hm

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
MiB = 1 << 20


class StandInEngine:
    """Has what hybridmem calls on an ``sglang.Engine``; its KV cache is ``kv_bytes``."""

    def __init__(self, kv_bytes: int) -> None:
        self.kv_bytes = kv_bytes
        self.kv: torch.Tensor | None = None

    def release_memory_occupation(self) -> None:
        self.kv = None
        torch.cuda.empty_cache()  # an engine's sleep gives its memory back to the driver

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        if tags is None or "kv_cache" in tags:
            self.kv = torch.empty(self.kv_bytes, dtype=torch.uint8, device="cuda")


def main() -> None:
    if not torch.cuda.is_available():
        print("planned_handback.py needs a CUDA GPU: the plan is made from device memory")
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 16384), torch.nn.GELU(), torch.nn.Linear(16384, 4096)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train() -> float:
        with hm.phase("train", backend="sglang"):
            loss = model(torch.randn(64, 4096, device="cuda")).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss)

    train()  # the optimizer state exists from here on
    moments = sum(
        t.nbytes
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.is_cuda
    )
    hm.release_cache()
    # A rollout that needs all of today's free memory and a quarter of the optimizer
    # state besides (less the margin the switch keeps).
    need = torch.cuda.mem_get_info()[0] + moments // 4 - 256 * MiB
    engine = StandInEngine(need)
    switch = hm.HybridSwitch(
        hm.SGLangEngine(engine), "sglang", hm.Offloader(optimizer), rollout_need=need
    )
    for step in range(3):
        loss = train()
        with switch.rollout():
            assert engine.kv is not None
            engine.kv[: 1 << 20].fill_(1)  # generating writes the KV cache
        plan = switch.plan
        moved = plan.nbytes if plan is not None else 0
        print(f"step {step}: loss {loss:.4f}; moved {moved / MiB:.0f} of {moments / MiB:.0f} MiB")
        print(f"  {plan}")


if __name__ == "__main__":
    main()
