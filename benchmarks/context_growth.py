"""Which operation grows the CUDA contexts outside torch's allocator, and by how much.

The bench reports the contexts' growth since the start (device memory in use that
no process's caching allocator counts): 354-370 MiB with the hybridmem strategy
against 208-232 MiB for the baselines (H200, issue #12). This script takes the
hybridmem strategy's operations one at a time, on an otherwise idle GPU, and after
each prints how much more the device has in use than both processes' allocators
reserve (``total - free - reserved``): the growth each operation caused.

Steps (a trainer process and, for the weight sync, a receiver process):

1. a matmul (cuBLAS handle and workspace: the baseline);
2. ``hm.Offloader`` offload and reload of 3 GiB (one pinned pool, ``cudaHostRegister``);
3. the same bytes through torch's pinned allocator (``.to("cpu", non_blocking=True)``,
   what the hand-rolled baseline does);
4. ``hm.release_cache()`` (frees the cuBLAS workspaces) and a matmul again;
5. a tensor in an expandable segment, freed and released;
6. ``hm.compact`` of a model;
7. a ``WeightBucket`` of 256 MiB and a sync into a receiver process that opens it;
8. the receiver's first sync again (steady state).

Run on a GPU with nothing else on it: ``python benchmarks/context_growth.py [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
GiB = 1 << 30


def _receiver(conn: Any, handle: Any) -> None:
    """The engine's side: open the bucket, take every sync, report its reserved bytes."""
    import torch

    import hybridmem as hm

    torch.zeros(1, device="cuda")
    conn.send(("ready", torch.cuda.memory_reserved()))
    receiver = hm.BucketReceiver(handle)
    while True:
        command = conn.recv()
        if command == "stop":
            return
        weights = dict(receiver.receive(conn))
        torch.cuda.synchronize()
        conn.send(("took", len(weights), torch.cuda.memory_reserved()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the steps' figures here")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    import hybridmem as hm
    from hybridmem.bench.engine import BoundedConn

    if not torch.cuda.is_available():
        print("context_growth.py needs a CUDA GPU", file=sys.stderr)
        return 2
    steps: list[dict[str, Any]] = []
    engine_reserved = [0]

    def outside() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved() - engine_reserved[0]

    last = [outside()]

    def step(name: str) -> None:
        now = outside()
        steps.append({"step": name, "outside_mib": now / MiB, "grew_mib": (now - last[0]) / MiB})
        grew = (now - last[0]) / MiB
        print(f"{name:<62} outside allocators {now / MiB:8.1f} MiB  grew {grew:+7.1f}")
        last[0] = now

    step("context created (torch.zeros)")
    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()
    step("1. matmul (cuBLAS handle, workspace)")

    state = [torch.randn(256 * MiB // 4, device="cuda") for _ in range(12)]  # 3 GiB
    off = hm.Offloader(state)
    off.offload()
    off.reload()
    step("2. Offloader offload+reload 3 GiB (cudaHostRegister pool)")
    off.offload()  # the pool stays pinned between cycles, as the switch keeps it
    off.reload()
    step("2b. Offloader again (pool reused)")

    host = [t.to("cpu", non_blocking=True) for t in state]
    torch.cuda.synchronize()
    back = [h.to("cuda", non_blocking=True) for h in host]
    torch.cuda.synchronize()
    del host, back
    step("3. .to('cpu', non_blocking=True) 3 GiB (torch pinned allocator)")

    hm.release_cache()
    (a @ a).sum().item()
    step("4. release_cache (cuBLAS workspaces freed) + matmul")
    hm.release_cache()
    (a @ a).sum().item()
    step("4b. again")

    with hm.expandable_segments(True):
        x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        del x
    hm.release_cache()
    step("5. 1 GiB in an expandable segment, freed, released")

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 2731) for _ in range(24)]).cuda()
    hm.compact(model)
    hm.release_cache()
    step("6. hm.compact of 24 x 10.7 MiB weights")

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    bucket = hm.WeightBucket(256 * MiB, fallback="raise")
    process = ctx.Process(target=_receiver, args=(child, bucket.handle))
    process.start()
    conn = BoundedConn(parent, process.pid)  # no answer waited for unbounded
    _, engine_reserved[0] = conn.recv()
    step("7a. receiver process started (its own context)")
    conn.send("sync")
    bucket.send(model.state_dict(), conn)
    _, _, engine_reserved[0] = conn.recv()
    step("7b. WeightBucket 256 MiB: first sync, receiver opened it")
    conn.send("sync")
    bucket.send(model.state_dict(), conn)
    _, _, engine_reserved[0] = conn.recv()
    step("8. second sync (steady state)")
    conn.send("stop")
    process.join(timeout=60)
    engine_reserved[0] = 0
    step("9. receiver gone")
    out = {"steps": steps, "device": torch.cuda.get_device_name()}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
