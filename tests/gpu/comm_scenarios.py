"""torch's own NCCL process groups on a GPU, suspended and resumed; one scenario per interpreter.

Usage: ``python -m tests.gpu.comm_scenarios NAME``; the last line printed is a JSON
object of facts. ``measure`` runs ``benchmarks/communicators.py``'s measurement (the
default group and four subgroups of one rank, 100 cycles); under an NCCL with suspend
(``LD_PRELOAD`` of a ``libnccl.so.2`` 2.29.7+, which the test passes) it suspends, and
under torch's stock NCCL it says so once.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "communicators.py"


def measure() -> dict[str, Any]:
    """benchmarks/communicators.py's measurement: five groups, 100 cycles."""
    spec = importlib.util.spec_from_file_location("hm_bench_communicators", _SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    facts: dict[str, Any] = script.measure(5, 100)
    return facts


def left_to_its_owner() -> dict[str, Any]:
    """A communicator suspended by someone else (vLLM's enable_nccl_comm_suspend): left to it."""
    import os

    import torch
    import torch.distributed as dist

    import hybridmem as hm
    from hybridmem import _torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29777")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    other = dist.new_group([0])
    assert isinstance(other, dist.ProcessGroup)
    dist.all_reduce(torch.ones(1, device=device), group=other)
    entry = next(e for e in _torch.group_communicators() if e.group is other)
    nccl = _torch.nccl_calls()
    assert nccl is not None
    assert nccl.has_suspend
    nccl.suspend(entry.pointer)  # the other owner's suspend, straight through NCCL
    with hm.suspend_communicators() as scope:
        pass
    still = hm.communicator_memory()
    nccl.resume(entry.pointer)  # the owner resumes its own
    t = torch.ones(4, device=device)
    dist.all_reduce(t, group=other)
    report = scope.report
    dist.destroy_process_group()
    return {
        "suspended": [] if report is None else report.suspended,
        "skipped": {} if report is None else report.skipped,
        "other_still_suspended": next(c.suspended for c in still if c.group == entry.name),
        "after_owner_resumed": t.tolist(),
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "measure": measure,
    "left_to_its_owner": left_to_its_owner,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
