"""CUDA IPC scenarios: a producer and a restricted consumer, both in ``spawn`` processes.

Usage: ``python -m tests.gpu.ipc_scenarios NAME``; the last line printed is a JSON
object of facts. The consumer installs a seccomp filter that denies
``pidfd_getfd`` (EPERM for syscall 438), as a default container profile does,
before it touches CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as tmp

import hybridmem as hm
from hybridmem import _torch
from tests.gpu.runner import settled_free

MiB = 1 << 20
GiB = 1 << 30
_ctx = tmp.get_context("spawn")


def _init_cuda() -> None:
    torch.zeros(1, device="cuda")  # creates the context of the current device


def _restrict() -> None:
    from tests.seccomp import deny_pidfd_getfd

    deny_pidfd_getfd()


def _checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """An exact checksum of a tensor's bytes: byte sum and 32-bit word sum, no rounding."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    words = flat[: flat.numel() // 4 * 4].view(torch.int32)
    return int(flat.sum(dtype=torch.int64)), int(words.sum(dtype=torch.int64))


def _consumer_plain(queue: Any, answers: Any) -> None:
    _restrict()
    _init_cuda()
    results: dict[str, Any] = {}
    while True:
        try:
            label, tensor = queue.get()
        except Exception as exc:  # the import of an expandable segment fails here
            results[f"error_{len(results)}"] = f"{type(exc).__name__}: {exc}"
            continue
        if label == "stop":
            break
        results[label] = _checksum(tensor)
        del tensor
    results["capabilities"] = hm.ipc_capabilities().as_dict()
    answers.put(results)


