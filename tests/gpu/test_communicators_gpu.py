"""torch's own NCCL communicators on the GPU: what they hold, suspended and resumed.

With ``HM_NCCL_LIBRARY`` naming a ``libnccl.so.2`` of NCCL 2.29.7+ (built from
NVIDIA/nccl's source by ``benchmarks/build_nccl.sh``), the scenarios run with it
preloaded under torch; without it, torch's own NCCL (2.28.9 with torch 2.11) must get
one clear line and no change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.gpu.runner import artifacts_dir, run_alone, run_scenario

pytestmark = pytest.mark.gpu
LIBRARY_ENV = "HM_NCCL_LIBRARY"  # not HYBRIDMEM_*: clean_env keeps it for the child
needs_suspend = pytest.mark.skipif(
    not os.environ.get(LIBRARY_ENV),
    reason=f"needs an NCCL with ncclCommSuspend (2.29.7+): {LIBRARY_ENV}=<libnccl.so.2> "
    "(benchmarks/build_nccl.sh builds one from NVIDIA/nccl's source)",
)


def _preloaded() -> dict[str, str]:
    return {"LD_PRELOAD": os.environ[LIBRARY_ENV]}


@needs_suspend
def test_five_groups_give_back_what_nccl_counts_and_come_back_bit_exact() -> None:
    facts = run_scenario("measure", "tests.gpu.comm_scenarios", **_preloaded())
    print("\n" + json.dumps(facts, indent=1))
    assert facts["supported"] is True, facts["warnings"]
    assert len(facts["communicators"]) == 5
    assert all(c["source"] == "ncclCommMemStats" for c in facts["communicators"])
    assert facts["suspendable"] > 0
    assert facts["given_back_share"] >= 0.95
    assert facts["handback_suspended"] > facts["handback_held"]
    assert facts["bit_exact"] is True
    assert facts["collective_inside"].startswith("refused")
    assert abs(facts["drift"]) <= 2 << 20  # 100 cycles, no drift beyond 2 MiB


@needs_suspend
def test_a_communicator_another_owner_suspended_is_left_to_it() -> None:
    facts = run_scenario("left_to_its_owner", "tests.gpu.comm_scenarios", **_preloaded())
    assert list(facts["skipped"].values()) == ["suspended by another owner"]
    assert len(facts["suspended"]) == 1  # the default group, which it owns
    assert facts["other_still_suspended"] is True
    assert facts["after_owner_resumed"] == [1.0] * 4


def test_torchs_stock_nccl_gets_one_line_and_no_change() -> None:
    facts = run_scenario("measure", "tests.gpu.comm_scenarios", LD_PRELOAD="")
    print("\n" + json.dumps(facts, indent=1))
    if tuple(int(x) for x in facts["nccl"].split(".")) >= (2, 29, 7):
        pytest.skip(f"torch's own NCCL {facts['nccl']} has suspend: nothing to refuse")
    assert facts["supported"] is False
    assert len(facts["warnings"]) == 1
    assert "needs NCCL 2.29.7+" in facts["warnings"][0]
    assert facts["nccl"] in facts["warnings"][0]
    assert facts["collective_inside"] == "ran"
    assert all(c["total"] is None for c in facts["communicators"])
    assert "likely hold part of what is not torch's" in facts["lines"][0]


@needs_suspend
def test_the_bench_hands_back_more_with_the_trainers_communicators_suspended(
    tmp_path: Path,
) -> None:
    out = artifacts_dir(tmp_path) / "bench_communicators.json"
    done = run_alone(
        "-m",
        "hybridmem.cli",
        "bench",
        "--quick",
        "--communicators",
        "5",
        "--json",
        str(out),
        timeout=480,
        env=_preloaded(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print("\n" + done.stdout)
    rows = {n: r["summary"] for n, r in json.loads(out.read_text())["results"].items()}
    assert sorted(rows) == ["hybridmem", "suspended"]  # held against suspended
    for name, row in rows.items():
        assert row["errors"] == [], name
    held, suspended = rows["hybridmem"], rows["suspended"]
    assert held["missing_mib"]["communicators"] > 0  # NCCL's buffers kept the hand-back down
    assert suspended["missing_mib"]["communicators"] == 0
    assert suspended["handback"] > held["handback"]
