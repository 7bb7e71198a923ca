"""Two CPU ranks over gloo running a HybridSwitch planned by need; they agree on what moves.

Usage (one process per rank; ``tests/test_ranks_gloo.py`` starts them)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.gloo_planned OUT CASE

Each rank runs the fake seam's device (80 GiB; 77 GiB free once the trainer's cache is
released) and a real Offloader over CPU tensors standing in for device tensors; the
ranks exchange their statuses through ``torch.distributed`` (``barrier="auto"``), as
trainer ranks do. ``CASE``:

- ``agree``: rank 0 lacks nothing, the others lack their optimizer state;
- ``unmeetable``: the last rank needs more than its whole device.

Each rank writes ``OUT/rank<r>.json``: each cycle's outcome, plan and offloaded groups,
what stayed offloaded, and whether every tensor came back bit for bit.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hybridmem as hm
from hybridmem.engine.switch_offload import NEED_MARGIN_BYTES
from tests.conftest import FakeTorch, on_a_gpu, treat_cpu_as_device
from tests.gloo_teardown import leave_group
from tests.test_offload import make_model, snapshot
from tests.test_switch import FakeVLLM
from tests.test_switch_need import FREE

GiB = 1 << 30
CYCLES = 2


def need_of(case: str, rank: int, world: int, optimizer_bytes: int) -> int:
    """This rank's rollout need in ``case`` (see the module)."""
    fits = FREE - NEED_MARGIN_BYTES  # exactly what is free: nothing is short
    if case == "agree":
        return fits if rank == 0 else fits + optimizer_bytes
    if case == "unmeetable":
        return FREE + GiB if rank == world - 1 else fits
    raise SystemExit(f"unknown case {case!r}: agree or unmeetable")


def main(out: Path, case: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    patches = pytest.MonkeyPatch()
    fake = on_a_gpu(FakeTorch())
    fake.install(patches)
    treat_cpu_as_device()
    model, optimizer = make_model()
    offloader = hm.Offloader(model, optimizer)
    optimizer_bytes = sum(size for group, size in offloader.resident() if group == "optimizer")
    switch = hm.HybridSwitch(
        hm.VLLMEngine(FakeVLLM([], fake)),
        hm.BackendProfile("plain", "no allocator steps", {}),
        offloader,
        sync_weights=lambda adapter: None,
        confirm_timeout_s=0.0,
        rollout_need=need_of(case, rank, world, optimizer_bytes),
    )
    before = snapshot(model, optimizer)
    cycles: list[dict[str, Any]] = []
    for _ in range(CYCLES):
        row: dict[str, Any] = {"groups": None}
        try:
            with switch.rollout():
                row["groups"] = sorted(offloader.offloaded_groups)
            row["outcome"] = "ok"
        except hm.HybridSwitchError as exc:
            row["outcome"] = f"HybridSwitchError: {exc}"
        plan = switch.plan
        row["plan"] = None if plan is None else {"deficit": plan.deficit, "moved": plan.moved}
        cycles.append(row)
    after = snapshot(model, optimizer)
    result = {
        "optimizer_bytes": optimizer_bytes,
        "cycles": cycles,
        "left": sorted(offloader.offloaded_groups),
        "bitwise": len(before) == len(after)
        and all(torch.equal(a, b) for a, b in zip(before, after)),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    patches.undo()
    leave_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
