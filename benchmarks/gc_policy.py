"""What a switch's release pays for garbage collection, and what the young-first gate saves.

In a trainer process (a transformers Llama and its AdamW state when transformers is
importable, else torch modules, after a few training steps, so the Python heap is
a real one), each measured the median of ``--repeats``:

- ``release_cache()``: a full ``gc.collect()`` pass (what a switch paid per direction);
- ``release_cache(collect_garbage="young")``: generations 0 and 1 only;
- ``GarbageGate.release``, idle: the switch's default (young first; a full pass only
  when more device memory stayed allocated than last time at that point);
- the same gate after a reference cycle holding 1 GiB of device memory was planted
  and aged into generation 2 (a plain young collection cannot free it): whether the
  gate freed it, and what that release cost.

Targets (issue #12): the idle gate <= 10 ms, and the planted gigabyte freed.

Run on a GPU: ``python benchmarks/gc_policy.py [--repeats 10] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1 << 30


def _trainer() -> tuple[Any, Any, str]:
    import torch

    if importlib.util.find_spec("transformers") is not None:
        transformers: Any = importlib.import_module("transformers")  # optional

        config = transformers.LlamaConfig(
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=8,
            intermediate_size=2816,
            vocab_size=32768,
        )
        model = transformers.LlamaForCausalLM(config).cuda()
        name = "transformers LlamaForCausalLM"
    else:
        layer = torch.nn.TransformerEncoderLayer(1024, 8, 4096, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 16).cuda()
        name = "torch TransformerEncoder"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(3):
        if name.startswith("transformers"):
            tokens = torch.randint(0, 32768, (4, 512), device="cuda")
            loss = model(input_ids=tokens, labels=tokens).loss
        else:
            loss = model(torch.randn(4, 512, 1024, device="cuda")).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, name


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


class _Holder:
    """One half of a reference cycle."""

    partner: Any = None
    tensor: Any = None


def _plant() -> None:
    """A cycle holding 1 GiB of device memory, aged into generation 2, then dropped."""
    import torch

    first, second = _Holder(), _Holder()
    first.partner, second.partner = second, first
    first.tensor = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    gc.collect()  # reachable now: both halves move to the oldest generation
    del first, second  # garbage only a full pass finds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch

    from hybridmem.scopes.garbage import GarbageGate
    from hybridmem.scopes.release import release_cache

    model, optimizer, name = _trainer()
    torch.cuda.synchronize()
    out: dict[str, Any] = {"trainer": name, "python_objects": len(gc.get_objects())}
    out["full_ms"] = _median_ms(lambda: release_cache(), args.repeats)
    out["young_ms"] = _median_ms(lambda: release_cache(collect_garbage="young"), args.repeats)
    gate = GarbageGate()
    gate.release(None, "point")  # its reference
    out["gate_idle_ms"] = _median_ms(lambda: gate.release(None, "point"), args.repeats)
    out["gate_idle_full_passes"] = gate.full_passes - 1

    _plant()
    young = release_cache(collect_garbage="young")
    out["young_alone_freed_gib"] = (young.allocated_before - young.allocated_after) / GiB
    allocated = torch.cuda.memory_allocated()
    started = time.perf_counter()
    gate.release(None, "point")
    out["gate_planted_ms"] = (time.perf_counter() - started) * 1e3
    out["gate_planted_freed_gib"] = (allocated - torch.cuda.memory_allocated()) / GiB
    out["gate_full_passes_after_plant"] = gate.full_passes - 1
    del model, optimizer

    print(
        f"trainer: {name}, {out['python_objects']} Python objects\n"
        f"release_cache, full gc pass:      {out['full_ms']:7.2f} ms\n"
        f"release_cache, young generations: {out['young_ms']:7.2f} ms\n"
        f"gate, idle (switch default):      {out['gate_idle_ms']:7.2f} ms "
        f"(full passes: {out['gate_idle_full_passes']}; target <= 10 ms)\n"
        f"planted 1 GiB cycle in generation 2: a young collection alone freed "
        f"{out['young_alone_freed_gib']:.2f} GiB; the gate freed "
        f"{out['gate_planted_freed_gib']:.2f} GiB in {out['gate_planted_ms']:.1f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
