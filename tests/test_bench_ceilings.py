"""The bench's copy-rate ceilings: the kernels' rate beside the pinned one, and where it is said.

The rates themselves need a GPU (tests/gpu/test_bench_gpu.py); here the seam
is faked for the probe's refusals, and the figures, table and verdicts are real.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridmem import _torch
from hybridmem.bench.ceilings import RATE_BYTES_MAX, kernel_ceiling, rate_bytes
from hybridmem.bench.figures import kernel_rate_note, resummarise
from hybridmem.bench.need_report import need_verdicts
from hybridmem.bench.report import scale_verdicts
from tests.test_bench import figures

GiB = 2**30
MiB = 2**20


def test_a_rate_is_measured_over_at_most_two_gib_in_whole_words() -> None:
    assert rate_bytes(64 * GiB) == RATE_BYTES_MAX == 2 * GiB
    assert rate_bytes(0) == MiB
    assert rate_bytes(3 * MiB + 5) == 3 * MiB  # whole 8-byte words
    assert rate_bytes(3 * MiB + 5) % 8 == 0


def test_the_kernel_ceiling_is_none_where_memory_cannot_be_mapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    assert kernel_ceiling(GiB) is None  # no CUDA context here: nothing tried
    monkeypatch.setattr(_torch, "current_device", lambda: 0)
    monkeypatch.setattr(_torch, "synchronize", lambda index: calls.append(f"sync {index}"))
    monkeypatch.setattr(_torch, "pin_host_tensor", lambda t, mapped=False: calls.append("pin"))
    monkeypatch.setattr(_torch, "unpin_host_tensor", lambda ptr: calls.append("unpin"))
    assert kernel_ceiling(GiB) is None  # registration refused: nothing to undo
    assert calls == ["pin"]

    calls.clear()

    def pinned(tensor: Any, mapped: bool = False) -> bool:
        calls.append(f"pin mapped={mapped}")
        return True

    monkeypatch.setattr(_torch, "pin_host_tensor", pinned)
    monkeypatch.setattr(_torch, "host_device_view", lambda host, device: None)
    assert kernel_ceiling(GiB) is None  # registered, but no device mapping
    assert calls == ["pin mapped=True", "sync 0", "unpin"]  # unregistered all the same


def _row(**over: Any) -> dict[str, Any]:
    """A planned switch back copying 4 GiB in 1.3x its pinned time, engine and release aside."""
    seconds = 4 * GiB / 54e9 * 1.3
    base: dict[str, Any] = {
        "need": 0.5,
        "deficit_bytes": 4 * GiB,
        "copied_bytes": [4 * GiB] * 4,
        "to_rollout_s": [4 * GiB / 54e9 + 0.02] * 4,
        "to_trainer_s": [seconds + 0.03 + 0.005] * 4,
        "engine_wake_s": [0.02] * 4,
        "engine_sleep_s": [0.03] * 4,
        "release_to_rollout_s": [0.0] * 4,
        "release_to_trainer_s": [0.005] * 4,
        "kernel_gbps": 54.0 * 0.8,
    }
    return figures("planned", **(base | over)).summary()


def test_the_return_is_also_measured_against_its_bytes_at_the_kernels_rate() -> None:
    row = _row()
    assert row["to_trainer_over_ceiling_engine_and_release_aside"] == pytest.approx(1.3)
    assert row["kernel_of_pinned"] == pytest.approx(0.8)
    # the same seconds over the bytes at 0.8 of the pinned rate
    assert row["to_trainer_over_kernel_ceiling_engine_and_release_aside"] == pytest.approx(1.04)
    assert kernel_rate_note(row) == (
        "1.04x at the kernels' copy rate (0.80 of the pinned), engine calls and releases aside"
    )
    unmeasured = _row(kernel_gbps=None)
    assert unmeasured["to_trainer_over_kernel_ceiling_engine_and_release_aside"] is None
    assert unmeasured["kernel_of_pinned"] is None
    assert kernel_rate_note(unmeasured) is None


def test_results_saved_before_the_kernel_rate_have_no_such_figure() -> None:
    raw = figures("hybridmem", moved_bytes=4 * GiB).__dict__.copy()
    del raw["kernel_gbps"]
    row = resummarise({"raw": raw}, None)["summary"]
    assert row["to_trainer_over_ceiling"] is not None  # judged again, less this figure
    assert row["kernel_of_pinned"] is None
    assert kernel_rate_note(row) is None


def test_the_need_verdict_of_the_return_is_judged_at_the_kernels_rate() -> None:
    point = {"state_gib": 8, "need": 0.5, "plan": {}, "results": {"planned": {"summary": _row()}}}
    judged = need_verdicts([point])
    to_rollout = next(line for line in judged if " to rollout: " in line)
    to_trainer = next(line for line in judged if " to trainer: " in line)
    assert "kernels' copy rate" not in to_rollout  # the offload is by copy engine
    assert "to trainer: 1.04x its bytes at the kernels' copy rate" in to_trainer
    assert "(target <= 1.2x; 1.30x at the pinned rate, kernels at 0.80 of it" in to_trainer
    assert to_trainer.endswith(": met")
    bare = {"state_gib": 8, "need": 0.5, "plan": {}}
    bare["results"] = {"planned": {"summary": _row(kernel_gbps=None)}}
    back = next(line for line in need_verdicts([bare]) if " to trainer: " in line)
    assert back.endswith("not measured (no kernels' copy rate in these results)")


def test_the_scale_verdict_of_the_return_says_its_figure_at_the_kernels_rate() -> None:
    row = figures(
        "hybridmem",
        moved_bytes=4 * GiB,
        to_rollout_s=[4 * GiB / 54e9] * 4,
        to_trainer_s=[4 * GiB / 54e9 * 1.2] * 4,
        engine_sleep_s=[0.0] * 4,
        release_to_trainer_s=[0.0] * 4,
        kernel_gbps=54.0 * 0.8,
    ).summary()
    size = {"state_gib": 8, "plan": {}, "results": {"hybridmem": {"summary": row}}}
    to_rollout, to_trainer = scale_verdicts([size])
    assert "kernels" not in to_rollout
    assert to_trainer.startswith("8 GiB to trainer: 1.20x the ceiling (target <= 1.1x): NOT met")
    assert "0.96x at the kernels' copy rate (0.80 of the pinned)" in to_trainer
