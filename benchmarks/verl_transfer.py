"""verl's own weight transfer against hybridmem's drop-ins, in one run on one GPU.

A trainer process sends an 8B model's tensors (Llama 3 8B shapes and dtypes, as
``benchmarks/weight_sync.py``: 1 GiB, 8 GiB and the whole model, 15 GiB) to an engine
process that copies each received tensor into its own copy of the model (what vLLM's
``load_weights`` and SGLang's do), every sync, each route side by side:

- vLLM route: ``verl``: verl 0.9.1's own ``BucketedWeightSender`` and
  ``BucketedWeightReceiver`` (``bucketed_weight_transfer.py`` read from verl's wheel:
  ``HYBRIDMEM_VERL_WHEEL``; real ZMQ and CUDA IPC; verl's device helpers answered by
  a CUDA stand-in, its other dependencies unused), a new pair each sync as verl makes
  them; ``drop-in``: :mod:`hybridmem.integrations.verl`'s pair as it runs by default,
  same calls, same bucket size, three buffers made and freed each sync (nothing held
  between syncs, as verl's pair); ``drop-in-kept``: the same with the bucket kept
  between syncs (``HYBRIDMEM_VERL_KEEP_BUCKET=1``); ``drop-in-fd``: the default with
  ``HYBRIDMEM_VERL_TRANSPORT=fd`` and an engine denied ``pidfd_getfd`` (seccomp),
  where verl's only way out is ``use_shm``;
- SGLang route (SGLang's server does not run here; what it does with each payload is
  done by its own code, ``tensor_bucket.py`` from its wheel: ``HYBRIDMEM_SGLANG_WHEEL``):
  ``per-tensor``: one CUDA IPC handle per tensor, opened and copied (its
  ``update_weights``); ``flattened``: the drop-in's payload
  (:func:`hybridmem.integrations.sglang.flattened_payload`), one handle per batch of
  512 MiB, rebuilt by SGLang's ``FlattenedTensorBucket`` and copied.

Reported per size and method: seconds per sync (the first sync is a warm-up and not
counted; the median of the rest, at least five, with the worst beside), speed against
verl's (vLLM route) or per-tensor's (SGLang route), the share of the two-copy ceiling
(half the device copy rate, measured in the same run), and device memory lost per sync
over the timed syncs (100 by default at 1 GiB). Then the drop-in's targets, judged
against verl's pair and the hand-written floor measured in the same run
(:func:`verdicts`).

Run on a GPU: ``python benchmarks/verl_transfer.py [--gib 1 8 15] [--json FILE]``
(pyzmq installed; the two wheels downloaded with ``pip download --no-deps``).
``--methods`` runs some of them. ``drop-in-copies`` (not run by default) is the
drop-in whose receiver copies each batch out of the bucket before the callback, where
the drop-in hands out views of it as verl's own receiver does: what the views save.
``hand-written-2`` and ``hand-written-3`` (not run by default) are the floor of any
two-process design with verl's bucket size: the trainer copies each batch into one of
2 (3) device buffers opened once by the engine, which copies each tensor out; device
events shared once order the two, one pipe message per batch each way, nothing else
(no checks, no framing); ``hand-written-fresh-2`` and ``-3`` make, open and free those
buffers on both sides every sync, as verl's pair and the drop-in's default do: the floor
of any design that holds nothing between syncs. ``drop-in-2``, ``drop-in-3`` and
``drop-in-kept-2`` set the drop-in's buffer count. They tell what the two processes
themselves cost against the one-process ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import types
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from weight_sync import _model, copy_rate  # noqa: E402  (this folder's)

MiB, GiB = 1 << 20, 1 << 30
WARMUP = 1  # the first sync of each method and size: not counted
MIN_TIMED = 5  # at least six syncs a point, the warm-up included
HANDLE = "ipc:///tmp/hybridmem-bench-verl-{}.sock"
TRANSFER = "verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py"
BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
METHODS = ("verl", "drop-in", "drop-in-kept", "drop-in-fd", "per-tensor", "flattened")
DROP_INS = (
    "drop-in",
    "drop-in-kept",
    "drop-in-fd",
    "drop-in-copies",
    "drop-in-2",
    "drop-in-3",
    "drop-in-kept-2",
)
EXTRA = (
    "drop-in-copies",
    "drop-in-2",
    "drop-in-3",
    "drop-in-kept-2",
    "hand-written-2",
    "hand-written-3",
    "hand-written-fresh-2",
    "hand-written-fresh-3",
)
#: The drop-in's targets against verl's own pair: (method, GiB, at least x verl's speed).
SPEED_TARGETS = (("drop-in", 8, 6.0), ("drop-in", 1, 20.0), ("drop-in-kept", 8, 10.0))
#: The kept bucket's share of the two-copy ceiling at 8 GiB, at least.
KEPT_SHARE_TARGET = 0.70
#: Every drop-in within this factor of the hand-written floor with its buffer count.
FLOOR_TARGET = 1.25
CEILING_BYTES = 2 * GiB  # what the device copy rate is measured on


def _from_wheel(env: str, member: str, name: str) -> types.ModuleType:
    """``member`` of the wheel ``$env`` names, run as module ``name`` (registered)."""
    path = os.environ.get(env)
    if not path:
        raise SystemExit(f"set {env} to the wheel (pip download --no-deps)")
    with zipfile.ZipFile(path) as wheel:
        source = wheel.read(member).decode()
    module = types.ModuleType(name)
    module.__file__ = f"{path}/{member}"  # verl names its logger from it
    sys.modules[name] = module
    exec(compile(source, member, "exec"), module.__dict__)
    return module


def verl_module() -> types.ModuleType:
    """verl's bucketed transfer, its device helpers answered for CUDA (see the module)."""
    import torch

    device = types.ModuleType("verl.utils.device")
    device.get_device_id = torch.cuda.current_device  # type: ignore[attr-defined]
    device.get_device_name = lambda: "cuda"  # type: ignore[attr-defined]
    device.get_torch_device = lambda: torch.cuda  # type: ignore[attr-defined]
    device.is_support_ipc = lambda: True  # type: ignore[attr-defined]
    sys.modules["verl.utils.device"] = device
    utils = types.ModuleType("verl.workers.rollout.utils")

    async def ensure_async_iterator(items: Any) -> Any:
        for item in items:
            yield item

    utils.ensure_async_iterator = ensure_async_iterator  # type: ignore[attr-defined]
    sys.modules["verl.workers.rollout.utils"] = utils
    return _from_wheel("HYBRIDMEM_VERL_WHEEL", TRANSFER, "verl_bucketed_weight_transfer")


