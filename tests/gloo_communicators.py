"""CPU ranks over gloo entering hm.suspend_communicators with a stand-in NCCL; one misbehaves.

Usage (one process per rank; ``tests/test_communicators_ranks.py`` starts them)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python -m tests.gloo_communicators OUT CASE

``CASE`` is ``all`` (every rank suspends and resumes, twice), ``old:R`` (rank R's NCCL
has no suspend), ``fail_suspend:R`` / ``fail_resume:R`` (rank R's NCCL call fails after
NCCL's barrier), ``absent:R`` (rank R never enters the scope) or ``dies:R`` (rank R
dies inside the block). Each rank writes what it saw to ``OUT/rank<r>.json``; the
stand-in waits in the store as NCCL's bootstrap barrier does, so a rank calling NCCL
without its peers would hang there.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hybridmem as hm
from tests.nccl_standin import StandInNccl, as_nccl

TIMEOUT_S = 3.0  # the scope's wait for absent ranks: short, so the test is quick


def main(out: Path, case: str) -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    kind, _, who = case.partition(":")
    target = int(who) if who else -1
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    sub = dist.new_group(list(range(world)))
    assert isinstance(sub, dist.ProcessGroup)
    store = dist.distributed_c10d._get_default_store()
    nccl = StandInNccl(store=store, rank=rank)
    if kind == "old" and rank == target:
        nccl = StandInNccl(version=22809, has_suspend=False, store=store, rank=rank)
    patch = pytest.MonkeyPatch()
    pointers = as_nccl(patch, nccl, [sub])
    mine = pointers[id(sub)]
    if rank == target and kind == "fail_suspend":
        nccl.fail_suspend.add(mine)
    if rank == target and kind == "fail_resume":
        nccl.fail_resume.add(mine)
    seen: dict[str, Any] = {"rank": rank, "events": []}

    def note(event: str, **extra: Any) -> None:
        seen["events"].append({"event": event, **extra})

    def save() -> None:
        seen["suspended_at_end"] = sorted(nccl.suspended)
        seen["calls"] = nccl.calls
        (out / f"rank{rank}.json").write_text(json.dumps(seen))

    rounds = 2 if kind == "all" else 1
    for n in range(rounds):
        if kind == "absent" and rank == target:
            note("stayed away")
            break
        started = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with hm.suspend_communicators(sub, timeout_s=TIMEOUT_S) as scope:
                    note("inside", round=n, suspended=sorted(nccl.suspended))
                    if kind == "dies" and rank == target:
                        save()
                        os._exit(3)
            note(
                "left",
                round=n,
                report=str(scope.report),
                warnings=[str(w.message) for w in caught],
            )
        except hm.CommunicatorError as exc:
            note(
                "error",
                round=n,
                message=str(exc),
                suspended_ranks=list(exc.suspended_ranks),
                seconds=time.perf_counter() - started,
            )
    if kind == "all":
        t = torch.ones(2)
        dist.all_reduce(t, group=sub)
        note("all_reduce after", value=t.tolist())
    save()
    # rank 0 hosts the store: it stays until every rank that lives is done with it
    store.set(f"done/{rank}", "1")
    if rank == 0:
        alive = [r for r in range(world) if not (kind == "dies" and r == target)]
        store.wait([f"done/{r}" for r in alive], datetime.timedelta(seconds=60))
    if kind in ("all", "old"):
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the other cases leave peers or communicators behind: no teardown


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
