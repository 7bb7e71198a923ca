"""Expandable-segment tensors across processes by fd passing, consumer denied ``pidfd_getfd``.

Usage: ``python -m tests.gpu.fd_scenarios NAME``; the last line printed is a JSON
object of facts. Every consumer installs the seccomp filter of
:mod:`tests.seccomp` before it touches CUDA, and checks that the filter works.
"""

from __future__ import annotations

import json
import logging
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
from hybridmem.ipc import export as export_module
from hybridmem.ipc import fd_server
from tests.gpu.runner import settled_free

MiB = 1 << 20
GiB = 1 << 30
_ctx = tmp.get_context("spawn")


def _restrict() -> str | None:
    """Deny pidfd_getfd here; return the errno name a pidfd_getfd on our parent now gets."""
    from hybridmem._platform import linux
    from tests.seccomp import deny_pidfd_getfd

    deny_pidfd_getfd()
    return linux.errno_name(linux.fetch_fd(os.getppid(), 0))


def _checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """Byte sum and 32-bit word sum of a tensor's bytes (exact, no rounding)."""
    flat = tensor.detach().clone().reshape(-1).view(torch.uint8)
    words = flat[: flat.numel() // 4 * 4].view(torch.int32)
    return int(flat.sum(dtype=torch.int64)), int(words.sum(dtype=torch.int64))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _used(index: int = 0) -> int:
    """Device memory in use, once no earlier process of this test run holds the GPU."""
    free = settled_free(index)
    return int(torch.cuda.mem_get_info(index)[1] - free)


def _listening() -> int:
    """hybridmem sockets listening in this network namespace (/proc/net/unix)."""
    count = 0
    with open("/proc/net/unix") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            # Flags 00010000: __SO_ACCEPTCON (a listener); path @hybridmem-fd-...
            if len(fields) >= 8 and fields[3] == "00010000" and "@hybridmem-fd-" in fields[7]:
                count += 1
    return count


def _wait_leases(count: int, deadline_s: float = 10.0) -> int:
    """Wait (bounded) for the server thread to process releases; return the lease count."""
    end = time.monotonic() + deadline_s
    while fd_server.server_stats().leases != count and time.monotonic() < end:
        time.sleep(0.005)
    return fd_server.server_stats().leases


# --------------------------------------------------------------------------- #
# (a) + (b): 256 MiB, same memory, no copy
# --------------------------------------------------------------------------- #


def _consumer_basic(conn: Connection) -> None:
    out: dict[str, Any] = {"pidfd_getfd": _restrict()}
    torch.zeros(1, device="cuda")
    handle = conn.recv()
    out["kind"] = handle.kind
    out["pages"] = len(handle.pages)
    torch.cuda.synchronize()
    used_before = _used()
    started = time.perf_counter()
    tensor = handle.open()
    out["open_s"] = time.perf_counter() - started
    torch.cuda.synchronize()
    out["used_growth"] = _used() - used_before
    out["dtype"] = str(tensor.dtype)
    out["shape"] = list(tensor.shape)
    out["checksum"] = _checksum(tensor)
    out["fds_while_open"] = _fds()
    tensor[: MiB // 4].fill_(7.0)  # (b) a write the producer must see
    torch.cuda.synchronize()
    conn.send(out)
    conn.recv()  # the producer looked
    del tensor
    out2 = {"open_handles_after": export_module.open_handles(), "fds_after": _fds()}
    conn.send(out2)


def basic() -> dict[str, Any]:
    torch.zeros(1, device="cuda")
    facts: dict[str, Any] = {}
    with hm.expandable_segments(True):
        torch.manual_seed(0)
        weight = torch.randn(256 * MiB // 4, device="cuda")
    facts["legacy_ipc"] = _torch.is_legacy_ipc_capable(weight)
    facts["checksum"] = _checksum(weight)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    parent, child = _ctx.Pipe()
    consumer = _ctx.Process(target=_consumer_basic, args=(child,))
    consumer.start()
    started = time.perf_counter()
    handle = hm.ipc_export(weight)
    facts["export_s"] = time.perf_counter() - started
    facts["listening_before_open"] = _listening()
    parent.send(handle)
    facts["consumer"] = parent.recv()
    facts["listening_after_open"] = _listening()
    facts["allocated_growth"] = torch.cuda.memory_allocated() - allocated
    facts["leases_open"] = fd_server.server_stats().leases
    torch.cuda.synchronize()
    facts["producer_sees_write"] = bool((weight[: MiB // 4] == 7.0).all())
    facts["rest_untouched"] = _checksum(weight[MiB // 4 :]) == _checksum(
        _reference(256 * MiB // 4)[MiB // 4 :]
    )
    parent.send("looked")
    facts["consumer_after"] = parent.recv()
    facts["leases_after_drop"] = _wait_leases(0)
    consumer.join(60)
    facts["consumer_exit"] = consumer.exitcode
    facts["repr_hides_token"] = handle.token.hex() not in repr(handle)
    return facts


def _reference(n: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, device="cuda")


# --------------------------------------------------------------------------- #
# (c): 200 cycles, no growth, no fd leak
# --------------------------------------------------------------------------- #


def _consumer_cycles(conn: Connection, cycles: int) -> None:
    out: dict[str, Any] = {"pidfd_getfd": _restrict()}
    torch.zeros(1, device="cuda")
    opens: list[float] = []
    bad = 0
    samples: dict[int, tuple[int, int]] = {}
    for cycle in range(cycles):
        handle = conn.recv()
        started = time.perf_counter()
        tensor = handle.open()
        opens.append(time.perf_counter() - started)
        if int(tensor[cycle % tensor.numel()].item()) != cycle % 251:
            bad += 1
        del tensor
        torch.cuda.synchronize()
        if cycle in (9, cycles - 1):
            samples[cycle] = (_fds(), _used())
        conn.send(cycle)
    out.update(
        opens_first_s=opens[0],
        opens_median_s=sorted(opens[1:])[len(opens) // 2],
        bad=bad,
        fds_10=samples[9][0],
        fds_last=samples[cycles - 1][0],
        used_10=samples[9][1],
        used_last=samples[cycles - 1][1],
        open_handles=export_module.open_handles(),
        live_external=_torch.live_external_tensors(),
    )
    conn.send(out)


def cycles(count: int = 200) -> dict[str, Any]:
    torch.zeros(1, device="cuda")
    with hm.expandable_segments(True):
        tensor = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    parent, child = _ctx.Pipe()
    consumer = _ctx.Process(target=_consumer_cycles, args=(child, count))
    consumer.start()
    samples: dict[int, tuple[int, int, int]] = {}
    exports: list[float] = []
    for cycle in range(count):
        tensor[cycle % tensor.numel()] = cycle % 251
        started = time.perf_counter()
        handle = hm.ipc_export(tensor)
        exports.append(time.perf_counter() - started)
        parent.send(handle)
        assert parent.recv() == cycle
        if cycle in (9, count - 1):
            _wait_leases(0)
            samples[cycle] = (_fds(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    facts: dict[str, Any] = {"consumer": parent.recv(), "cycles": count}
    consumer.join(60)
    facts["consumer_exit"] = consumer.exitcode
    facts["export_median_s"] = sorted(exports)[len(exports) // 2]
    facts["fds_10"], facts["allocated_10"], facts["reserved_10"] = samples[9]
    last = count - 1
    facts["fds_last"], facts["allocated_last"], facts["reserved_last"] = samples[last]
    facts["stats"] = fd_server.server_stats().__dict__
    facts["listening"] = _listening()
    return facts


# --------------------------------------------------------------------------- #
# (d): a torch.multiprocessing queue under ipc_fd_sharing
# --------------------------------------------------------------------------- #


def _consumer_queue(queue: Any, answers: Any) -> None:
    out: dict[str, Any] = {"pidfd_getfd": _restrict()}
    torch.zeros(1, device="cuda")
    got: dict[str, Any] = {}
    while True:
        try:
            name, tensor = queue.get(timeout=120)
        except Exception as exc:
            got[f"error_{len(got)}"] = f"{type(exc).__name__}: {exc}"
            continue
        if name == "stop":
            break
        got[name] = {
            "checksum": _checksum(tensor),
            "type": type(tensor).__name__,
            "dtype": str(tensor.dtype),
            "shape": list(tensor.shape),
            "requires_grad": tensor.requires_grad,
        }
        del tensor
    out["got"] = got
    out["open_handles"] = export_module.open_handles()
    answers.put(out)


def queue() -> dict[str, Any]:
    torch.zeros(1, device="cuda")
    q = _ctx.Queue()
    answers = _ctx.Queue()
    consumer = _ctx.Process(target=_consumer_queue, args=(q, answers))
    consumer.start()
    facts: dict[str, Any] = {}
    with hm.expandable_segments(True):
        torch.manual_seed(1)
        flat = torch.randn(16 * MiB, device="cuda").to(torch.bfloat16)
        param = torch.nn.Parameter(torch.randn(1024, 1024, device="cuda"))
    view = flat[12345 : 12345 + 4096 * 16].view(4096, 16)  # odd offset, bf16
    classic = hm.ipc_shareable(torch.randn(4096, device="cuda"))
    sent = {"flat": flat, "view": view, "param": param, "classic": classic}
    facts["sent"] = {k: _checksum(v) for k, v in sent.items()}
    facts["legacy"] = {k: _torch.is_legacy_ipc_capable(v) for k, v in sent.items()}
    with hm.ipc_fd_sharing():
        for name, tensor in sent.items():
            q.put((name, tensor))
        q.put(("stop", None))
        facts["consumer"] = answers.get(timeout=300)
    facts["leases_after"] = _wait_leases(0)
    consumer.join(60)
    facts["consumer_exit"] = consumer.exitcode
    # Outside the scope torch's own reducer is back: the restricted consumer fails.
    consumer2 = _ctx.Process(target=_consumer_queue, args=(q, answers))
    consumer2.start()
    q.put(("plain", flat))
    q.put(("stop", None))
    facts["outside_scope"] = answers.get(timeout=300)
    consumer2.join(60)
    return facts


# --------------------------------------------------------------------------- #
# (f): strangers get nothing
# --------------------------------------------------------------------------- #


def _stranger(address: bytes, token: bytes, as_uid: int | None, answers: Any) -> None:
    from hybridmem._platform import unix_socket

    if as_uid is not None:
        os.setuid(as_uid)
    out: dict[str, Any] = {}
    try:
        sock = unix_socket.connect(address, 10.0)
    except OSError as exc:
        answers.put({"connect": f"{type(exc).__name__}: {exc}"})
        return
    try:
        sock.sendall(fd_server.HELLO + token)
        data, fds = unix_socket.receive_with_fds(sock, 64, 8)
        out.update(data=data.decode(errors="replace"), fds=len(fds))
        unix_socket.close_fds(fds)
    except OSError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        sock.close()
    answers.put(out)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def strangers() -> dict[str, Any]:
    torch.zeros(1, device="cuda")
    records = _Records()
    logging.getLogger("hybridmem").addHandler(records)
    with hm.expandable_segments(True):
        tensor = torch.full((8 * MiB,), 3, dtype=torch.uint8, device="cuda")
    handle = hm.ipc_export(tensor)
    answers = _ctx.Queue()
    facts: dict[str, Any] = {"is_root": os.getuid() == 0}
    cases = {
        "no_token": (b"", None),
        "wrong_token": (os.urandom(32), None),
        "other_uid": (handle.token, 65534 if os.getuid() == 0 else None),
    }
    for name, (token, uid) in cases.items():
        if name == "other_uid" and uid is None:
            facts[name] = "skipped: not root, cannot become another uid"
            continue
        process = _ctx.Process(target=_stranger, args=(handle.address, token, uid, answers))
        process.start()
        facts[name] = answers.get(timeout=60)
        process.join(30)
    facts["still_pending"] = fd_server.server_stats().pending
    # Bound to a pid: the right token from another process is refused.
    bound = hm.ipc_export(tensor, consumer_pid=1)
    process = _ctx.Process(target=_stranger, args=(bound.address, bound.token, None, answers))
    process.start()
    facts["wrong_pid"] = answers.get(timeout=60)
    process.join(30)
    facts["withdrawn"] = bound.withdraw()
    # The real consumer still opens the first export, restricted.
    parent, child = _ctx.Pipe()
    consumer = _ctx.Process(target=_consumer_basic_small, args=(child,))
    consumer.start()
    parent.send(handle)
    facts["consumer"] = parent.recv()
    consumer.join(60)
    # A second open of the same (now used) handle: refused, clearly.
    process = _ctx.Process(target=_open_again, args=(handle, answers))
    process.start()
    facts["second_open"] = answers.get(timeout=60)
    process.join(30)
    facts["listening_after"] = _listening()
    facts["warnings"] = records.messages
    return facts


def _consumer_basic_small(conn: Connection) -> None:
    _restrict()
    torch.zeros(1, device="cuda")
    tensor = conn.recv().open()
    conn.send({"value": int(tensor[0].item()), "numel": tensor.numel()})


def _open_again(handle: Any, answers: Any) -> None:
    torch.zeros(1, device="cuda")
    try:
        handle.open(timeout=10)
        answers.put("opened")
    except Exception as exc:
        answers.put(f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- #
# (e): a WeightBucket in expandable segments, 1 GiB model, restricted consumer
# --------------------------------------------------------------------------- #


def _consumer_bucket(conn: Connection, syncs: int) -> None:
    out: dict[str, Any] = {"pidfd_getfd": _restrict()}
    torch.zeros(1, device="cuda")
    receiver = hm.BucketReceiver(conn.recv())
    weights: dict[str, torch.Tensor] | None = None
    sums: list[dict[str, tuple[int, int]]] = []
    for _ in range(syncs):
        if weights is None:
            weights = {name: t.clone() for name, t in receiver.receive(conn)}
        else:
            for _name, _t in receiver.receive(conn, out=weights):
                pass
        torch.cuda.synchronize()
        sums.append({name: _checksum(t) for name, t in weights.items()})
        out["used_after_" + str(len(sums))] = _used()
    conn.send((out, sums[-1]))
    receiver.close()


def bucket(syncs: int = 5) -> dict[str, Any]:
    from tests.gpu.ipc_scenarios import _model

    torch.zeros(1, device="cuda")
    with hm.expandable_segments(True):
        model = _model(GiB, "cuda")
        with hm.WeightBucket(256 * MiB, transport="fd") as wb:
            facts: dict[str, Any] = {"transport": wb.transport}
            facts["buffers_legacy_ipc"] = [_torch.is_legacy_ipc_capable(v) for v in wb._views]
            parent, child = _ctx.Pipe()
            consumer = _ctx.Process(target=_consumer_bucket, args=(child, syncs))
            consumer.start()
            parent.send(wb.handle)
            reports = []
            for step in range(syncs):
                for tensor in model.values():
                    tensor.add_(1 if step else 0)
                reports.append(wb.send(model, parent))
            out, final = parent.recv()
            consumer.join(120)
    facts["consumer"] = out
    facts["consumer_exit"] = consumer.exitcode
    facts["equal"] = final == {name: _checksum(t) for name, t in model.items()}
    facts["model_bytes"] = sum(t.nbytes for t in model.values())
    facts["gbps"] = [round(r.gbps, 1) for r in reports]
    facts["leases_after"] = _wait_leases(0)
    return facts


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "basic": basic,
    "cycles": cycles,
    "queue": queue,
    "strangers": strangers,
    "bucket": bucket,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
