"""Where vLLM's sleep and wake spend their time, beside hybridmem's backend on the same pool.

vLLM 0.33's own ``CuMemAllocator`` (its wheel's files: ``--vllm-files`` or
``HYBRIDMEM_VLLM_FILES``) holds an engine's memory as an engine makes it: ``--layers``
layers of weights (seven tensors each, as a Llama layer, ``--weights-gib`` in all, each
its own allocation as vLLM's loader makes them) and a KV cache of two tensors per layer
(``--kv-gib``). Each round sleeps at level 2, waits ``--gap-s`` (the trainer's step:
the driver finishes taking back what a sleep unmapped, and a wake right after a fast
sleep waits for it), and wakes ``["weights"]`` then ``["kv_cache"]``, as verl does:

- ``cumem``: vLLM's ``CuMemBackend`` (its ``sleep_mode_backend.py``), timed whole;
- its parts, in the same state: the ``gc.collect()`` and ``empty_cache()`` its
  ``wake_up`` and ``sleep`` run every call, and its mapping loop alone (vLLM's
  ``create_and_map`` per allocation, the same calls its ``wake_up`` makes);
- ``hybridmem``: hybridmem's backend (``--sleep-mode-backend hybridmem``).

Each figure is the median of ``--rounds``, in one process per size. Run on a GPU:
``python benchmarks/vllm_wake_anatomy.py --vllm-files PATH [--kv-gib 8 32]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

MiB, GiB = 1 << 20, 1 << 30


def _timed(fn: Callable[[], Any]) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def one(
    weights_gib: float, kv_gib: float, layers: int, rounds: int, files: str, gap_s: float
) -> dict[str, Any]:
    """Measure one size in this process; return its row."""
    import torch

    from hybridmem.integrations.vllm.plugin import register
    from hybridmem.integrations.vllm.sleep_files import load_cumem, load_sleep_backends

    torch.zeros(1, device="cuda")
    backends = load_sleep_backends(files)
    register()
    cumem = load_cumem(files)  # vLLM's cumem module, loaded with the backends

    alloc = cumem.CuMemAllocator.get_instance()
    per_layer = int(weights_gib * GiB) // layers
    shares = (4, 1, 1, 4, 6, 6, 6)  # q, k, v, o, gate, up, down, as a Llama layer's
    with alloc.use_memory_pool(tag="weights"):
        weights = [
            torch.empty(per_layer * share // sum(shares), dtype=torch.uint8, device="cuda")
            for _ in range(layers)
            for share in shares
        ]
    piece = int(kv_gib * GiB) // (2 * layers) // (2 * MiB) * (2 * MiB)
    with alloc.use_memory_pool(tag="kv_cache"):
        kv = [torch.empty(piece, dtype=torch.uint8, device="cuda") for _ in range(2 * layers)]
    records = alloc.pointer_to_data
    factory = backends.SleepModeBackendFactory
    cumem_backend = factory.get_backend_class("cumem")()
    ours = factory.get_backend_class("hybridmem")()

    def cycle(backend: Any) -> tuple[float, float, float]:
        sleep = _timed(lambda: backend.suspend(2))
        time.sleep(gap_s)  # the trainer's step
        wake_w = _timed(lambda: backend.resume(["weights"]))
        wake_kv = _timed(lambda: backend.resume(["kv_cache"]))
        return sleep, wake_w, wake_kv

    def parts() -> dict[str, float]:
        cumem_backend.suspend(2)
        time.sleep(gap_s)
        collect = _timed(gc.collect)
        empty = _timed(torch.cuda.empty_cache)
        asleep = [d for d in records.values() if d.is_asleep]

        def mapping() -> None:
            for data in asleep:
                cumem.create_and_map(data.handle)
                data.is_asleep = False

        return {"gc_collect_s": collect, "empty_cache_s": empty, "map_loop_s": _timed(mapping)}

    row: dict[str, Any] = {
        "weights_gib": weights_gib,
        "kv_gib": kv_gib,
        "allocations": {
            "weights": sum(d.tag == "weights" for d in records.values()),
            "kv_cache": sum(d.tag == "kv_cache" for d in records.values()),
        },
        "gc_objects": len(gc.get_objects()),
    }
    for name, backend in (("cumem", cumem_backend), ("hybridmem", ours)):
        cycle(backend)  # a first round apart
        runs = [cycle(backend) for _ in range(rounds)]
        row[name] = {
            key: statistics.median(run[i] for run in runs)
            for i, key in enumerate(("sleep_s", "wake_weights_s", "wake_kv_s"))
        }
    split = [parts() for _ in range(rounds)]
    row["cumem_parts"] = {key: statistics.median(p[key] for p in split) for key in split[0]}
    del weights, kv
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights-gib", type=float, default=4.0)
    parser.add_argument("--kv-gib", type=float, nargs="+", default=[8.0, 32.0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gap-s", type=float, default=0.5, help="between sleep and wake")
    parser.add_argument("--vllm-files", help="vLLM's wheel or files (else HYBRIDMEM_VLLM_FILES)")
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)  # the child: one KV size
    args = parser.parse_args()
    files = args.vllm_files or os.environ.get("HYBRIDMEM_VLLM_FILES")
    if files is None:
        parser.error("needs vLLM's files: --vllm-files PATH or HYBRIDMEM_VLLM_FILES")
    if args.rounds < 3 or args.layers < 1 or args.weights_gib <= 0 or args.gap_s < 0:
        parser.error("--rounds >= 3, --layers >= 1, --weights-gib > 0 and --gap-s >= 0")
    if args.one is not None:
        row = one(args.weights_gib, args.one, args.layers, args.rounds, files, args.gap_s)
        print(json.dumps(row))
        return 0
    rows = []
    for kv_gib in args.kv_gib:
        command = [sys.executable, __file__, "--one", str(kv_gib), "--vllm-files", files]
        command += ["--weights-gib", str(args.weights_gib), "--layers", str(args.layers)]
        command += ["--rounds", str(args.rounds), "--gap-s", str(args.gap_s)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            print(f"{kv_gib} GiB failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    import torch

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, gap {args.gap_s} s")
    heads = f"{'sleep ms':>9} {'wake w ms':>10} {'wake kv ms':>11}"
    print(f"{'weights+KV GiB':>15} {'backend':10} {heads}")
    for row in rows:
        size = f"{row['weights_gib']:g}+{row['kv_gib']:g}"
        for name in ("cumem", "hybridmem"):
            r = row[name]
            print(f"{size:>15} {name:10} {r['sleep_s'] * 1e3:9.1f} "
                  f"{r['wake_weights_s'] * 1e3:10.1f} {r['wake_kv_s'] * 1e3:11.1f}")  # fmt: skip
        p = row["cumem_parts"]
        print(f"{'':>15} cumem's parts: gc.collect {p['gc_collect_s'] * 1e3:.1f} ms, empty_cache "
              f"{p['empty_cache_s'] * 1e3:.1f} ms, mapping loop {p['map_loop_s'] * 1e3:.1f} ms "
              f"({row['allocations']}, {row['gc_objects']} objects tracked by gc)")  # fmt: skip
        wake = row["hybridmem"]["wake_weights_s"] + row["hybridmem"]["wake_kv_s"]
        theirs = row["cumem"]["wake_weights_s"] + row["cumem"]["wake_kv_s"]
        print(f"{'':>15} wake, hybridmem over cumem: {wake / theirs:.3f}; sleep: "
              f"{row['hybridmem']['sleep_s'] / row['cumem']['sleep_s']:.3f}")  # fmt: skip
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "gap_s": args.gap_s,
        "rows": rows,
    }
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
