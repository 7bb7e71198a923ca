"""HybridSwitch with a real two-process toy engine (run on the H200; ranks on two GPUs)."""

from __future__ import annotations

import pytest

from tests.gpu.test_allocator_gpu import run_scenario

pytestmark = pytest.mark.gpu
MiB = 1 << 20
MODULE = "tests.gpu.switch_scenarios"


def test_fifty_cycles_with_a_restricted_toy_engine() -> None:
    facts = run_scenario("toy_engine", MODULE)
    drift = {k: v / MiB for k, v in facts["drift_bytes"].items()}
    spread = {k: v / MiB for k, v in facts["spread_bytes"].items()}
    print(f"\ntoy_engine: drift MiB {drift}\nspread MiB {spread}")
    taken, back = facts["kv_taken"] / MiB, facts["handed_back"] / MiB
    print(f"KV taken {taken:.0f} MiB, handed back {back:.0f} MiB")
    print("\n".join(facts["last"]))
    assert facts["cycles"] == 50
    assert facts["engine_exit"] == 0  # no pidfd error in the restricted engine
    assert all(facts["weights_match"])  # the engine saw each cycle's trained weights
    assert facts["kv_taken"] > 10 * 1024 * MiB  # a real KV cache came and went
    assert facts["handed_back"] >= facts["kv_taken"]
    for stage, value in facts["drift_bytes"].items():
        assert abs(value) <= 64 * MiB, (stage, value / MiB)


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
