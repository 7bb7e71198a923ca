"""What NCCL communicators hold through a rollout, and what hm.suspend_communicators gives back.

A colocated trainer keeps one NCCL communicator per process group (a Megatron rank:
its data-, tensor-, pipeline-, context- and expert-parallel groups) whose buffers stay
on the device while the rollout engine runs. This script makes torch's own process
groups as such a rank does: the default group and ``--groups - 1`` subgroups (of one
rank on a one-GPU machine), each with its communicator made by a first all-reduce,
then measures in the same run:

- what each communicator holds (``ncclCommMemStats``: suspendable, persistent, total)
  and what device free memory says they took;
- the hand-back to a rollout, as the bench reads it (device free / device total), with
  the communicators held against suspended by ``hm.suspend_communicators()``;
- the share of NCCL's suspendable bytes that came back as device free memory (target
  >= 0.95);
- each suspend and each resume over ``--cycles`` cycles (milliseconds), and device free
  memory after every cycle (drift: the median of the last ten readings minus the first
  ten's; target 0);
- that a collective on each group after the cycles gives the bytes it gave before.

It needs an NCCL with ``ncclCommSuspend`` (2.29.7+): torch 2.12+ built with one, or a
newer ``libnccl.so.2`` preloaded under torch's own (``benchmarks/build_nccl.sh`` builds
one from NVIDIA/nccl's source)::

    LD_PRELOAD=/path/libnccl.so.2 python benchmarks/communicators.py --json out.json

With torch's stock NCCL 2.28 it prints what the groups hold (as far as device free
memory says) and the one line hybridmem says, and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import hybridmem as hm
from hybridmem import _torch
from hybridmem.observe.communicators import describe_communicators

MiB = 1 << 20
GIVEN_BACK_TARGET = 0.95


def _free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _checksums(groups: list[Any], data: torch.Tensor) -> list[str]:
    """Each group's all-reduce of ``data``: a SHA-256 of the result's bytes."""
    out = []
    for group in groups:
        x = data.clone()
        dist.all_reduce(x, group=group)
        out.append(hashlib.sha256(x.view(torch.uint8).cpu().numpy().tobytes()).hexdigest())
    return out


def measure(n_groups: int = 5, cycles: int = 100) -> dict[str, Any]:
    """Make the groups, read them, suspend and resume ``cycles`` times; return the facts."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    free_start = _free()
    total = int(torch.cuda.mem_get_info()[1])
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    groups: list[Any] = [dist.group.WORLD] + [dist.new_group([0]) for _ in range(n_groups - 1)]
    data = torch.randn(1 << 20, device=device, dtype=torch.float32)
    before = _checksums(groups, data)
    free_held = _free()
    found = hm.communicator_memory()
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "nccl": _torch.nccl_version(),
        "device": torch.cuda.get_device_name(device),
        "groups": n_groups,
        "held_by_groups": free_start - free_held,
        "communicators": [c.as_dict() for c in found],
        "lines": describe_communicators(found),
        "handback_held": free_held / total,
    }
    suspendable = sum(c.suspendable or 0 for c in found)
    facts["suspendable"] = suspendable
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with hm.suspend_communicators() as scope:
            free_suspended = _free()
            try:
                dist.all_reduce(data.clone(), group=groups[1])
                facts["collective_inside"] = "ran"
            except hm.CommunicatorSuspendedError as exc:
                facts["collective_inside"] = f"refused: {str(exc)[:120]}"
    facts["warnings"] = [str(w.message) for w in said]
    report = scope.report
    facts["report"] = str(report)
    if report is None or not report.suspended:
        facts["supported"] = False
        return facts
    facts["supported"] = True
    facts["handback_suspended"] = free_suspended / total
    facts["freed"] = free_suspended - free_held
    facts["given_back_share"] = (free_suspended - free_held) / suspendable if suspendable else None
    suspend_ms, resume_ms, free_after = [], [], []
    for _ in range(cycles):
        t0 = time.perf_counter()
        scope = hm.suspend_communicators()
        scope.__enter__()
        t1 = time.perf_counter()
        scope.__exit__(None, None, None)
        t2 = time.perf_counter()
        suspend_ms.append((t1 - t0) * 1e3)
        resume_ms.append((t2 - t1) * 1e3)
        free_after.append(_free())
    facts["suspend_ms"] = {"median": statistics.median(suspend_ms), "max": max(suspend_ms)}
    facts["resume_ms"] = {"median": statistics.median(resume_ms), "max": max(resume_ms)}
    window = min(10, len(free_after) // 2)
    facts["drift"] = (
        statistics.median_low(free_after[-window:]) - statistics.median_low(free_after[:window])
        if window
        else 0
    )
    facts["free_spread"] = max(free_after) - min(free_after)
    facts["bit_exact"] = _checksums(groups, data) == before
    dist.destroy_process_group()
    return facts


def report(facts: dict[str, Any]) -> str:
    """The facts as the lines this script prints."""
    lines = [
        f"{facts['device']}, torch {facts['torch']}, NCCL {facts['nccl']}: "
        f"{facts['groups']} groups took {facts['held_by_groups'] / MiB:.0f} MiB of device memory",
        *facts["lines"],
    ]
    if not facts["supported"]:
        lines += [f"hybridmem said: {w}" for w in facts["warnings"]]
        return "\n".join(lines)
    share = facts["given_back_share"]
    lines += [
        f"suspendable (ncclCommMemStats) {facts['suspendable'] / MiB:.0f} MiB; device free "
        f"gained {facts['freed'] / MiB:.0f} MiB: {share:.4f} of it "
        f"(target >= {GIVEN_BACK_TARGET}) {'ok' if share >= GIVEN_BACK_TARGET else 'MISSED'}",
        f"hand-back to the rollout: {facts['handback_held']:.4f} held, "
        f"{facts['handback_suspended']:.4f} suspended",
        "suspend {median:.2f} ms median ({max:.2f} max), ".format(**facts["suspend_ms"])
        + "resume {median:.2f} ms median ({max:.2f} max)".format(**facts["resume_ms"]),
        f"free memory drift over the cycles {facts['drift'] / MiB:+.1f} MiB "
        f"(spread {facts['free_spread'] / MiB:.1f} MiB); collectives bit-exact after: "
        f"{facts['bit_exact']}; a collective inside: {facts['collective_inside']}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    facts = measure(args.groups, args.cycles)
    print(report(facts))
    if args.json:
        args.json.write_text(json.dumps(facts, indent=1, default=str))


if __name__ == "__main__":
    main()
