"""``hybridmem bench``: the plan, the figures, the verdicts, and the no-GPU path.

The measurements themselves need a GPU (``hybridmem bench`` on the H200).
"""

from __future__ import annotations

import pytest

from hybridmem.bench import Figures, handback_ratio, plan
from hybridmem.bench.run import _verdicts
from hybridmem.cli import main

GiB = 2**30
MiB = 2**20


@pytest.mark.parametrize("quick", [True, False])
def test_plan_sizes_the_trainer_from_device_memory(quick: bool) -> None:
    p = plan(141 * GiB, quick=quick)
    share = p.state_bytes / (141 * GiB)
    assert 0.02 < share < (0.06 if quick else 0.12)
    assert p.heads * 128 == p.d_model
    assert p.kv_fraction == 0.5
    assert p.cycles == (6 if quick else 30)
    small = plan(24 * GiB, quick=quick)
    assert small.params < p.params
    assert small.layers >= 2
    assert plan(141 * GiB, quick=quick).as_dict()["params"] == p.params
    with pytest.raises(ValueError, match="total_bytes must be > 0"):
        plan(0, quick=quick)


def test_handback_ratio() -> None:
    assert handback_ratio(free=99 * GiB, total=141 * GiB, live=40 * GiB, context=1 * GiB) == 0.99
    assert handback_ratio(free=1, total=10, live=10, context=1) == 0.0


def figures(strategy: str, **over: object) -> Figures:
    base = Figures(
        strategy=strategy,
        cycles=4,
        kv_target=70 * GiB,
        kv_obtained=[70 * GiB] * 4,
        handback=[0.999] * 4,
        to_rollout_s=[0.5] * 4,
        to_trainer_s=[0.3] * 4,
        offload_gbps=[50.0] * 4,
        pinned_gbps=54.0,
        peak_reserved=[103 * GiB // 100] * 4,
        peak_allocated=[GiB] * 4,
        free_at_train=[100 * GiB] * 4,
        overhead_s=[0.01] * 4,
        errors=[],
    )
    for key, value in over.items():
        setattr(base, key, value)
    return base


def test_summary_medians_and_drift() -> None:
    leaking = figures("naive", free_at_train=[100 * GiB - i * 8 * MiB for i in range(4)])
    summary = leaking.summary()
    assert summary["kv_obtained_gib"] == 70
    assert summary["handback"] == 0.999
    assert summary["offload_of_pinned"] == pytest.approx(50 / 54)
    assert summary["peak_reserved_over_allocated"] == pytest.approx(1.03, abs=0.01)
    assert summary["drift_mib_per_cycle"] == pytest.approx(8.0)
    assert figures("x", free_at_train=[GiB]).summary()["drift_mib_per_cycle"] is None


def test_verdicts_name_targets_and_baselines() -> None:
    rows = {
        "naive": figures("naive", kv_obtained=[40 * GiB] * 4, handback=[0.7] * 4).summary(),
        "handrolled": figures("handrolled", handback=[0.98] * 4).summary(),
        "hybridmem": figures("hybridmem", offload_gbps=[40.0] * 4).summary(),
    }
    lines = _verdicts(rows)
    assert "handback: 0.999 (target >= 0.995): met" in lines
    assert any(line.startswith("offload_of_pinned") and "NOT met" in line for line in lines)
    assert "handback: hybridmem at least as good as naive and handrolled" in lines
    assert "offload_gbps: hybridmem worse than naive and handrolled" in lines


def test_bench_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--strategies", "magic"])
    assert exit_info.value.code == 2
