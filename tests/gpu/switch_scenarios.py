"""HybridSwitch on real GPUs with a two-process toy engine (``spawn`` processes).

Usage: ``python -m tests.gpu.switch_scenarios NAME``; the last line printed is a
JSON object of facts. The toy engine runs in its own process, denied
``pidfd_getfd`` by a seccomp filter; it holds weights and a KV cache sized from
device free memory, in torch_memory_saver regions paused when it sleeps and
resumed when it wakes, as SGLang's memory saver does (``toy_engine``), or by hand
where torch_memory_saver is missing (``handmade_engine``), and is driven through
``hm.SGLangEngine`` over a pipe.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as tmp

import hybridmem as hm
from hybridmem import _torch
from hybridmem.engine.reports import SwitchReport
from hybridmem.memory.offload import OffloadInFlight, OffloadReport
from tests.gpu.runner import off_the_median, window_drift

MiB = 1 << 20
_ctx = tmp.get_context("spawn")
KV_FRACTION = 0.4
# Longer than what the fast rank needs from its offload to its KV wake-up (~0.5 s of
# releases and weight sync here), so that without barriers it would wake too early.
SLOW_OFFLOAD_S = 1.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048)
    ).cuda()


def _engine(conn: Connection, device: int, kv_fraction: float, kind: str) -> None:
    """The toy rollout engine: sleeps (frees) and wakes (takes back) weights and KV cache."""
    from hybridmem.bench.engine_memory import make_engine_memory
    from tests.seccomp import deny_pidfd_getfd

    deny_pidfd_getfd()
    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")
    receiver: hm.BucketReceiver | None = None
    template = {k: v.detach() for k, v in _model().state_dict().items()}
    shapes = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in template.items()}
    del template
    torch.cuda.empty_cache()
    memory = make_engine_memory(kind, shapes, 0, device)
    checks: list[float] = []
    while True:
        command = conn.recv()
        kind = command[0]
        if kind == "stop":
            conn.send(("checks", checks, memory.name))
            break
        if kind == "handle":
            receiver = hm.BucketReceiver(command[1])
            conn.send(("ok",))
        elif kind == "resume":
            tags = command[1] or ["weights", "kv_cache"]
            if "kv_cache" in tags and not memory.kv_target:
                # sized once, from what the trainer handed back (whole GiB)
                memory.kv_target = int(torch.cuda.mem_get_info()[0] * kv_fraction)
            memory.wake(list(tags))
            conn.send(("ok",))
        elif kind == "release":
            memory.sleep()
            # what this process's allocator still holds asleep: says whose memory a
            # boundary that is off its median was (issue #25's pass 2)
            conn.send(("ok", torch.cuda.memory_reserved()))
        elif kind == "sync":
            assert receiver is not None
            assert memory.weights is not None
            for _ in receiver.receive(conn, out=memory.weights):
                pass
            conn.send(("ok",))
        elif kind == "generate":
            weights, kv = memory.weights, memory.kv
            assert weights is not None
            assert kv is not None
            x = torch.randn(64, 2048, device="cuda")
            y = torch.nn.functional.gelu(x @ weights["0.weight"].t()) @ weights["2.weight"].t()
            kv[: 1 << 20].fill_(1)
            checks.append(float(weights["0.weight"].double().sum()))
            del weights, kv  # no reference left in this frame through the next sleep
            conn.send(("ok", float(y.abs().mean())))


class ToyEngineClient:
    """The trainer's handle on the engine process, with SGLang's method names."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.reserved_asleep: list[int] = []  # the engine's reserved bytes after each sleep

    def _call(self, *command: Any) -> Any:
        self.conn.send(command)
        answer = self.conn.recv()
        if answer[0] != "ok":
            raise RuntimeError(f"engine answered {answer!r}")
        return answer

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.reserved_asleep.append(int(self._call("release")[1]))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("resume", tags)

    def generate(self) -> float:
        return float(self._call("generate")[1])


class SlowOffloader(hm.Offloader):
    """An offloader whose offload takes ``delay`` seconds longer, on purpose.

    The delay is in the flight's ``finish``: ``offload()`` is
    ``start_offload().finish()``, and the switch that runs the engine's weights under
    the copies finishes in its ``offload_land`` stage (decision 86), so both are slow.
    """

    delay = 0.0

    def start_offload(self, *args: Any, **kwargs: Any) -> OffloadInFlight:
        flight = super().start_offload(*args, **kwargs)
        finish = flight.finish

        def slow_finish() -> OffloadReport:
            report = finish()
            time.sleep(self.delay)
            return report

        setattr(flight, "finish", slow_finish)  # noqa: B010 (a method replaced on purpose)
        return flight


