"""verl's drop-in, opt-in: trainer communicators suspended from the KV wake to the next collective.

Held to verl 0.9.1's own ``ActorRolloutRefWorker.update_weights`` (read from its wheel
with ``ast``): every trainer rank meets at a ``torch.distributed`` barrier, then wakes
the KV cache with ``self.rollout.resume(tags=["kv_cache"])``, and makes no collective
after it; then run on one CPU rank whose gloo groups the seam takes for NCCL's
(:mod:`tests.nccl_standin`).
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hybridmem import _log
from hybridmem.integrations.verl import communicators
from hybridmem.scopes.communicators import held_communicators
from tests import wheels
from tests.nccl_standin import StandInNccl, as_nccl

WORKERS = "verl/workers/engine_workers.py"


def _update_weights() -> ast.AsyncFunctionDef:
    found = wheels.read_source("verl", WORKERS)
    if found is None:
        if wheels.required("verl"):
            pytest.fail(wheels.missing_reason("verl"))
        pytest.skip(wheels.missing_reason("verl"))
    for node in ast.walk(ast.parse(found[0])):
        if isinstance(node, ast.ClassDef) and node.name == "ActorRolloutRefWorker":
            for item in node.body:
                if isinstance(item, ast.AsyncFunctionDef) and item.name == "update_weights":
                    return item
    raise AssertionError("ActorRolloutRefWorker.update_weights not found in verl's wheel")


def _calls(method: ast.AsyncFunctionDef) -> list[str]:
    """The calls the method makes, in source order, as source text."""
    calls = [n for n in ast.walk(method) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [ast.unparse(c) for c in calls]


def test_verls_kv_wake_comes_after_its_barrier_and_before_no_collective() -> None:
    calls = _calls(_update_weights())
    kv = [i for i, c in enumerate(calls) if c == "self.rollout.resume(tags=['kv_cache'])"]
    assert len(kv) == 1, calls  # the one KV wake the drop-in suspends before
    barrier = [i for i, c in enumerate(calls) if "torch.distributed.barrier" in c]
    assert barrier, calls
    assert max(barrier) < kv[0]  # every rank has met before it
    after = calls[kv[0] + 1 :]
    assert not [c for c in after if "torch.distributed" in c or "dist." in c], after


@pytest.fixture
def world(tmp_path: Path) -> Iterator[list[Any]]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    _log.reset_once()
    try:
        yield [dist.group.WORLD, dist.new_group([0])]
    finally:
        dist.destroy_process_group()


def _run(update: Callable[..., Awaitable[str]], worker: Worker) -> str:
    async def main() -> str:
        return await update(worker)

    return asyncio.run(main())


class Rollout:
    def __init__(self, nccl: StandInNccl) -> None:
        self.nccl = nccl
        self.seen: list[tuple[list[str], int]] = []

    async def resume(self, tags: list[str]) -> None:
        self.seen.append((tags, len(self.nccl.suspended)))


class Worker:
    """verl's method as far as the drop-in goes: weights, barrier, KV wake."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    async def update_weights(self, global_steps: int | None = None) -> str:
        await self.rollout.resume(tags=["weights"])
        await asyncio.to_thread(dist.barrier)
        await self.rollout.resume(tags=["kv_cache"])
        return "synced"


@pytest.fixture
def nccl(world: list[Any], monkeypatch: pytest.MonkeyPatch) -> StandInNccl:
    """The world's groups taken for NCCL's, over the stand-in."""
    standin = StandInNccl()
    as_nccl(monkeypatch, standin, world)
    return standin


def test_suspended_at_the_kv_wake_and_resumed_by_the_next_collective(
    world: list[Any], nccl: StandInNccl
) -> None:
    rollout = Rollout(nccl)
    update = communicators.suspends_through_rollout(Worker.update_weights)
    assert communicators.suspends_through_rollout(update) is update  # once
    assert _run(update, Worker(rollout)) == "synced"
    # the weights woke with the communicators held; the KV cache into what they gave back
    assert rollout.seen == [(["weights"], 0), (["kv_cache"], 2)]
    assert "resume" not in vars(rollout)  # the rollout's own method is back
    assert len(nccl.suspended) == 2  # through the rollout
    t = torch.ones(2)
    dist.all_reduce(t, group=world[1])  # the next step's first collective
    assert nccl.suspended == set()
    assert not held_communicators()


def test_a_step_that_starts_with_update_weights_resumes_first(nccl: StandInNccl) -> None:
    rollout = Rollout(nccl)
    update = communicators.suspends_through_rollout(Worker.update_weights)
    _run(update, Worker(rollout))
    _run(update, Worker(rollout))  # no collective between: resumed at its start
    assert [n for _, n in rollout.seen] == [0, 2, 0, 2]
    assert [c for c, _ in nccl.calls] == ["suspend"] * 2 + ["resume"] * 2 + ["suspend"] * 2
    asyncio.run(_resume_all())
    assert nccl.suspended == set()


async def _resume_all() -> None:
    from hybridmem.scopes.comm_pending import resume_communicators

    await asyncio.to_thread(resume_communicators)
