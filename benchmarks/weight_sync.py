"""Weight sync between two processes at model size, against the field's methods, in one run.

A trainer process syncs a state dict with a real 8B model's shapes and dtypes (Llama
3 8B: bf16 matrices, fp32 norms, a 128,256-row embedding; 1 GiB, 8 GiB and the whole
model, 15 GiB, by default) to an engine process that fills its own copy in place,
each method in the same run:

- ``hybridmem``: one :class:`hybridmem.WeightBucket`, exported once, reused every
  sync (its default buffer count and bucket size first, then other sizes/counts);
  ``hybridmem-fd``: the same with ``transport="fd"`` (expandable segments, fd passing);
- ``per-tensor``: one CUDA IPC handle per tensor, re-exported every sync, each opened,
  copied and dropped by the engine (vLLM's ``ipc`` weight-transfer backend,
  OpenRLHF's colocated path);
- ``flattened``: every bucket flattened into a new buffer (``torch.cat``), exported,
  opened, copied, dropped, acknowledged (slime/SGLang's ``FlattenedTensorBucket``,
  512 MiB: slime's default);
- ``one-copy`` (a probe of a design not built, issue #25 item 1): every tensor's handle
  exported and opened once, then each sync one hand-off through the host and one copy
  per tensor out of the trainer's own memory. Only sound while the trainer's tensors
  stay where they were exported; it shows what a one-copy channel could reach;
- ``verl``: verl's ``BucketedWeightSender``: one buffer allocated and exported per
  sync, filled bucket by bucket, the device synchronised and the engine answered
  before the next fill, then freed with ``ipc_collect`` and ``empty_cache`` (1 GiB:
  its 512 MB default cannot hold the embedding, which it refuses).

Every byte is copied twice (into the channel and out of it, one on each side of the
same GPU), so half the device copy rate (one ``copy_`` of the same bytes, measured
in the same run) is the two-copy ceiling. Each method runs two untimed syncs, then
at least five timed ones, each from the trainer's call until the engine's copies
finished. Reported per method: seconds per sync (the median, the worst beside), GB/s
of model bytes, the fraction of the device copy rate and of the two-copy ceiling,
the speed against per-tensor handles, and device memory lost per sync (the trainer's
free memory before and after the timed syncs). Also, once: one GPU hand-off round
trip between the processes, and the cost of opening one handle (fd passing and
classic CUDA IPC).

Run on a GPU: ``python benchmarks/weight_sync.py [--gib 1 8 16] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from hybridmem.bench.engine import BoundedConn

MiB = 1 << 20
GiB = 1 << 30
WARMUP = 2  # untimed syncs before each method's timed ones
MIN_TIMED = 5  # the median of at least this many, the worst beside
VOCAB, HIDDEN, FFN, KV, LAYERS = 128256, 4096, 14336, 1024, 32  # Llama 3 8B


def model_shapes() -> list[tuple[str, tuple[int, ...], str]]:
    """The 8B model's tensors in state-dict order: (name, shape, dtype name)."""
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (VOCAB, HIDDEN), "bfloat16")
    ]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,), "float32"),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), "bfloat16"),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN), "bfloat16"),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN), "bfloat16"),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), "bfloat16"),
            (p + "post_attention_layernorm.weight", (HIDDEN,), "float32"),
            (p + "mlp.gate_proj.weight", (FFN, HIDDEN), "bfloat16"),
            (p + "mlp.up_proj.weight", (FFN, HIDDEN), "bfloat16"),
            (p + "mlp.down_proj.weight", (HIDDEN, FFN), "bfloat16"),
        ]
    shapes += [
        ("model.norm.weight", (HIDDEN,), "float32"),
        ("lm_head.weight", (VOCAB, HIDDEN), "bfloat16"),
    ]
    return shapes