def sharing() -> dict[str, Any]:
    """(a) plain sharing of an expandable tensor fails; (b) ipc_shareable / ipc_safe work."""
    _init_cuda()
    queue = _ctx.Queue()
    answers = _ctx.Queue()
    consumer = _ctx.Process(target=_consumer_plain, args=(queue, answers))
    consumer.start()
    facts: dict[str, Any] = {}
    with hm.expandable_segments(True):
        torch.manual_seed(0)
        weight = torch.randn(64 * MiB // 4, device="cuda")  # 64 MiB
        facts["weight_legacy_ipc"] = _torch.is_legacy_ipc_capable(weight)
        facts["checksum"] = _checksum(weight)
        queue.put(("plain", weight))  # (a): fails in the consumer
        started = time.perf_counter()
        shareable = hm.ipc_shareable(weight)
        facts["shareable_seconds"] = time.perf_counter() - started
        facts["shareable_is_copy"] = shareable is not weight
        facts["shareable_legacy_ipc"] = _torch.is_legacy_ipc_capable(shareable)
        queue.put(("shareable", shareable))
        with hm.ipc_safe() as scope:
            facts["transport"] = scope.transport
            staged = weight.clone()
        facts["staged_legacy_ipc"] = _torch.is_legacy_ipc_capable(staged)
        queue.put(("ipc_safe", staged))
        classic = hm.ipc_shareable(staged)
        facts["classic_returned_itself"] = classic is staged
        started = time.perf_counter()
        for _ in range(1000):
            hm.ipc_shareable(staged)
        facts["check_us"] = (time.perf_counter() - started) * 1e3
        facts["expandable_after"] = hm.allocator_state().expandable_segments
        queue.put(("stop", None))
        facts["consumer"] = answers.get(timeout=300)
    consumer.join(timeout=60)
    facts["consumer_exit"] = consumer.exitcode
    return facts


# --------------------------------------------------------------------------- #
# (c) 200 syncs of a 1 GiB model through one 256 MiB bucket
# --------------------------------------------------------------------------- #


def _model(total: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A model-like set of tensors: a few big matrices and many small vectors."""
    torch.manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    big = total // 2
    tensors["embed"] = torch.empty(big // 2, dtype=torch.bfloat16, device=device)  # > bucket
    remaining = total - big
    layer = 0
    while remaining > 0:
        size = min(remaining, 24 * MiB)
        tensors[f"layers.{layer}.w"] = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
        tensors[f"layers.{layer}.norm"] = torch.empty(1024, dtype=torch.float32, device=device)
        remaining -= size + 4096
        layer += 1
    for tensor in tensors.values():
        tensor.normal_()
    return tensors


def _consumer_bucket(conn: Connection, control: Connection, syncs: int, restrict: bool) -> None:
    if restrict:
        _restrict()
    _init_cuda()
    handle = conn.recv()
    receiver = hm.BucketReceiver(handle)
    out: dict[str, torch.Tensor] | None = None
    bad = 0
    for step in range(syncs):
        if out is None:
            out = {name: t.clone() for name, t in receiver.receive(conn)}
        else:
            for _ in receiver.receive(conn, out=out):
                pass
        expected = control.recv()
        if expected is not None:
            got = {name: _checksum(t) for name, t in out.items()}
            bad += int(got != expected)
        control.send(("done", step))
    control.send(("bad", bad, receiver.device.index))
    receiver.close()


def bucket_syncs(
    syncs: int = 200, model_bytes: int = GiB, bucket: int = 256 * MiB
) -> dict[str, Any]:
    """(c) device memory stays flat across syncs; the receiver's data is intact."""
    _init_cuda()
    device = torch.cuda.current_device()
    tensors = _model(model_bytes, "cuda")
    conn, child_conn = _ctx.Pipe()
    control, child_control = _ctx.Pipe()
    consumer = _ctx.Process(target=_consumer_bucket, args=(child_conn, child_control, syncs, True))
    consumer.start()
    assert consumer.pid is not None
    own = {consumer.pid}  # the one other process this scenario's samples count
    staging = hm.WeightBucket(bucket)
    conn.send(staging.handle)
    free: list[int] = []
    seconds: list[float] = []
    checked = 0
    for step in range(syncs):
        check = step < 3 or step % 20 == 0 or step == syncs - 1
        if check:  # new weights, and their checksums for the receiver
            tensors[f"layers.{step % 8}.w"].normal_()
            tensors["embed"].add_(1)
        report = staging.send(tensors, conn)
        seconds.append(report.seconds)
        control.send({n: _checksum(t) for n, t in tensors.items()} if check else None)
        checked += int(check)
        assert control.recv() == ("done", step)
        free.append(settled_free(device, allowed=own))
    _, bad, consumer_device = control.recv()
    consumer.join(timeout=120)
    staging.close()
    return {
        "syncs": syncs,
        "model_bytes": sum(t.nbytes for t in tensors.values()),
        "tensors": len(tensors),
        "transport": staging.transport,
        "free_first": free[0],
        "free_last": free[-1],
        "free_min": min(free),
        "drift_bytes": free[0] - free[-1],
        "checked": checked,
        "bad": bad,
        "median_gbps": sorted(sum(t.nbytes for t in tensors.values()) / s / 1e9 for s in seconds)[
            len(seconds) // 2
        ],
        "consumer_device": consumer_device,
        "consumer_exit": consumer.exitcode,
        "device_handoff": staging._drained is not None,
    }


# --------------------------------------------------------------------------- #
# Capabilities, host fallback, and the UUID mapping
# --------------------------------------------------------------------------- #


def _consumer_caps(answers: Any) -> None:
    _restrict()
    answers.put(hm.ipc_capabilities().as_dict())


def capabilities() -> dict[str, Any]:
    """(d) the probe in a restricted consumer reports the denial and why; unrestricted too."""
    answers = _ctx.Queue()
    consumer = _ctx.Process(target=_consumer_caps, args=(answers,))
    consumer.start()
    restricted = answers.get(timeout=300)
    consumer.join(timeout=60)
    started = time.perf_counter()
    here = hm.ipc_capabilities()
    return {
        "restricted": restricted,
        "unrestricted": here.as_dict(),
        "unrestricted_seconds": time.perf_counter() - started,
        "cuda_initialized_here": _torch.cuda_initialized(),
    }


def host_fallback() -> dict[str, Any]:
    """fallback='host': weights go through pinned shared memory, intact."""
    _init_cuda()
    tensors = _model(256 * MiB, "cuda")
    conn, child_conn = _ctx.Pipe()
    control, child_control = _ctx.Pipe()
    consumer = _ctx.Process(target=_consumer_bucket, args=(child_conn, child_control, 3, True))
    consumer.start()
    staging = hm.WeightBucket(64 * MiB, fallback="host")
    conn.send(staging.handle)
    gbps = []
    for step in range(3):
        report = staging.send(tensors, conn)
        gbps.append(report.gbps)
        control.send({n: _checksum(t) for n, t in tensors.items()})
        assert control.recv() == ("done", step)
    _, bad, _consumer_device = control.recv()
    consumer.join(timeout=120)
    staging.close()
    return {"transport": staging.transport, "bad": bad, "gbps": gbps, "exit": consumer.exitcode}


def _consumer_uuid(conn: Connection, control: Connection) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["CONSUMER_VISIBLE"]
    _consumer_bucket(conn, control, 2, False)


def uuid_mapping() -> dict[str, Any]:
    """Producer on device 1 of (0,1); consumer sees only that GPU, as its device 0."""
    torch.cuda.set_device(1)
    os.environ["CONSUMER_VISIBLE"] = str(
        os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[1]
    )
    tensors = _model(64 * MiB, "cuda:1")
    conn, child_conn = _ctx.Pipe()
    control, child_control = _ctx.Pipe()
    consumer = _ctx.Process(target=_consumer_uuid, args=(child_conn, child_control))
    consumer.start()
    staging = hm.WeightBucket(16 * MiB)
    conn.send(staging.handle)
    for step in range(2):
        staging.send(tensors, conn)
        control.send({n: _checksum(t) for n, t in tensors.items()})
        assert control.recv() == ("done", step)
    _, bad, consumer_device = control.recv()
    consumer.join(timeout=120)
    staging.close()
    return {
        "producer_device": 1,
        "bucket_device": str(staging.device),
        "consumer_device": consumer_device,
        "uuid": staging.handle.device_uuid,
        "context_on_0": _torch.has_context(0),
        "bad": bad,
        "exit": consumer.exitcode,
    }


def _consumer_dies(conn: Connection) -> None:
    _restrict()
    _init_cuda()
    receiver = hm.BucketReceiver(conn.recv())
    for _ in receiver.receive(conn):
        os._exit(3)  # dies holding the first batch


def _consumer_once(conn: Connection) -> None:
    _restrict()
    _init_cuda()
    with hm.BucketReceiver(conn.recv()) as receiver:
        got = {name: _checksum(t) for name, t in receiver.receive(conn)}
    conn.send(got)


def bucket_faults() -> dict[str, Any]:
    """Issue #11 on CUDA buffers: a dying consumer; bf16 views at odd offsets; no hang."""
    _init_cuda()
    out: dict[str, Any] = {}
    flat = torch.randn(64 * MiB + 1, device="cuda").to(torch.bfloat16)  # one flat buffer
    tensors = {
        "a": flat[1 : 16 * MiB + 1].view(4096, -1),  # starts 2 bytes in: moved as int16
        "b": flat[16 * MiB + 1 : 48 * MiB + 1],
        "c": flat[48 * MiB + 1 :],
    }
    with hm.WeightBucket(32 * MiB) as bucket:
        out["transport"] = bucket.transport
        conn, child = _ctx.Pipe()
        consumer = _ctx.Process(target=_consumer_dies, args=(child,))
        consumer.start()
        conn.send(bucket.handle)
        started = time.monotonic()
        try:
            bucket.send(tensors, conn, timeout=120)
            out["dying"] = "returned"
        except hm.SyncError as exc:
            out["dying"] = str(exc)
        out["dying_seconds"] = time.monotonic() - started
        consumer.join(60)
        out["dying_exit"] = consumer.exitcode
        conn2, child2 = _ctx.Pipe()
        consumer2 = _ctx.Process(target=_consumer_once, args=(child2,))
        consumer2.start()
        conn2.send(bucket.handle)
        bucket.send(tensors, conn2)
        sent = {n: _checksum(t.clone()) for n, t in tensors.items()}  # clones: aligned
        out["next_sync_intact"] = conn2.recv() == sent
        consumer2.join(60)
        out["next_exit"] = consumer2.exitcode
    child.close()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "sharing": sharing,
    "bucket_syncs": bucket_syncs,
    "capabilities": capabilities,
    "host_fallback": host_fallback,
    "uuid_mapping": uuid_mapping,
    "bucket_faults": bucket_faults,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
