"""Timeline, leak watch and doctor on a real GPU (run on the H200)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from tests.gpu.runner import run_alone

pytestmark = pytest.mark.gpu

DOCTOR_RESTRICTED = """
import sys
sys.path.insert(0, ".")
from tests.seccomp import deny_pidfd_getfd
deny_pidfd_getfd()
from hybridmem.cli import main
sys.exit(main(["doctor", "--json"]))
"""

RECORD = """
import json, sys
import torch
import hybridmem as hm
watch = hm.LeakWatch("sleep", window=5, attach=True)
kept = []
with hm.record(sys.argv[1]):
    for cycle in range(8):
        with hm.phase("train", backend="vllm"):
            x = torch.randn(4096, 4096, device="cuda")
            (x @ x).sum().item()
        with hm.phase("rollout", backend="vllm"):
            kv = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            del kv
        with hm.phase("sleep", backend="vllm"):
            kept.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))  # the leak
events = hm.get_timeline().events()
print(json.dumps({"events": len(events), "flagged": watch.flagged, "slope": watch.slope}))
"""


def test_doctor_on_the_gpu() -> None:
    started = time.perf_counter()
    done = run_alone("-m", "hybridmem.cli", "doctor", "--json", timeout=120)
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    print(f"\ndoctor took {seconds:.1f} s; ipc: {report['ipc']}")
    assert report["torch"]["cuda_initialized"] is False  # its own process stays clean
    assert report["ipc"]["classic_ipc"] is True
    assert report["ipc"]["expandable_toggle_works"] is True


def test_doctor_in_a_restricted_consumer() -> None:
    done = run_alone("-c", DOCTOR_RESTRICTED, timeout=120)
    assert done.returncode == 0, done.stderr
    ipc = json.loads(done.stdout)["ipc"]
    print(f"\nrestricted doctor ipc: {ipc}")
    assert ipc["expandable_ipc"] is False
    assert ipc["denied_by"] == "seccomp"


def test_timeline_and_leak_watch_on_real_memory(tmp_path: Path) -> None:
    done = run_alone("-c", RECORD, str(tmp_path / "t"), timeout=300)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["flagged"]  # 64 MiB a cycle kept after sleep
    assert facts["slope"] > 60 * 2**20
    events = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    rollouts = [e for e in events if e["name"] == "phase:rollout"]
    assert len(rollouts) == 8
    assert all(e["after"]["allocated"] > 0 for e in rollouts)
    trace = json.loads((tmp_path / "t.trace.json").read_text())
    assert any(e["ph"] == "C" for e in trace["traceEvents"])
    if importlib.util.find_spec("matplotlib") is None:
        return  # the GPU machine may lack matplotlib; the CPU tests cover the plot
    out = tmp_path / "t.png"
    plot = run_alone("-m", "hybridmem.cli", "plot", str(tmp_path / "t.jsonl"), "-o", str(out))
    assert plot.returncode == 0, plot.stderr
    assert out.stat().st_size > 20_000
