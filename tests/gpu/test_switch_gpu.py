"""HybridSwitch with a real two-process toy engine (run on the H200; ranks on two GPUs).

The engine keeps its weights and KV cache in torch_memory_saver regions, as SGLang
does; the hand-made engine is the fallback, tested on its own.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from hybridmem.bench.engine_memory import available, preload_library
from tests.gpu import TMS_REASON
from tests.gpu.runner import run_alone, run_scenario
from tests.helpers import REPO

pytestmark = pytest.mark.gpu
MiB = 1 << 20
MODULE = "tests.gpu.switch_scenarios"
needs_tms = pytest.mark.skipif(
    not (available() and preload_library()),
    reason=TMS_REASON,
)


@needs_tms
def test_fifty_cycles_with_a_restricted_engine_on_torch_memory_saver() -> None:
    facts = run_scenario("toy_engine", MODULE)
    assert facts["engine"] == "torch_memory_saver (preload)"
    _check_fifty(facts)


def test_fifty_cycles_with_the_handmade_fallback_engine() -> None:
    facts = run_scenario("handmade_engine", MODULE)
    assert facts["engine"] == "handmade"
    _check_fifty(facts)


def _check_fifty(facts: dict[str, Any]) -> None:
    drift = {k: v / MiB for k, v in facts["drift_bytes"].items()}
    spread = {k: v / MiB for k, v in facts["spread_bytes"].items()}
    print(f"\ntoy_engine: drift MiB {drift}\nspread MiB {spread}")
    print(f"off their stage's median by > 16 MiB (cycle, stage, MiB): {facts['off_the_median']}")
    print(f"the trainer's reserved bytes off their median: {facts['trainer_reserved_off']}")
    print(f"the engine's reserved MiB asleep (distinct): {facts['engine_reserved_asleep_mib']}")
    taken, back = facts["kv_taken"] / MiB, facts["handed_back"] / MiB
    change = facts["trainer_reserved_change"] / MiB
    print(f"KV taken {taken:.0f} MiB, handed back by the engine {back:.0f} MiB")
    print(f"the trainer's reserved change over the sleep: {change:+.0f} MiB")
    print("\n".join(facts["last"]))
    assert facts["cycles"] == 50
    assert facts["engine_exit"] == 0  # no pidfd error in the restricted engine
    assert all(facts["weights_match"])  # the engine saw each cycle's trained weights
    # The reloaded optimizer state lives in expandable segments (decision 85).
    assert facts["state_expandable"]
    assert all(facts["state_expandable"])
    assert facts["kv_taken"] > 10 * 1024 * MiB  # a real KV cache came and went
    # The engine's weights ran under the offload's copies from the second cycle on,
    # once the first measured what they take (decision 86).
    under = [t["weights_under"] for t in facts["times"]]
    print(f"weights under the offload's copies, per cycle: {under}")
    assert not under[0]
    assert all(under[1:]), [i + 1 for i, u in enumerate(under) if not u]
    # And the KV cache too, where the GPU has room for it beside the trainer state
    # (the toy trainer's is small): its copies landed after the KV wake (decision 89).
    kv_under = [t["kv_under"] for t in facts["times"]]
    print(f"the KV cache under the offload's copies, per cycle: {kv_under}")
    assert not kv_under[0]
    assert all(kv_under[1:]), [i + 1 for i, u in enumerate(kv_under) if not u]
    # The engine's hand-back: free memory the sleep gained, the trainer's own reserved
    # change over it (an early reload, a release) counted out.
    assert facts["handed_back"] >= facts["kv_taken"]
    # Drift: the last ten cycles' median against cycles 2-11's (runner.window_drift):
    # a leak moves it, a moment of memory held by something else does not.
    for stage, value in facts["drift_bytes"].items():
        assert abs(value) <= 64 * MiB, (stage, value / MiB, facts["off_the_median"])


def test_a_partial_plan_under_real_faults_loses_nothing() -> None:
    """Planned by need, about half the optimizer state moves; faults bring back that part.

    The engine's KV wake fails after the partial offload: the switch puts the engine
    to sleep and reloads what moved. The reload finds the device taken: the error says
    the state is still offloaded and intact, and a reload once the memory is free puts
    it back bit for bit. Then a cycle runs as before.
    """
    facts = run_scenario("partial_plan_faults", "tests.gpu.need_scenarios")
    print(f"\npartial plan under faults: {facts}")
    total = facts["optimizer_bytes"]
    for key in ("kv_fault_moved", "reload_fault_moved", "after_moved"):
        assert 0 < facts[key] < total, (key, facts[key], total)
    assert facts["kv_fault"] == "RuntimeError: the engine could not take its KV cache (injected)"
    assert facts["kv_fault_offloaded"] == []
    assert facts["kv_fault_intact"]
    assert facts["reload_fault"].startswith("HybridSwitchError"), facts["reload_fault"]
    assert "still offloaded and intact" in facts["reload_fault"]
    assert facts["reload_fault_offloaded"] == ["optimizer"]  # only the part that moved
    assert facts["reload_fault_intact"]
    assert facts["after_intact"]
    assert facts["engine_saw_the_weights"]
    assert facts["engine_exit"] == 0


def test_the_planned_handback_example_moves_part_of_the_optimizer_state() -> None:
    """examples/planned_handback.py: each of its three steps moves some, never all."""
    result = run_alone(str(REPO / "examples" / "planned_handback.py"))
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    moved = re.findall(r"moved (\d+) of (\d+) MiB", result.stdout)
    assert len(moved) == 3, result.stdout
    for part, whole in moved:
        assert 0 < int(part) < int(whole), (part, whole)


@pytest.mark.multi_gpu
def test_no_rank_wakes_its_kv_cache_while_another_offloads() -> None:
    facts = run_scenario("ranks", MODULE)
    print(f"\nranks: {facts}")
    with_barrier = facts["with_barrier"]
    assert with_barrier["cycles"] == 20
    assert with_barrier["violations"] == []
    assert with_barrier["min_margin_s"] >= 0
    assert sorted(with_barrier["ranks"]) == [0, 1]
    assert with_barrier["weights_match"]
    assert with_barrier["engine_exit"] == [0, 0]
    # The control shows the test can fail: without the barrier the fast rank wakes early.
    assert facts["without_barrier"]["violations"]