def _model(limit: int) -> dict[str, Any]:
    """The 8B model's tensors, in order, while they fit in ``limit`` bytes (on the GPU)."""
    import torch

    torch.manual_seed(0)
    tensors: dict[str, Any] = {}
    total = 0
    for name, shape, dtype_name in model_shapes():
        dtype = getattr(torch, dtype_name)
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if total + nbytes > limit:
            continue  # a smaller one later may still fit (the norms)
        tensors[name] = torch.empty(shape, dtype=dtype, device="cuda").normal_()
        total += nbytes
    return tensors


def _groups(tensors: dict[str, Any], bucket: int) -> list[list[str]]:
    """Names grouped in order into buckets of at most ``bucket`` bytes (a bigger one alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, tensor in tensors.items():
        if groups[-1] and used + tensor.nbytes > bucket:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += tensor.nbytes
    return groups


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


def _open_classic(export: Any) -> Any:
    import torch

    from hybridmem import _torch

    rebuild, args = export
    return _torch.import_cuda_tensor(rebuild, args, torch.cuda.current_device())


def _open_times(conn: BoundedConn, count: int = 50) -> dict[str, float]:
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


def _consumer(conn: Connection) -> None:
    """The engine's side: its own copy of the model, filled in place by each method."""
    import gc

    import torch

    import hybridmem as hm
    from hybridmem import _torch

    device = torch.cuda.current_device()
    out: dict[str, Any] = {}
    buffer: Any = None  # verl's buffer, opened once per sync
    views: dict[str, Any] = {}  # the one-copy probe's tensors, opened once

    def take(name: str, source: Any, offset: int) -> None:
        target = out[name].view(-1).view(torch.uint8)
        target.copy_(source[offset : offset + target.numel()])

    while True:
        command = conn.recv()
        kind = command[0]
        if kind == "stop":
            return
        if kind == "model":  # a new size: the engine's copy of it
            out = {}
            torch.cuda.empty_cache()
            out = _model(command[1])
            torch.cuda.synchronize()
            conn.send(("ready",))
        elif kind == "ping":  # a GPU hand-off: tiny kernel, sync, answer
            next(iter(out.values())).view(-1)[:1].add_(0)
            torch.cuda.synchronize()
            conn.send(("pong",))
        elif kind == "open":  # open one handle, time it, drop it
            started = time.perf_counter()
            tensor = command[1].open() if command[2] == "fd" else _open_classic(command[1])
            seconds = time.perf_counter() - started
            del tensor
            torch.cuda.synchronize()
            conn.send(("opened", seconds))
        elif kind == "bucket":
            _, handle, syncs, host_handoff = command
            with hm.BucketReceiver(handle) as receiver:
                if host_handoff:  # the experiment: every hand-off through the host
                    receiver._drained = []
                for _ in range(syncs):
                    for _ in receiver.receive(conn, out=out):
                        pass
                    torch.cuda.synchronize()  # this sync's copies finished
                    conn.send(("synced",))
        elif kind == "per-tensor":  # vLLM's ipc backend: open each, copy, drop
            for name, (rebuild, args) in command[1]:
                tensor = _torch.import_cuda_tensor(rebuild, args, device)
                out[name].copy_(tensor)
                del tensor
            torch.cuda.synchronize()
            conn.send(("ack",))
        elif kind == "one-copy-open":  # the probe: every handle opened once, kept
            views = {
                name: _torch.import_cuda_tensor(rebuild, args, device)
                for name, (rebuild, args) in command[1]
            }
            conn.send(("ack",))
        elif kind == "one-copy":  # each sync: one copy per tensor, out of the trainer's
            for name, view in views.items():
                out[name].copy_(view)
            torch.cuda.synchronize()
            conn.send(("ack",))
        elif kind == "one-copy-close":
            views = {}
            gc.collect()
            conn.send(("ack",))
        elif kind == "flat":  # slime: one flattened bucket, opened, copied out, dropped
            _, (rebuild, args), names = command
            flat = _torch.import_cuda_tensor(rebuild, args, device)
            offset = 0
            for name in names:
                take(name, flat, offset)
                offset += out[name].nbytes
            torch.cuda.synchronize()
            del flat
            conn.send(("ack",))
        elif kind == "verl-open":
            rebuild, rebuild_args = command[1]
            buffer = _torch.import_cuda_tensor(rebuild, rebuild_args, device)
            conn.send(("ack",))
        elif kind == "verl":  # one bucket of verl's buffer: copy out, sync, answer
            _, entries, last = command
            for name, offset in entries:
                take(name, buffer, offset)
            torch.cuda.synchronize()
            if last:
                buffer = None
                gc.collect()
                torch.cuda.empty_cache()
            conn.send(("ack",))


