"""What grows a CUDA context outside the allocators, operation by operation, and the stack limit.

``benchmarks/context_growth.py`` found two steps of the hybridmem strategy that grow the
contexts by ~70 MiB each (the Offloader's first offload, a receiver's first sync) that
pinning does not explain (``benchmarks/pinning.py``: 2 MiB per GiB, whatever the
method). A kernel whose threads need more local memory (stack) than the context has
reserved makes the driver grow the reservation, for every thread the device can hold
at once (H200: 132 SMs x 2048 threads, 264 MiB per KiB of stack), and it never shrinks
it on its own. This script runs each operation first in a fresh process and prints,
after it, how much the device has in use beyond both processes' allocators and the
context's stack limit (``cuCtxGetLimit(CU_LIMIT_STACK_SIZE)``); then whether setting the
limit back (``cuCtxSetLimit``) returns the growth, and what that costs.

Run on a GPU with nothing else on it: ``python benchmarks/stack_reservation.py [--json FILE]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
GiB = 1 << 30
STACK = 0  # CU_LIMIT_STACK_SIZE


def _stack_limit() -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_size_t()
    assert lib.cuCtxGetLimit(ctypes.byref(value), STACK) == 0
    return int(value.value)


def _set_stack_limit(nbytes: int) -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    return int(lib.cuCtxSetLimit(STACK, ctypes.c_size_t(nbytes)))


def _receiver(conn: Any, handle: Any) -> None:
    import torch

    import hybridmem as hm

    torch.zeros(1, device="cuda")
    conn.send(("ready", torch.cuda.memory_reserved(), _stack_limit()))
    receiver: Any = None
    out: dict[str, Any] = {}
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        if command[0] == "open":
            receiver = hm.BucketReceiver(handle)
        elif command[0] == "receive":
            weights = dict(receiver.receive(conn))
            out = {k: torch.empty_like(v) for k, v in weights.items()}
            del weights
        elif command[0] == "receive-out":
            for _ in receiver.receive(conn, out=out):
                pass
        elif command[0] == "trim":
            torch.cuda.synchronize()
            started = time.perf_counter()
            rc = _set_stack_limit(command[1])
            conn.send(("trimmed", rc, time.perf_counter() - started))
            continue
        torch.cuda.synchronize()
        conn.send(("took", torch.cuda.memory_reserved(), _stack_limit()))


def _probe(order: str, answers: Any) -> None:
    """One fresh trainer process: the operations in ``order``'s sequence."""
    import torch
    import torch.multiprocessing as mp

    import hybridmem as hm
    from hybridmem import _torch
    from hybridmem.bench.engine import BoundedConn

    steps: list[dict[str, Any]] = []
    engine = [0, 0]  # the receiver's reserved bytes, its stack limit

    def outside() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved() - engine[0]

    last = [0]

    def step(name: str, **extra: Any) -> None:
        now = outside()
        steps.append(
            {
                "step": name,
                "outside_mib": now / MiB,
                "grew_mib": (now - last[0]) / MiB,
                "stack": _stack_limit(),
                "engine_stack": engine[1],
                **extra,
            }
        )
        last[0] = now

    torch.zeros(1, device="cuda")
    initial = _stack_limit()
    last[0] = outside()
    step("context")
    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()
    step("matmul")
    state = [torch.randn(256 * MiB // 4, device="cuda") for _ in range(4)]  # 1 GiB

    def trim(label: str) -> None:
        torch.cuda.synchronize()
        started = time.perf_counter()
        rc = _set_stack_limit(initial)
        step(label, rc=rc, seconds=time.perf_counter() - started)

    if order == "offloader-pieces":
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        step("side stream")
        pool = torch.empty(GiB, dtype=torch.uint8).pin_memory()
        step("1 GiB pinned")
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            offset = 0
            for t in state:
                pool[offset : offset + t.nbytes].copy_(t.view(torch.uint8), non_blocking=True)
                offset += t.nbytes
        side.synchronize()
        step("D2H on the side stream")
        for t in state:
            t.untyped_storage().resize_(0)
        torch.cuda.empty_cache()
        step("storages freed, cache emptied")
        offset = 0
        for t in state:
            t.untyped_storage().resize_(256 * MiB)
            t.view(torch.uint8).copy_(pool[offset : offset + t.nbytes], non_blocking=True)
            offset += t.nbytes
        step("H2D back")
        off = hm.Offloader(state)
        off.offload()
        off.reload()
        step("hm.Offloader offload+reload")
        trim("stack limit set back")
    elif order == "offloader":
        off = hm.Offloader(state)
        off.offload()
        step("hm.Offloader offload")
        off.reload()
        step("hm.Offloader reload")
        off.offload()
        off.reload()
        step("hm.Offloader again")
        trim("stack limit set back")
        off.offload()
        off.reload()
        step("hm.Offloader after the trim")
    elif order == "kernels":
        small = [torch.randn(4096 + i, device="cuda").to(torch.bfloat16) for i in range(67)]
        step("67 small bf16 tensors made")
        words = torch.empty(64 * MiB, dtype=torch.bfloat16, device="cuda")
        used = sum(t.numel() for t in small)
        torch.cat([t.view(-1) for t in small], out=words[:used])
        step("torch.cat of 67 into a buffer (the bucket's fill)")
        trim("stack limit set back")
        torch.cat([t.view(-1) for t in small], out=words[:used])
        step("torch.cat again")
        dsts = [torch.empty_like(t) for t in small]
        torch._foreach_copy_(dsts, small)
        step("torch._foreach_copy_ of 67 (the receiver's out=)")
        trim("stack limit set back (2)")
        flat = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        flat.copy_(state[0].view(torch.uint8).repeat(4))
        step("1 GiB copy_ (a memcpy) and repeat")
        event = _torch.new_ipc_event(torch.cuda.current_device())
        _torch.record_event(event, torch.cuda.current_stream())
        step("interprocess event")
    elif order == "bucket":
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        model = {f"w{i}": t for i, t in enumerate(state)}
        model.update({f"n{i}": torch.randn(4096 + i, device="cuda") for i in range(60)})
        bucket = hm.WeightBucket.for_tensors(model, fallback="raise")
        step("WeightBucket.for_tensors (buffers allocated, exported)")
        process = ctx.Process(target=_receiver, args=(child, bucket.handle))
        process.start()
        conn = BoundedConn(parent, process.pid)  # no answer waited for unbounded
        _, engine[0], engine[1] = conn.recv()
        step("receiver process started")

        def engine_does(command: tuple[Any, ...], sync: bool = False) -> None:
            conn.send(command)
            if sync:
                bucket.send(model, conn)
            _, engine[0], engine[1] = conn.recv()

        engine_does(("open",))
        step("receiver opened the bucket")
        engine_does(("receive",), sync=True)
        step("first sync (receiver copies into fresh blocks)")
        engine_does(("receive-out",), sync=True)
        step("sync into out= tensors")
        engine_does(("receive-out",), sync=True)
        step("again")
        trim("trainer's stack limit set back")
        conn.send(("trim", initial))
        _, rc, seconds = conn.recv()
        step("receiver's stack limit set back", rc=rc, seconds=seconds)
        engine_does(("receive-out",), sync=True)
        step("sync after both trims")
        conn.send(("stop",))
        process.join(timeout=60)
        engine[0] = 0
        bucket.close()
        step("receiver gone, bucket closed")
    answers.put({"order": order, "initial_stack": initial, "steps": steps})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = []
    for order in ("offloader", "offloader-pieces", "kernels", "bucket"):
        answers = ctx.Queue()
        process = ctx.Process(target=_probe, args=(order, answers))
        process.start()
        result = answers.get(timeout=300)
        process.join(timeout=60)
        results.append(result)
        print(f"\n== {order} (stack limit at start: {result['initial_stack']} B)")
        for s in result["steps"]:
            extra = f"  rc={s['rc']} {s['seconds'] * 1e3:.2f} ms" if "rc" in s else ""
            print(
                f"{s['step']:<52} outside {s['outside_mib']:8.1f} MiB  grew "
                f"{s['grew_mib']:+7.1f}  stack {s['stack']:>6}  engine stack "
                f"{s['engine_stack']:>6}{extra}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
