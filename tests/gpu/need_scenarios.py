"""A switch planned by need, under real faults, on a real GPU: the part that moved comes back.

Usage: ``python -m tests.gpu.need_scenarios NAME``; the last line printed is a JSON
object of facts. The two-process toy engine of :mod:`tests.gpu.switch_scenarios`
(hand-made memory, denied ``pidfd_getfd``) behind ``hm.SGLangEngine``; the trainer's
switch is told a rollout need that leaves about half of its optimizer state short, so
every offload here is partial. The CPU tests inject the same faults through the fake
seam (``tests/test_switch_need.py``); here the bytes are the device's own.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

import hybridmem as hm
from hybridmem.engine.switch_offload import NEED_MARGIN_BYTES
from tests.gpu.scenarios import _state
from tests.gpu.switch_scenarios import KV_FRACTION, ToyEngineClient, _ctx, _engine, _model

MiB = 1 << 20


class FailingEngine(ToyEngineClient):
    """The engine's KV wake fails when asked to (``fail_kv``), as an OOM in it would."""

    fail_kv = False

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        if self.fail_kv and tags and "kv_cache" in tags:
            self.fail_kv = False
            raise RuntimeError("the engine could not take its KV cache (injected)")
        super().resume_memory_occupation(tags)


class TakenOffloader(hm.Offloader):
    """Its next reload finds the device taken (``take_next``): all but a quarter of the pool."""

    take_next = False
    hog: torch.Tensor | None = None

    def reload(self, *args: Any, **kwargs: Any) -> Any:
        if self.take_next:
            self.take_next = False
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            room = free - self.host_bytes // 4
            self.hog = torch.empty(room, dtype=torch.uint8, device="cuda")
        return super().reload(*args, **kwargs)


def _same(reference: list[torch.Tensor], now: list[torch.Tensor]) -> bool:
    """Bit for bit, and every tensor back on the device."""
    return len(reference) == len(now) and all(
        t.is_cuda and torch.equal(r, t.cpu()) for r, t in zip(reference, now)
    )


def partial_plan_faults() -> dict[str, Any]:
    """A partial plan, then its KV wake failing, then its reload out of memory, then a cycle."""
    torch.cuda.set_device(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    conn, child = _ctx.Pipe()
    process = _ctx.Process(target=_engine, args=(child, 0, KV_FRACTION, "handmade"))
    process.start()
    engine = FailingEngine(conn)
    bucket = hm.WeightBucket(16 * MiB, 0)
    engine._call("handle", bucket.handle)

    def sync_weights(adapter: hm.EngineAdapter) -> None:
        conn.send(("sync",))
        bucket.send(model.state_dict(), conn)
        assert conn.recv() == ("ok",)

    def train() -> None:
        with hm.phase("train", backend="sglang"):
            x = torch.randn(64, 2048, device="cuda")
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    train()
    optimizer_bytes = sum(
        v.nbytes for state in optimizer.state.values() for v in state.values() if v.is_cuda
    )

    def need() -> int:  # about half of the optimizer state short of what is free now
        return int(torch.cuda.mem_get_info()[0] + optimizer_bytes // 2 - NEED_MARGIN_BYTES)

    offloader = TakenOffloader(optimizer, grads="drop")
    switch = hm.HybridSwitch(
        hm.SGLangEngine(engine),
        "sglang",
        offloader,
        sync_weights=sync_weights,
        reload_early=False,  # the reload after the sleep: where the device is taken
        rollout_need=need,
        device=0,
    )
    facts: dict[str, Any] = {"optimizer_bytes": optimizer_bytes}

    # 1. The engine's KV wake fails after the partial offload: back to the trainer.
    train()
    reference = [t.cpu().clone() for t in _state(model, optimizer)]
    engine.fail_kv = True
    try:
        with switch.rollout():
            engine.generate()
        facts["kv_fault"] = "no error"
    except Exception as exc:  # what the user sees
        facts["kv_fault"] = f"{type(exc).__name__}: {exc}"
    plan = switch.plan
    facts["kv_fault_moved"] = plan.nbytes if plan is not None else None
    facts["kv_fault_offloaded"] = sorted(offloader.offloaded_groups)
    facts["kv_fault_intact"] = _same(reference, _state(model, optimizer))

    # 2. The reload finds the device taken: an error saying what stays on the host,
    # then, the memory given back, a reload of exactly what had moved.
    train()
    reference = [t.cpu().clone() for t in _state(model, optimizer)]
    try:
        with switch.rollout():
            engine.generate()
            offloader.take_next = True
        facts["reload_fault"] = "no error"
    except Exception as exc:
        facts["reload_fault"] = f"{type(exc).__name__}: {exc}"
    plan = switch.plan
    facts["reload_fault_moved"] = plan.nbytes if plan is not None else None
    facts["reload_fault_offloaded"] = sorted(offloader.offloaded_groups)
    offloader.hog = None
    torch.cuda.empty_cache()
    offloader.reload()
    facts["reload_fault_intact"] = _same(reference, _state(model, optimizer))

    # 3. The switch works again, partial as before, and the engine sees the weights.
    train()
    reference = [t.cpu().clone() for t in _state(model, optimizer)]
    with switch.rollout():
        engine.generate()
    plan = switch.plan
    facts["after_moved"] = plan.nbytes if plan is not None else None
    facts["after_intact"] = _same(reference, _state(model, optimizer))
    facts["after_report"] = [str(r) for r in switch.reports[-2:]]
    engine.conn.send(("stop",))
    _, checks, _ = conn.recv()
    process.join(timeout=60)
    first = float(model.get_parameter("0.weight").detach().double().sum())
    facts["engine_saw_the_weights"] = bool(checks) and abs(checks[-1] - first) < 1e-6 * max(
        1.0, abs(first)
    )
    facts["engine_exit"] = process.exitcode
    bucket.close()
    return facts


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "partial_plan_faults": partial_plan_faults,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