def _cycles(
    cycles: int,
    device: int,
    *,
    barrier: Any = "auto",
    delay: float = 0.0,
    engine: str = "handmade",
    reload_early: bool | None = None,
    kv_under_offload: bool | None = None,
) -> dict[str, Any]:
    """Run ``cycles`` train/rollout cycles against a toy engine on ``device``.

    ``reload_early``, ``kv_under_offload`` None keep the switch's defaults.
    """
    early: dict[str, Any] = {} if reload_early is None else {"reload_early": reload_early}
    if kv_under_offload is not None:
        early["kv_under_offload"] = kv_under_offload
    from hybridmem.bench.engine_memory import preload_env

    torch.cuda.set_device(device)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    conn, child = _ctx.Pipe()
    engine_process = _ctx.Process(target=_engine, args=(child, device, KV_FRACTION, engine))
    with preload_env(engine):  # SGLang's engine runs with TMS's LD_PRELOAD
        engine_process.start()
    client = ToyEngineClient(conn)
    bucket = hm.WeightBucket(16 * MiB, device)
    client._call("handle", bucket.handle)

    def sync_weights(adapter: hm.EngineAdapter) -> None:
        conn.send(("sync",))
        bucket.send(model.state_dict(), conn)
        assert conn.recv() == ("ok",)

    # The trainer state that leaves the device: optimizer state and gradients; the
    # parameters stay for the weight sync (as in verl's FSDP sharding managers).
    offloader = SlowOffloader(optimizer, grads="drop")
    offloader.delay = delay
    switch = hm.HybridSwitch(
        hm.SGLangEngine(client),
        "sglang",
        offloader,
        sync_weights=sync_weights,
        barrier=barrier,
        device=device,
        **early,
    )
    sums: list[float] = []
    boundaries: list[dict[str, int]] = []
    trainer_reserved: list[dict[str, int]] = []  # this process's share of each boundary
    for _ in range(cycles):
        with hm.phase("train", backend="sglang"):
            for _ in range(3):
                x = torch.randn(int(torch.randint(16, 128, ()).item()), 2048, device="cuda")
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        first = model.get_parameter("0.weight")
        sums.append(float(first.detach().double().sum()))
        if _torch.dist_initialized():
            # Ranks start each switch together, so that only the switch's own barriers
            # decide who may wake the KV cache when (the control runs without them).
            _torch.dist_barrier()
        with switch.rollout():
            client.generate()
        # Keyed by direction too: both directions have a "release" stage.
        stages = [
            (f"{report.direction}:{stage.name}", stage)
            for report in switch.reports[-2:]  # to rollout, to trainer
            for stage in report.stages
        ]
        boundaries.append({key: int(stage.free_after or 0) for key, stage in stages})
        trainer_reserved.append({key: int(stage.reserved_after or 0) for key, stage in stages})
    # Reloaded where it trains (decision 85): the train recipe's expandable segments,
    # not the classic ones this process runs in between phases.
    state = [
        t
        for per in optimizer.state.values()
        for t in per.values()
        if torch.is_tensor(t) and t.is_cuda
    ]
    state_expandable = [not _torch.is_legacy_ipc_capable(t) for t in state]
    client.conn.send(("stop",))
    _, checks, engine_name = conn.recv()
    engine_process.join(timeout=60)
    bucket.close()
    reports = [
        {
            # offload_land frees where the weights ran under the copies (decision 86),
            # offload_land_late where the KV cache did too (decision 89)
            "offload_end": _end(r, "offload_land_late" if _kv_under(r) else "offload_land"),
            "wake_kv_start": r.stage("wake_kv").started,
            # The weights ran under the offload's copies (decision 86): the offload
            # stage freed nothing and a landing stage freed the state.
            "weights_under": _freed(r, "offload") < 16 * MiB
            and _freed(r, "offload_land") + _freed(r, "offload_land_late") >= 64 * MiB,
            "kv_under": _kv_under(r),
        }
        for r in switch.reports
        if r.direction == "to_rollout"
    ]
    last = switch.reports[-2:]
    return {
        "boundaries": boundaries,
        "trainer_reserved": trainer_reserved,
        "engine_reserved_asleep": client.reserved_asleep,
        "weights_match": [abs(a - b) < 1e-6 * max(1.0, abs(a)) for a, b in zip(sums, checks)],
        "engine_exit": engine_process.exitcode,
        "times": reports,
        "last": [str(r) for r in last],
        "rank": switch.rank,
        "engine": engine_name,
        "state_expandable": state_expandable,
    }


def _freed(report: SwitchReport, stage: str) -> int:
    """Device free memory a stage of ``report`` gained (0 where not measured)."""
    measured = report.stage(stage)
    return int(measured.free_after or 0) - int(measured.free_before or 0)


def _end(report: SwitchReport, stage: str) -> float:
    measured = report.stage(stage)
    return measured.started + measured.seconds