def _engine(conn: Any, deny: bool) -> None:
    """The engine's side: its own model copy; receives one sync per command."""
    import torch

    if deny:
        from tests.seccomp import deny_pidfd_getfd

        deny_pidfd_getfd()
    from hybridmem import _torch
    from hybridmem.integrations.verl.transfer import BucketedWeightReceiver
    from hybridmem.ipc.receiver import BucketReceiver

    verl = verl_module()
    bucket = _from_wheel("HYBRIDMEM_SGLANG_WHEEL", BUCKET, "sglang_tensor_bucket")
    device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {}
    hand: tuple[list[Any], list[Any], list[Any]] = ([], [], [])  # buffers, filled, drained

    def load(weights: list[tuple[str, Any]], last: bool) -> None:
        for name, tensor in weights:
            out[name].copy_(tensor)

    while True:
        command = conn.recv()
        kind = command[0]
        if kind == "stop":
            return
        if kind == "model":
            out = {}
            hand = ([], [], [])
            torch.cuda.empty_cache()
            out = _model(command[1])
            torch.cuda.synchronize()
        elif kind == "verl":
            verl.BucketedWeightReceiver(command[1], device).receive_weights(load)
        elif kind == "drop-in":
            BucketedWeightReceiver(command[1], device).receive_weights(load)
        elif kind == "drop-in-copies":  # the receiver copies out of the bucket first
            zero_copy = BucketReceiver.zero_copy
            BucketReceiver.zero_copy = property(lambda self: False)  # type: ignore[method-assign,assignment]
            try:
                BucketedWeightReceiver(command[1], device).receive_weights(load)
            finally:
                BucketReceiver.zero_copy = zero_copy  # type: ignore[method-assign]
        elif kind == "hand-open":  # the hand-written floor's buffers and events, once
            buffers = [_torch.import_cuda_tensor(r, a, device.index) for r, a in command[1]]
            filled = [torch.cuda.Event.from_ipc_handle(device, h) for h in command[2]]  # type: ignore[no-untyped-call]
            drained = [torch.cuda.Event(interprocess=True) for _ in buffers]  # type: ignore[no-untyped-call]
            for event in drained:
                event.record()
            hand = (buffers, filled, drained)
            conn.send(("opened", [event.ipc_handle() for event in drained]))  # type: ignore[no-untyped-call]
            continue
        elif kind == "hand-close":  # the fresh floor: let go of the buffers, as verl's does
            torch.cuda.synchronize()
            hand = ([], [], [])
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
            torch.cuda.empty_cache()
            conn.send(("closed",))
            continue
        elif kind == "hand-written":  # one sync: a message per batch until "end"
            buffers, filled, drained = hand
            stream = torch.cuda.current_stream()
            while (message := conn.recv())[0] == "batch":
                _, index, layout = message
                stream.wait_event(filled[index])
                for name, offset in layout:
                    target = out[name]
                    source = buffers[index][offset : offset + target.nbytes]
                    target.copy_(source.view(target.dtype).view(target.shape))
                drained[index].record(stream)
                conn.send(("drained", index))
            torch.cuda.synchronize()
            conn.send(("ack", torch.cuda.mem_get_info()[0]))
            continue
        elif kind == "per-tensor":
            for name, (rebuild, args) in command[1]:
                tensor = _torch.import_cuda_tensor(rebuild, args, device.index)
                out[name].copy_(tensor)
                del tensor
        elif kind == "flattened":
            for (rebuild, args), metadata in command[1]:
                flat = _torch.import_cuda_tensor(rebuild, args, device.index)
                named = bucket.FlattenedTensorBucket(
                    flattened_tensor=flat, metadata=metadata
                ).reconstruct_tensors()
                load(named, False)
                del flat, named
        torch.cuda.synchronize()
        conn.send(("ack", torch.cuda.mem_get_info()[0]))


