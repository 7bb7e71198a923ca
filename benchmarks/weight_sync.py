"""Bucketed weight sync between two processes, against the device copy rate and a baseline.

A producer process syncs a model (1 GiB by default: a few large matrices, many small
vectors, one tensor larger than the bucket) to a consumer process that fills its own
copy in place, for each bucket size:

- ``hybridmem``: one :class:`hybridmem.WeightBucket`, exported once, two buffers
  (one buffer too, to show what double buffering buys); the receiver takes copies
  (``receive()``, the default) or fills its own tensors in place (``out=``, "into");
- ``hybridmem-fd``: the same with ``transport="fd"``: the buffers in expandable
  segments, reaching the consumer by fd passing (no ``pidfd_getfd``);
- ``fresh``: the hand-written pattern: every batch allocates a new buffer, exports it
  (``torch.multiprocessing`` reduction) and drops its reference at once, without
  ``ipc_collect``; the consumer opens it, copies, drops it, and acknowledges the
  whole sync at the end. torch cannot reuse a block a consumer may still read, so
  each dropped buffer waits in torch's IPC limbo until someone collects it.

Every byte is copied into the bucket and out of it, so half of the device copy rate
(one ``copy_`` of the same bytes, measured in the same run) is the ceiling; the
target is >= 25% of the copy rate at 256 MiB buckets. GB/s is end to end: model bytes
times the timed syncs, over the time from the first timed sync until the consumer
reports its last copy finished. Also reported: producer device
free memory lost over the timed syncs (memory growth per sync), and what opening
one handle costs the consumer, first and repeated: :func:`hybridmem.ipc_export`
of a 256 MiB tensor in an expandable segment (fd passing) beside torch's CUDA IPC
of the same tensor copied to a classic segment.

Run on a GPU: ``python benchmarks/weight_sync.py [--model-mib 1024] [--buckets 64 256 1024]
[--syncs 20] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
WARMUP = 3


def _model(total: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    tensors: dict[str, Any] = {"embed": torch.empty(total * 3 // 8 // 2, dtype=torch.bfloat16)}
    left = total - tensors["embed"].nbytes
    layer = 0
    while left > 0:
        size = min(left, 24 * MiB)
        tensors[f"layers.{layer}.w"] = torch.empty(size // 2, dtype=torch.bfloat16)
        tensors[f"layers.{layer}.norm"] = torch.empty(2048, dtype=torch.float32)
        left -= size + 8192
        layer += 1
    return {name: t.cuda().normal_() for name, t in tensors.items()}


def _consumer(conn: Connection, model_bytes: int) -> None:
    import torch

    import hybridmem as hm
    from hybridmem import _torch

    out = _model(model_bytes)
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        if command[0] == "ping":  # a GPU hand-off: tiny kernel, sync, answer
            out["embed"][:1].add_(0)
            torch.cuda.synchronize()
            conn.send(("pong",))
            continue
        if command[0] == "open":  # open one handle, time it, drop it
            started = time.perf_counter()
            tensor = command[1].open() if command[2] == "fd" else _open_classic(command[1])
            seconds = time.perf_counter() - started
            del tensor
            torch.cuda.synchronize()
            conn.send(("opened", seconds))
            continue
        if command[0] == "bucket":
            _, handle, syncs, into = command
            with hm.BucketReceiver(handle) as receiver:
                for _ in range(syncs):
                    for _ in receiver.receive(conn, out=out if into else None):
                        pass
                torch.cuda.synchronize()  # every copy finished
                conn.send(("done",))
            continue
        _, syncs = command  # "fresh": a new buffer per batch
        done = 0
        while done < syncs:
            message = conn.recv()
            if message[0] == "end":
                done += 1
                conn.send(("ack",))
                if done == syncs:
                    conn.send(("done",))
                continue
            _, (rebuild, args), entries = message
            buffer = _torch.import_cuda_tensor(rebuild, args, torch.cuda.current_device())
            for name, start, nbytes, offset in entries:
                flat = out[name].view(-1).view(torch.uint8)
                flat[start : start + nbytes].copy_(buffer[offset : offset + nbytes])
            torch.cuda.synchronize()
            del buffer


def _open_classic(export: Any) -> Any:
    import torch

    from hybridmem import _torch

    rebuild, args = export
    return _torch.import_cuda_tensor(rebuild, args, torch.cuda.current_device())


def _open_times(conn: Connection, count: int = 50) -> dict[str, float]:
    """Median and first consumer-side open of one 256 MiB handle, fd and classic."""
    import torch

    import hybridmem as hm
    from hybridmem import _torch

    with hm.expandable_segments(True):
        expandable = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    classic = hm.ipc_shareable(expandable)
    out: dict[str, float] = {}
    for kind in ("fd", "cuda"):
        times: list[float] = []
        exports: list[float] = []
        for _ in range(count):
            started = time.perf_counter()
            handle = (
                hm.ipc_export(expandable) if kind == "fd" else _torch.export_cuda_tensor(classic)
            )
            exports.append(time.perf_counter() - started)
            conn.send(("open", handle, kind))
            answer = conn.recv()
            times.append(answer[1])
        out[f"open_{kind}_first_ms"] = times[0] * 1e3
        out[f"open_{kind}_median_ms"] = statistics.median(times[1:]) * 1e3
        out[f"export_{kind}_median_ms"] = statistics.median(exports[1:]) * 1e3
    return out


def _fresh_sync(tensors: dict[str, Any], bucket: int, conn: Connection) -> None:
    """The hand-written pattern: allocate, fill, export a new buffer for every batch."""
    import torch

    import hybridmem as hm
    from hybridmem import _torch
    from hybridmem.ipc._plan import plan_batches

    names = list(tensors)
    for batch in plan_batches([tensors[n].nbytes for n in names], bucket):
        with hm.ipc_safe():
            buffer = torch.empty(bucket, dtype=torch.uint8, device="cuda")
        entries = []
        for piece in batch.pieces:
            name = names[piece.index]
            flat = tensors[name].view(-1).view(torch.uint8)
            buffer[piece.offset : piece.offset + piece.nbytes].copy_(
                flat[piece.start : piece.start + piece.nbytes]
            )
            entries.append((name, piece.start, piece.nbytes, piece.offset))
        torch.cuda.synchronize()
        conn.send(("batch", _torch.export_cuda_tensor(buffer), entries))
        del buffer  # no ipc_collect: what leaks in the wild
    conn.send(("end",))
    assert conn.recv() == ("ack",)


def copy_rate(nbytes: int, repeats: int = 10) -> float:
    """The device copy rate (GB/s): the median of ``repeats`` copies of ``nbytes``.

    The two buffers are freed and the cache emptied afterwards, so that what is
    measured next starts from the same device memory (benchmarks/vllm_transfer.py
    uses it too).
    """
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-mib", type=int, default=1024)
    parser.add_argument("--buckets", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--syncs", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as tmp

    import hybridmem as hm
    from hybridmem import _torch

    model_bytes = args.model_mib * MiB
    tensors = _model(model_bytes)
    payload = sum(t.nbytes for t in tensors.values())
    rate = copy_rate(payload)
    ctx = tmp.get_context("spawn")
    conn, child = ctx.Pipe()
    consumer = ctx.Process(target=_consumer, args=(child, model_bytes))
    consumer.start()
    # What one hand-off between the two processes costs on this GPU: each side
    # launches a tiny kernel and waits for it, then tells the other.
    pings: list[float] = []
    for _ in range(200):
        start = time.perf_counter()
        tensors["embed"][:1].add_(0)
        torch.cuda.synchronize()
        conn.send(("ping",))
        assert conn.recv() == ("pong",)
        pings.append(time.perf_counter() - start)
    handoff_ms = statistics.median(pings[20:]) * 1e3
    rows: list[dict[str, Any]] = []
    opens = _open_times(conn)
    runs = [("hybridmem", b, 2, "copies") for b in args.buckets]
    runs += [("hybridmem", 256, n, "copies") for n in (1, 3, 4)]
    runs += [("hybridmem", 256, 2, "into")]
    runs += [("hybridmem-fd", b, 2, "copies") for b in args.buckets]
    runs += [("hybridmem-fd", 256, 2, "into")]
    runs += [("fresh", b, 0, "into") for b in args.buckets]
    for method, bucket_mib, buffers, receive in runs:
        bucket = bucket_mib * MiB
        total = WARMUP + args.syncs
        free: list[int] = []
        if method.startswith("hybridmem"):
            transport: Literal["fd", "cuda"] = "fd" if method == "hybridmem-fd" else "cuda"
            staging = hm.WeightBucket(
                bucket, buffers=buffers, fallback="raise", transport=transport
            )
            conn.send(("bucket", staging.handle, total, receive == "into"))
        else:
            conn.send(("fresh", total))
        start = 0.0
        for step in range(total):
            if step == WARMUP:
                torch.cuda.synchronize()
                free.append(torch.cuda.mem_get_info()[0])
                start = time.perf_counter()
            if method.startswith("hybridmem"):
                staging.send(tensors, conn)
            else:
                _fresh_sync(tensors, bucket, conn)
        assert conn.recv() == ("done",)  # the consumer's last copy has finished
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        free.append(torch.cuda.mem_get_info()[0])
        if method.startswith("hybridmem"):
            staging.close()
        gbps = payload * args.syncs / elapsed / 1e9
        rows.append(
            {
                "method": method,
                "bucket_mib": bucket_mib,
                "buffers": buffers,
                "receive": receive,
                "gbps": gbps,
                "of_copy_rate": gbps / rate,
                "growth_mib_per_sync": (free[0] - free[-1]) / MiB / args.syncs,
            }
        )
        _torch.ipc_collect()  # leave the next run a clean device
        torch.cuda.empty_cache()
    conn.send(("stop",))
    consumer.join(timeout=60)

    print(
        f"model {payload / MiB:.0f} MiB in {len(tensors)} tensors; device copy {rate:.0f} GB/s; "
        f"GPU hand-off round trip between the processes {handoff_ms:.3f} ms"
    )
    print(
        "open one 256 MiB handle in the consumer: fd passing "
        f"{opens['open_fd_first_ms']:.2f} ms first, {opens['open_fd_median_ms']:.2f} ms "
        f"repeated; classic CUDA IPC {opens['open_cuda_first_ms']:.2f} ms first, "
        f"{opens['open_cuda_median_ms']:.2f} ms repeated; export: fd "
        f"{opens['export_fd_median_ms']:.2f} ms, classic {opens['export_cuda_median_ms']:.2f} ms"
    )
    print(
        f"{'method':<13} {'bucket':>8} {'bufs':>5} {'receive':>8} {'GB/s':>8} {'of copy':>8} "
        f"{'MiB/sync':>9}"
    )
    for r in rows:
        print(
            f"{r['method']:<13} {r['bucket_mib']:>6}Mi {r['buffers']:>5} {r['receive']:>8} "
            f"{r['gbps']:>8.1f} {r['of_copy_rate']:>8.1%} {r['growth_mib_per_sync']:>9.1f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "copy_gbps": rate,
                    "handoff_ms": handoff_ms,
                    "model_bytes": payload,
                    "opens": opens,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
