"""Offload the trainer around a rollout; works on a GPU and (moving nothing) on the CPU.

Run: ``python examples/offload_rollout.py``.
"""

from __future__ import annotations

import logging

import torch

import hybridmem as hm

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print(
            "no CUDA GPU here: the loop runs and nothing moves; on a GPU each step moves the "
            "parameters and Adam state to pinned host memory and back, and prints what the "
            "rollout engine could take"
        )
        logging.getLogger("hybridmem").setLevel(logging.WARNING)  # "nothing to move", once
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    offloader = hm.Offloader(model, optimizer, grads="drop")

    for step in range(3):
        with hm.expandable_segments(True):  # training
            loss = model(torch.randn(32, 1024, device=device)).square().mean()
            loss.backward()
            optimizer.step()

        report = offloader.offload()  # parameters and Adam state to pinned host memory
        print(f"step {step}: loss {float(loss.detach()):.4f}; {report}")
        if device == "cuda":
            print(hm.memory_info())  # what the rollout engine can now take
        # ... the rollout engine wakes up, generates, and sleeps here ...
        offloader.reload("parameters")  # first what the forward pass needs
        offloader.reload("optimizer")  # then what the optimizer step needs


if __name__ == "__main__":
    main()