def _kv_under(report: SwitchReport) -> bool:
    """The KV cache woke under the copies (decision 89): they landed after its wake."""
    late = _freed(report, "offload_land_late")
    return _freed(report, "offload_land") < 16 * MiB and late >= 64 * MiB


def _fifty(engine: str, cycles: int = 50, reload_early: bool | None = None) -> dict[str, Any]:
    """50 cycles on one GPU: phase-boundary free memory stable, weights arrive intact."""
    facts = _cycles(cycles, 0, engine=engine, reload_early=reload_early)
    boundaries = facts.pop("boundaries")
    later = boundaries[1:]  # after the first cycle's one-time allocations
    # Whose memory a boundary off its median was: the trainer's allocator (its
    # reserved bytes off too), the engine's (its reserved bytes asleep), or neither.
    reserved = facts.pop("trainer_reserved")[1:]
    asleep = facts.pop("engine_reserved_asleep")
    spread = {
        stage: max(b[stage] for b in later) - min(b[stage] for b in later) for stage in later[0]
    }
    last: dict[str, int] = boundaries[-1]
    mine: dict[str, int] = reserved[-1]

    def gained(first: str, then: str) -> int:
        # Device free memory gained from one boundary to the next, less what this
        # process's allocator itself gave back or took meanwhile: the sleep stage may
        # release the trainer's cache, and an early reload (reload_early) allocates
        # the trainer state before the engine sleeps. What remains is the engine's.
        return (last[then] - last[first]) + (mine[then] - mine[first])

    facts.update(
        cycles=cycles,
        drift_bytes=window_drift(later, window=10),  # cycles 2-11 -> the last ten
        spread_bytes=spread,
        # cycle (1-based), stage, MiB off that stage's median: said, not asserted
        off_the_median=[
            (index + 2, stage, off / MiB) for index, stage, off in off_the_median(later, 16 * MiB)
        ],
        trainer_reserved_off=[
            (index + 2, stage, off / MiB)
            for index, stage, off in off_the_median(reserved, 16 * MiB)
        ],
        engine_reserved_asleep_mib=sorted({round(b / MiB, 1) for b in asleep}),
        kv_taken=last["to_rollout:barrier_kv"] - last["to_rollout:wake_kv"],
        handed_back=gained("to_rollout:rollout", "to_trainer:sleep"),
        trainer_reserved_change=mine["to_trainer:sleep"] - mine["to_rollout:rollout"],
        free_after_reload=[b["to_trainer:reload"] for b in boundaries[::10]],
    )
    return facts


def toy_engine() -> dict[str, Any]:
    """The engine's weights and KV cache in torch_memory_saver regions (preload mode).

    The switch's default reload (queued before the engine's sleep: room is there).
    """
    return _fifty("tms")


def handmade_engine() -> dict[str, Any]:
    """The fallback where torch_memory_saver is missing: tensors freed and made again.

    The reload after the engine's sleep (``reload_early=False``), so that both of the
    switch's reload paths run fifty cycles on the GPU.
    """
    return _fifty("handmade", reload_early=False)


def _rank(rank: int, world: int, port: int, cycles: int, out: str, use_barrier: bool) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    try:
        facts = _cycles(
            cycles,
            rank,
            barrier="auto" if use_barrier else None,
            delay=SLOW_OFFLOAD_S if rank == 1 else 0.0,
            # The barrier's own guarantee: every rank's copies land before any KV wake.
            # With room, decision 89 wakes it under them (tests/test_switch_offload.py).
            kv_under_offload=False,
        )
        facts.pop("boundaries")
        facts.pop("trainer_reserved")
        Path(out, f"rank{rank}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()


def _ranks(cycles: int, use_barrier: bool, port: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        spawn: Any = importlib.import_module("torch.multiprocessing").spawn  # untyped
        spawn(_rank, args=(2, port, cycles, out, use_barrier), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    violations = []
    margins = []
    for cycle in range(cycles):
        offload_done = max(r["times"][cycle]["offload_end"] for r in ranks)
        first_kv = min(r["times"][cycle]["wake_kv_start"] for r in ranks)
        margins.append(first_kv - offload_done)
        if first_kv < offload_done:
            violations.append(cycle)
    return {
        "cycles": cycles,
        "violations": violations,
        "min_margin_s": min(margins),
        "ranks": [r["rank"] for r in ranks],
        "weights_match": all(all(r["weights_match"]) for r in ranks),
        "engine_exit": [r["engine_exit"] for r in ranks],
    }


def ranks() -> dict[str, Any]:
    """Two NCCL ranks, one slow to offload: no rank wakes its KV cache before it is done."""
    with_barrier = _ranks(20, True, 29541)
    control = _ranks(3, False, 29542)  # the same without a barrier: the test can fail
    return {"with_barrier": with_barrier, "without_barrier": control}


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "toy_engine": toy_engine,
    "handmade_engine": handmade_engine,
    "ranks": ranks,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