def _per_tensor(tensors: dict[str, Any], conn: BoundedConn) -> None:
    """vLLM's ``ipc`` backend / OpenRLHF: every tensor's own handle, exported every sync."""
    from hybridmem import _torch

    conn.send(("per-tensor", [(n, _torch.export_cuda_tensor(t)) for n, t in tensors.items()]))
    assert conn.recv() == ("ack",)


def _one_copy(tensors: dict[str, Any], conn: BoundedConn, opened: list[bool]) -> None:
    """The probe: handles exported once; each sync, the engine copies out of the tensors."""
    import torch

    from hybridmem import _torch

    if not opened:
        handles = [(n, _torch.export_cuda_tensor(t)) for n, t in tensors.items()]
        conn.send(("one-copy-open", handles))
        assert conn.recv() == ("ack",)
        opened.append(True)
    torch.cuda.current_stream().synchronize()  # the tensors are final before it reads
    conn.send(("one-copy",))
    assert conn.recv() == ("ack",)  # its copies finished: the tensors may change again


def _flattened(tensors: dict[str, Any], groups: list[list[str]], conn: BoundedConn) -> None:
    """slime/SGLang's FlattenedTensorBucket: a new flat buffer per bucket, exported."""
    import torch

    from hybridmem import _torch

    for names in groups:
        flat = torch.cat([tensors[n].view(-1).view(torch.uint8) for n in names])
        conn.send(("flat", _torch.export_cuda_tensor(flat), names))
        assert conn.recv() == ("ack",)
        del flat