def _batches(tensors: dict[str, Any], limit: int, align: int = 1) -> list[list[tuple[str, int]]]:
    """(name, byte offset) batches of at most ``limit`` bytes, offsets ``align``-aligned."""
    batches: list[list[tuple[str, int]]] = [[]]
    offset = 0
    for name, tensor in tensors.items():
        if batches[-1] and offset + tensor.nbytes > limit:
            batches.append([])
            offset = 0
        batches[-1].append((name, offset))
        offset = -(-(offset + tensor.nbytes) // align) * align
    return batches


class HandWritten:
    """The floor's trainer side: ``count`` buffers of ``nbytes``, opened by the engine once.

    :meth:`close` lets go of them on both sides as verl's ``_cleanup`` does (the engine
    first): the ``hand-written-fresh`` floors make and close them every sync.
    """

    def __init__(self, conn: Any, nbytes: int, count: int) -> None:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        self.conn = conn
        self.nbytes = nbytes
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(count)]
        self.filled = [torch.cuda.Event(interprocess=True) for _ in range(count)]  # type: ignore[no-untyped-call]
        for event in self.filled:
            event.record()
        exports = [reduce_tensor(b) for b in self.buffers]  # type: ignore[no-untyped-call]
        conn.send(("hand-open", exports, [e.ipc_handle() for e in self.filled]))  # type: ignore[no-untyped-call]
        answer = conn.recv()
        device = torch.device("cuda", torch.cuda.current_device())
        self.drained = [torch.cuda.Event.from_ipc_handle(device, h) for h in answer[1]]  # type: ignore[no-untyped-call]

    def sync(self, tensors: dict[str, Any]) -> float:
        """One sync; the engine's free device memory after it."""
        import torch

        stream = torch.cuda.current_stream()
        count = len(self.buffers)
        self.conn.send(("hand-written",))
        for number, layout in enumerate(_batches(tensors, self.nbytes, 256)):
            index = number % count
            if number >= count:  # the engine has queued its reads of this buffer
                assert self.conn.recv() == ("drained", index)
                stream.wait_event(self.drained[index])
            for name, offset in layout:
                source = tensors[name]
                target = self.buffers[index][offset : offset + source.nbytes]
                target.view(source.dtype).view(source.shape).copy_(source)
            self.filled[index].record(stream)
            self.conn.send(("batch", index, layout))
        self.conn.send(("end",))
        while (answer := self.conn.recv())[0] == "drained":
            pass
        return float(answer[1])

    def close(self) -> None:
        """Free the buffers: the engine lets go and empties its cache, then this side."""
        import torch

        self.conn.send(("hand-close",))
        assert self.conn.recv() == ("closed",)
        self.buffers, self.filled, self.drained = [], [], []
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def _run(method: str, tensors: dict[str, Any], conn: Any, syncs: int, verl: Any) -> dict[str, Any]:
    """Time ``syncs`` syncs of ``method`` after WARMUP; its row."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor as _reduce

    from hybridmem.integrations import sglang
    from hybridmem.integrations.verl.transfer import BucketedWeightSender

    def reduce_tensor(tensor: Any) -> Any:
        return _reduce(tensor)  # type: ignore[no-untyped-call]

    handle = HANDLE.format(method)
    bucket_mb = max(512, -(-max(t.nbytes for t in tensors.values()) // MiB))  # verl's refuses less
    fresh = method.startswith("hand-written-fresh")
    hand = (
        HandWritten(conn, bucket_mb * MiB, int(method[-1]))
        if method.startswith("hand-written") and not fresh
        else None
    )

    def sync() -> float:
        if fresh:  # made, opened, used and freed on both sides within the sync
            once = HandWritten(conn, bucket_mb * MiB, int(method[-1]))
            free = once.sync(tensors)
            once.close()
            return free
        if hand is not None:
            return hand.sync(tensors)
        if method == "verl" or method in DROP_INS:
            receiving = "drop-in-copies" if method == "drop-in-copies" else "drop-in"
            conn.send(("verl", handle) if method == "verl" else (receiving, handle))
            kind = verl.BucketedWeightSender if method == "verl" else BucketedWeightSender
            sender = kind(handle, bucket_size_mb=bucket_mb)
            asyncio.run(sender.async_send_weights(iter(tensors.items())))
        elif method == "per-tensor":
            handles = [(name, reduce_tensor(t)) for name, t in tensors.items()]
            conn.send(("per-tensor", handles))
        else:  # flattened: one payload per 512 MiB batch, out of the drop-in's buffer
            payloads = []
            for batch in _batches(tensors, 512 * MiB):
                named = [(name, tensors[name]) for name, _ in batch]
                payload = sglang.flattened_payload(named, flat_metadata)
                payloads.append((reduce_tensor(payload["flattened_tensor"]), payload["metadata"]))
                conn.send(("flattened", payloads))
                answer = conn.recv()
                payloads = []
            return float(answer[1])
        return float(conn.recv()[1])

    flat_metadata = sys.modules["sglang_tensor_bucket"].FlattenedTensorMetadata
    free_before = 0.0
    for _ in range(WARMUP):
        free_before = sync()
    seconds = []
    for _ in range(syncs):
        torch.cuda.synchronize()
        started = time.perf_counter()
        free_after = sync()
        seconds.append(time.perf_counter() - started)
    return {
        "method": method,
        "bucket_mib": bucket_mb,
        "buffers": buffers_of(method),
        "seconds": statistics.median(seconds),
        "worst_seconds": max(seconds),
        "timed_syncs": syncs,
        "engine_growth_mib_per_sync": (free_before - free_after) / MiB / syncs,
    }


def buffers_of(method: str) -> int:
    """How many bucket-sized buffers ``method`` rotates (verl's own pair: one).

    The drop-in's defaults are its link's: two for a bucket made each sync, three for
    a kept one.

    Example:
        >>> buffers_of("drop-in"), buffers_of("drop-in-kept"), buffers_of("verl")
        (2, 3, 1)
    """
    from hybridmem.integrations.verl.settings import DEFAULT_BUFFERS, DEFAULT_KEPT_BUFFERS

    if method == "verl":
        return 1
    if method[-1].isdigit():
        return int(method[-1])
    if method.startswith("drop-in"):
        return DEFAULT_KEPT_BUFFERS if "-kept" in method else DEFAULT_BUFFERS
    return 1


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The drop-in's targets, judged on rows of one run (each beside its baselines).

    Speed against verl's own pair at a size (:data:`SPEED_TARGETS`), the kept
    bucket's share of the two-copy ceiling at 8 GiB (:data:`KEPT_SHARE_TARGET`), and
    each drop-in within :data:`FLOOR_TARGET` of the hand-written floor with its
    buffer count, where that floor ran.

    Example:
        >>> rows = [{"method": "verl", "gib": 1.0, "seconds": 0.16},
        ...         {"method": "drop-in", "gib": 1.0, "seconds": 0.004, "share": 0.4}]
        >>> verdicts(rows)[0]
        'drop-in at 1 GiB: 40.0x verl (target >= 20.0x): met'
    """
    lines: list[str] = []

    def at(method: str, gib: float) -> dict[str, Any] | None:
        found = [r for r in rows if r["method"] == method and round(r["gib"]) == gib]
        return found[0] if found else None

    for method, gib, target in SPEED_TARGETS:
        row, verl = at(method, gib), at("verl", gib)
        if row is None or verl is None:
            continue
        speed = verl["seconds"] / row["seconds"]
        lines.append(
            f"{method} at {gib:g} GiB: {speed:.1f}x verl (target >= {target:.1f}x): "
            + ("met" if speed >= target else "NOT met")
        )
    kept = at("drop-in-kept", 8)
    if kept is not None:
        lines.append(
            f"drop-in-kept at 8 GiB: {kept['share']:.1%} of the two-copy ceiling "
            f"(target >= {KEPT_SHARE_TARGET:.0%}): "
            + ("met" if kept["share"] >= KEPT_SHARE_TARGET else "NOT met")
        )
    for row in rows:
        if not row["method"].startswith("drop-in") or row["method"] == "drop-in-fd":
            continue
        count, gib = buffers_of(row["method"]), round(row["gib"])
        floor, fresh = at(f"hand-written-{count}", gib), at(f"hand-written-fresh-{count}", gib)
        if floor is None:
            continue
        ratio = row["seconds"] / floor["seconds"]
        beside = ""
        if fresh is not None and "-kept" not in row["method"]:  # holds nothing, as it does
            beside = (
                f"; {row['seconds'] / fresh['seconds']:.2f}x the same floor made and freed "
                "each sync, as this one is"
            )
        lines.append(
            f"{row['method']} at {row['gib']:.2f} GiB: {ratio:.2f}x the hand-written floor "
            f"with {count} buffers opened once (target <= {FLOOR_TARGET}x{beside}): "
            + ("met" if ratio <= FLOOR_TARGET else "NOT met")
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1, 8, 15])
    parser.add_argument(
        "--syncs",
        type=int,
        nargs="+",
        default=[100, 8, 6],
        help=f"timed syncs per size, at least {MIN_TIMED} (one more runs first, untimed)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--methods", nargs="+", choices=(*METHODS, *EXTRA), default=list(METHODS))
    args = parser.parse_args()
    if min(args.syncs) < MIN_TIMED:
        parser.error(f"--syncs: at least {MIN_TIMED} timed syncs a size, got {args.syncs}")

    import torch
    import torch.multiprocessing as tmp

    from hybridmem.bench.engine import BoundedConn
    from hybridmem.integrations.verl import link

    runs = args.methods

    verl = verl_module()
    _from_wheel("HYBRIDMEM_SGLANG_WHEEL", BUCKET, "sglang_tensor_bucket")
    ctx = tmp.get_context("spawn")
    engines = {}
    for deny in (False, True):
        pipe, child = ctx.Pipe()
        process = ctx.Process(target=_engine, args=(child, deny))
        process.start()
        child.close()
        engines[deny] = (BoundedConn(pipe, process.pid, timeout=600.0), process)
    rows: list[dict[str, Any]] = []
    try:
        for index, gib in enumerate(args.gib):
            syncs = args.syncs[min(index, len(args.syncs) - 1)]
            tensors: dict[str, Any] = {}
            torch.cuda.empty_cache()
            tensors = _model(int(gib * GiB))
            payload = sum(t.nbytes for t in tensors.values())
            for conn, _ in engines.values():
                conn.send(("model", int(gib * GiB)))
                conn.recv()
            # bytes/s (copy_rate: GB/s); the rate is flat past a few hundred MiB, and two
            # copies of 15 GiB beside three models do not fit an 80 GiB card.
            ceiling = copy_rate(min(payload, CEILING_BYTES), repeats=5) * 1e9 / 2
            print(
                f"== {payload / GiB:.2f} GiB in {len(tensors)} tensors; "
                f"two-copy ceiling {ceiling / 1e9:.0f} GB/s",
                flush=True,
            )
            for method in runs:
                deny = method == "drop-in-fd"
                os.environ["HYBRIDMEM_VERL_TRANSPORT"] = "fd" if deny else "auto"
                link.close_links()  # each method's own link (the fd one: another bucket)
                count = method[-1] if method[-1].isdigit() else ""  # else the link's default
                os.environ["HYBRIDMEM_VERL_BUFFERS"] = count
                os.environ["HYBRIDMEM_VERL_KEEP_BUCKET"] = "1" if "-kept" in method else "0"
                row = _run(method, tensors, engines[deny][0], syncs, verl)
                row.update(gib=payload / GiB, share=payload / row["seconds"] / ceiling)
                rows.append(row)
            base = {r["method"]: r["seconds"] for r in rows if r["gib"] == payload / GiB}
            for row in rows[-len(runs) :]:
                vllm_route = row["method"].startswith(("verl", "drop-in", "hand"))
                ref = base.get("verl" if vllm_route else "per-tensor")
                row["speedup"] = ref / row["seconds"] if ref else None
                times = f"{row['speedup']:6.1f}x" if ref else "     -"
                print(
                    f"{row['method']:<14} {row['seconds']:8.4f} s/sync "
                    f"(worst {row['worst_seconds']:.4f})  {times}  "
                    f"{row['share']:6.1%} of ceiling  "
                    f"{row['engine_growth_mib_per_sync']:6.1f} MiB/sync",
                    flush=True,
                )
            if args.json:  # after each size: a run cut short keeps what it measured
                args.json.write_text(json.dumps(rows, indent=1))
        for line in verdicts(rows):
            print(line, flush=True)
    finally:  # an error (a size that does not fit) must not leave the engines waiting
        link.close_links()
        for conn, process in engines.values():
            with contextlib.suppress(Exception):
                conn.send(("stop",))
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


if __name__ == "__main__":
    main()
