"""hybridmem quick start: one training step and one "rollout", on a GPU or the CPU.

Run: ``python examples/quickstart.py``. On a machine without a GPU every
primitive still runs (allocator settings are applied to torch's config; there is
no device memory to release), so the same script works in CI.
"""

from __future__ import annotations

import logging

import torch

import hybridmem as hm

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")


@hm.expandable_segments(True)  # training: expandable segments fight fragmentation
def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str) -> float:
    """One optimisation step on random data of a random sequence length."""
    seq = int(torch.randint(16, 128, ()).item())
    x = torch.randn(8, seq, 256, device=device)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@hm.expandable_segments(False)  # rollout engines' memory pools need classic segments
def rollout(model: torch.nn.Module, device: str) -> torch.Tensor:
    """Stand-in for generation: a forward pass without gradients."""
    with torch.no_grad():
        out: torch.Tensor = model(torch.randn(4, 32, 256, device=device))
    return out


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print(
            "no CUDA GPU here: the settings are applied and each release has nothing to "
            "return; on a GPU each step hands the trainer's cached memory back to the device"
        )
    # Process defaults at start-up; explicit choices in PYTORCH_ALLOC_CONF /
    # PYTORCH_CUDA_ALLOC_CONF win over these unless force=True.
    hm.set_allocator_defaults(garbage_collection_threshold=0.8)
    print(hm.allocator_state())

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for step in range(3):
        loss = train_step(model, optimizer, device)
        # hand the trainer's cached memory to the rollout engine (another process)
        report = hm.release_cache()
        out = rollout(model, device)
        print(
            f"step {step}: loss {loss:.4f}, rollout {tuple(out.shape)}, "
            f"returned {report.bytes_returned} bytes"
        )

    if device == "cuda":
        print(hm.memory_info())


if __name__ == "__main__":
    main()