def _verl(tensors: dict[str, Any], groups: list[list[str]], bucket: int, conn: BoundedConn) -> None:
    """verl's BucketedWeightSender: one buffer per sync, filled and answered bucket by bucket."""
    import gc

    import torch

    from hybridmem import _torch

    buffer = torch.empty(bucket, dtype=torch.uint8, device="cuda")
    conn.send(("verl-open", _torch.export_cuda_tensor(buffer)))
    assert conn.recv() == ("ack",)
    for number, names in enumerate(groups):
        offset = 0
        entries = []
        for name in names:
            flat = tensors[name].view(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
            entries.append((name, offset))
            offset += flat.numel()
        torch.cuda.synchronize()
        conn.send(("verl", entries, number == len(groups) - 1))
        assert conn.recv() == ("ack",)
    del buffer
    gc.collect()
    _torch.ipc_collect()  # torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


def _handoff_ms(tensors: dict[str, Any], conn: BoundedConn) -> float:
    """One GPU hand-off between the processes: each side launches a tiny kernel, waits, tells."""
    import torch

    first = next(iter(tensors.values())).view(-1)
    pings: list[float] = []
    for _ in range(200):
        start = time.perf_counter()
        first[:1].add_(0)
        torch.cuda.synchronize()
        conn.send(("ping",))
        assert conn.recv() == ("pong",)
        pings.append(time.perf_counter() - start)
    return statistics.median(pings[20:]) * 1e3


def _runs(largest: int) -> list[tuple[str, int, int]]:
    """(method, bucket MiB, buffers): hybridmem's default first, the field's methods last."""
    verl_mib = max(512, -(-largest // MiB // 256) * 256)  # verl refuses a tensor > bucket
    runs = [("hybridmem", 0, 0)]  # 0: WeightBucket's defaults
    runs += [("hybridmem", b, n) for b, n in ((256, 2), (256, 4), (512, 2), (512, 3))]
    runs += [("hybridmem", b, n) for b, n in ((1024, 2), (1024, 3))]
    runs += [("hybridmem-fd", 0, 0), ("hybridmem-fd", 1024, 2)]
    # An experiment: the same bucket, but the receiver hands every buffer back through
    # the host (it waits for its copies before acknowledging) instead of with events.
    runs += [("hybridmem-host-handoff", 0, 0)]
    runs += [("per-tensor", 0, 0), ("flattened", 512, 0), ("verl", verl_mib, 0)]
    runs += [("one-copy", 0, 0)]  # the probe, last
    return runs


def _measure(
    method: str,
    bucket_mib: int,
    buffers: int,
    tensors: dict[str, Any],
    syncs: int,
    conn: BoundedConn,
) -> dict[str, Any]:
    """Time ``syncs`` syncs of one method after WARMUP; return its row.

    Each sync is timed alone, from the trainer's call to the engine's copies finished;
    the row's ``seconds`` is their median and ``worst_seconds`` the slowest.
    """
    import torch

    import hybridmem as hm

    total = WARMUP + syncs
    bucket = bucket_mib * MiB
    staging: Any = None
    sync: Callable[[], None]
    if method.startswith("hybridmem"):
        kwargs: dict[str, Any] = {"transport": "fd" if method == "hybridmem-fd" else "cuda"}
        if buffers:
            kwargs["buffers"] = buffers
        staging = hm.WeightBucket(bucket, fallback="raise", **kwargs) if bucket else None
        if staging is None:
            staging = hm.WeightBucket.for_tensors(tensors, fallback="raise", **kwargs)
        bucket_mib, buffers = staging.nbytes // MiB, staging.buffers
        conn.send(("bucket", staging.handle, total, method == "hybridmem-host-handoff"))

        def sync() -> None:  # timed to the engine's copies finished, as the others are
            staging.send(tensors, conn)
            assert conn.recv() == ("synced",)

    elif method == "per-tensor":
        sync = lambda: _per_tensor(tensors, conn)  # noqa: E731
    elif method == "one-copy":
        opened: list[bool] = []
        sync = lambda: _one_copy(tensors, conn, opened)  # noqa: E731
    else:
        groups = _groups(tensors, bucket)
        if method == "flattened":
            sync = lambda: _flattened(tensors, groups, conn)  # noqa: E731
        else:
            sync = lambda: _verl(tensors, groups, bucket, conn)  # noqa: E731
    for _ in range(WARMUP):
        sync()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    times = []
    for _ in range(syncs):
        start = time.perf_counter()
        sync()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    if staging is not None:
        staging.close()
    if method == "one-copy":  # the engine lets go of the trainer's memory
        conn.send(("one-copy-close",))
        assert conn.recv() == ("ack",)
    return {
        "method": method,
        "bucket_mib": bucket_mib,
        "buffers": buffers,
        "seconds": statistics.median(times),
        "worst_seconds": max(times),
        "syncs": syncs,
        "growth_mib_per_sync": (free_before - free_after) / MiB / syncs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1, 8, 16])
    parser.add_argument(
        "--syncs",
        type=int,
        nargs="+",
        default=[20, 8, 5],
        help=f"timed syncs per size (at least {MIN_TIMED}; {WARMUP} untimed warm-ups first)",
    )
    parser.add_argument("--only", nargs="+", help="run only these methods (and per-tensor)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.syncs) < MIN_TIMED:
        parser.error(
            f"--syncs {' '.join(map(str, args.syncs))}: each size needs at least {MIN_TIMED} "
            "timed syncs (the figure is their median, the worst printed beside it)"
        )

    import torch
    import torch.multiprocessing as tmp

    from hybridmem import _torch
    from hybridmem.bench.engine import BoundedConn

    ctx = tmp.get_context("spawn")
    pipe, child = ctx.Pipe()
    consumer = ctx.Process(target=_consumer, args=(child,))
    consumer.start()
    conn = BoundedConn(pipe, consumer.pid, timeout=600.0)  # no answer waited for unbounded
    results: list[dict[str, Any]] = []
    opens: dict[str, float] = {}
    handoff_ms = 0.0
    for index, gib in enumerate(args.gib):
        syncs = args.syncs[min(index, len(args.syncs) - 1)]
        tensors: dict[str, Any] = {}
        torch.cuda.empty_cache()
        tensors = _model(int(gib * GiB))
        payload = sum(t.nbytes for t in tensors.values())
        conn.send(("model", int(gib * GiB)))
        assert conn.recv() == ("ready",)
        rate = copy_rate(payload, repeats=5)
        if index == 0:
            handoff_ms = _handoff_ms(tensors, conn)
            opens = _open_times(conn)
        largest = max(t.nbytes for t in tensors.values())
        rows = []
        # Unmeasured: the first run after building a model pays for warming the GPU
        # and both processes up (it read ~20% slower than the same bucket later).
        _measure("hybridmem", 1024, 2, tensors, 2, conn)
        runs = _runs(largest)
        if args.only:
            runs = [r for r in runs if r[0] in {*args.only, "per-tensor"}]
        for method, bucket_mib, buffers in runs:
            row = _measure(method, bucket_mib, buffers, tensors, syncs, conn)
            row["gbps"] = payload / row["seconds"] / 1e9
            row["of_copy_rate"] = row["gbps"] / rate
            row["of_ceiling"] = row["gbps"] / (rate / 2)
            rows.append(row)
            _torch.ipc_collect()  # leave the next run a clean device
            torch.cuda.empty_cache()
        per_tensor = next(r["seconds"] for r in rows if r["method"] == "per-tensor")
        for row in rows:
            row["vs_per_tensor"] = per_tensor / row["seconds"]
        results.append(
            {
                "gib": gib,
                "model_bytes": payload,
                "tensors": len(tensors),
                "copy_gbps": rate,
                "syncs": syncs,
                "rows": rows,
            }
        )
        print(
            f"\n== {payload / GiB:.2f} GiB in {len(tensors)} tensors (8B shapes); device copy "
            f"{rate:.0f} GB/s, two-copy ceiling {rate / 2:.0f} GB/s; {syncs} syncs each"
        )
        print(
            f"{'method':<22} {'bucket':>8} {'bufs':>5} {'s/sync':>8} {'worst':>8} {'GB/s':>7} "
            f"{'of copy':>8} {'of ceil':>8} {'vs p-t':>7} {'MiB/sync':>9}"
        )
        for r in rows:
            print(
                f"{r['method']:<22} {r['bucket_mib']:>6}Mi {r['buffers']:>5} "
                f"{r['seconds']:>8.4f} {r['worst_seconds']:>8.4f} {r['gbps']:>7.1f} "
                f"{r['of_copy_rate']:>8.1%} "
                f"{r['of_ceiling']:>8.1%} {r['vs_per_tensor']:>6.1f}x "
                f"{r['growth_mib_per_sync']:>9.1f}"
            )
        del tensors
    conn.send(("stop",))
    consumer.join(timeout=60)
    print(
        f"\nGPU hand-off round trip between the processes {handoff_ms:.3f} ms; open one "
        f"256 MiB handle in the consumer: fd passing {opens['open_fd_first_ms']:.2f} ms "
        f"first, {opens['open_fd_median_ms']:.2f} ms repeated; classic CUDA IPC "
        f"{opens['open_cuda_first_ms']:.2f} ms first, {opens['open_cuda_median_ms']:.2f} ms "
        "repeated"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"handoff_ms": handoff_ms, "opens": opens, "sizes": results}, indent=2)
        )


if __name__ == "__main__":
    main()
