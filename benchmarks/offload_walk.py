"""The host's share of a planned offload: walking the trainer state's tensors.

A switch planned by need (``HybridSwitch(rollout_need=...)``) asks the Offloader what
is resident (a walk of every parameter, gradient and optimizer-state tensor: Python
work per storage, whatever their size), then offloads the deficit. Where the deficit
is small, its copies take milliseconds and this host work shows beside them. This
prints, for Llama-shaped trainer states (tiny tensors: only their number matters,
75 / 291 / 723 parameters for 8 / 32 / 80 layers, the last two Llama-3-8B's and
-70B's counts, with AdamW's two moments each):

- ``walk``: one ``Offloader.resident()``, ms and µs per storage, against a
  hand-written loop over the same tensors that only collects their storages'
  sizes (what a framework writes: no views, tied weights, DTensors or sparse
  tensors looked at), measured in the same run;
- ``planned``: ``resident()`` then ``offload(max_bytes=one storage)`` and its
  ``reload()`` (the plan and the smallest move), with ``keep_walk=True`` (the
  offload takes the plan's walk, as ``HybridSwitch`` does) against without it (the
  targets walked twice), in the same run.

On a CUDA machine the tensors are on the GPU. Without one, CPU tensors stand in:
the seam is told that they are device tensors and not to pin the pool (the walk and
the bookkeeping are the same Python; the copies are host memcpys of a few KiB).

Run: ``python benchmarks/offload_walk.py [--layers 8 32 80] [--device auto] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import hybridmem as hm

LAYERS = (8, 32, 80)


def llama_like(layers: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with Llama's tensor count per layer (7 matrices, 2 norms), AdamW stepped."""
    width = 8
    modules: list[torch.nn.Module] = [torch.nn.Embedding(16, width)]
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width, bias=False) for _ in range(7)]
        modules += [torch.nn.LayerNorm(width, bias=False) for _ in range(2)]
    modules += [torch.nn.LayerNorm(width, bias=False), torch.nn.Linear(width, 16, bias=False)]
    model = torch.nn.Sequential(*modules).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return model, optimizer


def hand_written(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """The loop a framework writes: each distinct storage's size, nothing else checked."""
    seen: set[int] = set()
    sizes: list[int] = []
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    kind = tensors[0].device.type
    for tensor in tensors:
        if tensor.dim() == 0 and tensor.device.type != kind:
            continue  # AdamW's step counters stay on the host
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            sizes.append(storage.nbytes())
    return sizes


def best_ms(fn: Callable[[], object], repeat: int = 7, number: int = 20) -> float:
    """Best of ``repeat`` means over ``number`` calls, in ms (load only adds time)."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return min(samples) * 1e3


def measure(layers: int, device: str) -> dict[str, Any]:
    """One trainer state's walk and planned move, each beside its baseline."""
    model, optimizer = llama_like(layers, device)
    off = hm.Offloader(model, optimizer)
    storages = len(off.resident())
    smallest = min(size for group, size in off.resident() if group == "optimizer")

    def planned(keep_walk: bool) -> Callable[[], None]:
        def run() -> None:
            off.resident(keep_walk=keep_walk)
            off.offload(max_bytes=smallest)
            off.reload()

        return run

    walk = best_ms(off.resident)
    hand = best_ms(lambda: hand_written(model, optimizer))
    kept = best_ms(planned(True))
    twice = best_ms(planned(False))
    off.close()
    return {
        "layers": layers,
        "parameters": sum(1 for _ in model.parameters()),
        "storages": storages,
        "walk_ms": walk,
        "walk_us_per_storage": walk * 1e3 / storages,
        "hand_written_ms": hand,
        "walk_over_hand_written": walk / hand,
        "planned_kept_walk_ms": kept,
        "planned_two_walks_ms": twice,
        "kept_over_two_walks": kept / twice,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=list(LAYERS), help="model depths to measure"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the tensors live (auto: cuda where there is one; cpu: the stand-in)",
    )
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # CPU tensors count as device tensors; the pool is not pinned
        from tests.conftest import treat_cpu_as_device

        treat_cpu_as_device()
    print(f"torch {torch.__version__}, tensors on {device}")
    print(
        f"{'layers':>6} {'params':>6} {'storages':>8} {'walk ms':>8} {'us/stor':>8} "
        f"{'hand ms':>8} {'x hand':>7} {'planned ms':>10} {'2 walks ms':>10} {'ratio':>6}"
    )
    rows = []
    for layers in args.layers:
        row = measure(layers, device)
        rows.append(row)
        print(
            f"{row['layers']:>6} {row['parameters']:>6} {row['storages']:>8} "
            f"{row['walk_ms']:>8.3f} {row['walk_us_per_storage']:>8.2f} "
            f"{row['hand_written_ms']:>8.3f} {row['walk_over_hand_written']:>7.2f} "
            f"{row['planned_kept_walk_ms']:>10.3f} {row['planned_two_walks_ms']:>10.3f} "
            f"{row['kept_over_two_walks']:>6.2f}"
        )
    print(
        "walk: one Offloader.resident(); x hand: against the hand-written loop; planned: "
        "resident(keep_walk=True) + offload(one storage) + reload(), against the same "
        "with two walks (ratio < 1: the kept walk saves that much)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
