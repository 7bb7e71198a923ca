"""Where the time of one WeightBucket sync goes: both processes' messages on one clock.

``benchmarks/weight_sync.py`` times whole syncs. This script takes one model size,
runs the default bucket, and records in both processes (``time.perf_counter``: one
monotonic clock for every process of the machine) when each message was sent and
received, each fill and take started and ended; then prints one sync's events merged
in time order, with the gap since the one before. Also, in the same run: the seconds
per sync of a tiny model (the protocol's fixed cost), of the same bytes filled by the
trainer alone (its copies, no receiver), and of one memcpy of them.

Run on a GPU: ``python benchmarks/sync_anatomy.py [--gib 1] [--buffers N --mib M]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

MiB = 1 << 20
GiB = 1 << 30


def _instrument(module: Any, log: list[tuple[float, str]], side: str) -> None:
    """Record every send/receive of ``module`` (hybridmem.ipc.bucket or .receiver)."""
    send_to, recv_within = module.send_to, module.recv_within

    def traced_send(channel: Any, message: Any, *args: Any, **kw: Any) -> None:
        log.append((time.perf_counter(), f"{side} send {_kind(message)}"))
        send_to(channel, message, *args, **kw)

    def traced_recv(channel: Any, *args: Any, **kw: Any) -> Any:
        started = time.perf_counter()
        message = recv_within(channel, *args, **kw)
        log.append(
            (
                time.perf_counter(),
                f"{side} got  {_kind(message)} (waited {time.perf_counter() - started:.6f})",
            )
        )
        return message

    module.send_to, module.recv_within = traced_send, traced_recv


def _kind(message: Any) -> str:
    if isinstance(message, tuple) and message:
        return " ".join(str(m) for m in message[:3] if not isinstance(m, (list, tuple, bytes)))
    return str(message)[:40]


def _receiver(conn: Any, handle: Any, shapes: dict[str, Any]) -> None:
    import torch

    import hybridmem as hm
    import hybridmem.ipc.receiver as module

    out = {n: torch.empty(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}
    log: list[tuple[float, str]] = []
    _instrument(module, log, "engine ")
    take = module.BucketReceiver._take

    def traced_take(self: Any, *args: Any) -> Any:
        log.append((time.perf_counter(), "engine  take starts"))
        ready = take(self, *args)
        log.append((time.perf_counter(), "engine  take queued"))
        return ready

    module.BucketReceiver._take = traced_take  # type: ignore[method-assign,assignment]
    receiver = hm.BucketReceiver(handle)
    conn.send(("ready",))
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        del log[:]
        for _ in range(command[1]):
            for _ in receiver.receive(conn, out=out):
                pass
        torch.cuda.synchronize()
        log.append((time.perf_counter(), "engine  copies done (synchronized)"))
        conn.send(("done", list(log)))


def _run(bucket: Any, model: dict[str, Any], syncs: int) -> tuple[float, list[Any], list[Any]]:
    """Start a receiver, time ``syncs`` syncs after two warm-ups, return both logs."""
    import torch
    import torch.multiprocessing as mp

    import hybridmem.ipc.bucket as module
    from hybridmem.bench.engine import BoundedConn

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in model.items()}
    process = ctx.Process(target=_receiver, args=(child, bucket.handle, shapes))
    process.start()
    conn = BoundedConn(parent, process.pid)  # no answer waited for unbounded
    assert conn.recv() == ("ready",)
    log: list[tuple[float, str]] = []
    if not getattr(module, "_traced", False):
        _instrument(module, log, "trainer")
        module._traced = True  # type: ignore[attr-defined]
        module._log = log  # type: ignore[attr-defined]
    log = module._log  # type: ignore[attr-defined]
    conn.send(("sync", 2))
    for _ in range(2):
        bucket.send(model, conn)
    conn.recv()
    torch.cuda.synchronize()
    del log[:]
    conn.send(("sync", syncs))
    started = time.perf_counter()
    for _ in range(syncs):
        log.append((time.perf_counter(), "trainer send() starts"))
        bucket.send(model, conn)
        log.append((time.perf_counter(), "trainer send() returns"))
    answer = conn.recv()
    seconds = (time.perf_counter() - started) / syncs
    conn.send(("stop",))
    process.join(timeout=60)
    return seconds, list(log), answer[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--mib", type=int, default=0, help="bucket size (0: for_tensors)")
    parser.add_argument("--buffers", type=int, default=0)
    parser.add_argument("--syncs", type=int, default=10)
    args = parser.parse_args()

    import torch
    from weight_sync import _model, copy_rate

    import hybridmem as hm

    model = _model(int(args.gib * GiB))
    payload = sum(t.nbytes for t in model.values())
    kwargs: dict[str, Any] = {"fallback": "raise"}
    if args.buffers:
        kwargs["buffers"] = args.buffers
    bucket = (
        hm.WeightBucket(args.mib * MiB, **kwargs)
        if args.mib
        else hm.WeightBucket.for_tensors(model, **kwargs)
    )
    rate = copy_rate(payload, repeats=5)
    print(
        f"{payload / GiB:.2f} GiB in {len(model)} tensors; bucket {bucket!r}; "
        f"one memcpy of it {payload / rate / 1e9 * 1e3:.3f} ms ({rate:.0f} GB/s)"
    )
    # The trainer's fills alone: every batch of the plan into its buffer, no receiver.
    items = list(model.items())
    plan = bucket._filler.make_plan(items)
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        started = time.perf_counter()
        flats: dict[int, Any] = {}
        for number in range(len(plan.batches)):
            bucket._filler.fill(number % bucket.buffers, number, plan, items, flats)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    print(f"fills alone ({len(plan.batches)} batches): {statistics.median(times[2:]) * 1e3:.3f} ms")
    seconds, trainer_log, engine_log = _run(bucket, model, args.syncs)
    print(f"sync: {seconds * 1e3:.3f} ms  ({payload / seconds / 1e9 / rate:.1%} of the copy rate)")
    tiny = {f"t{i}": torch.randn(1024, device="cuda") for i in range(4)}
    tiny_bucket = hm.WeightBucket(MiB, fallback="raise")
    tiny_seconds, _, _ = _run(tiny_bucket, tiny, 50)
    print(f"tiny model (16 KiB, 4 tensors) sync: {tiny_seconds * 1e3:.3f} ms (fixed cost)")
    merged = sorted(trainer_log + engine_log)
    # One sync from the middle: from the third "send() starts" to the fourth.
    starts = [i for i, (_, what) in enumerate(merged) if what == "trainer send() starts"]
    first, last = starts[min(3, len(starts) - 2)], starts[min(4, len(starts) - 1)]
    print("\none sync, both processes (ms since its start, gap since the line before):")
    t0 = previous = merged[first][0]
    for when, what in merged[first : last + 1]:
        print(f"{(when - t0) * 1e3:9.3f} {(when - previous) * 1e3:+8.3f}  {what}")
        previous = when
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
