"""``hybridmem bench --scale``: the plans, the ceiling ratios, the table, the plot, the CLI.

The runs themselves need a GPU; here every child is faked and everything else is real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybridmem import _torch
from hybridmem.bench import run as bench_run
from hybridmem.bench.figures import moved_bytes_of, resummarise
from hybridmem.bench.plan import MIN_CYCLES, SCALE_GIB, BenchPlan, scale_plan
from hybridmem.bench.report import format_scale_table, plot_scale, scale_verdicts
from hybridmem.cli import main
from tests.channels import ScriptedChannel
from tests.test_bench import figures, tiny

GiB = 2**30
H200 = 141 * GiB


@pytest.mark.parametrize(("gib", "d_model"), [(8, 2048), (32, 2048), (64, 4096)])
def test_scale_plans_hold_the_asked_trainer_state(gib: int, d_model: int) -> None:
    p = scale_plan(H200, gib)
    assert abs(p.state_bytes / GiB - gib) / gib < 0.01  # within 1% of the size asked
    assert (p.d_model, p.heads * 128) == (d_model, d_model)
    assert (p.batch, p.seq_max, p.train_steps, p.cycles) == (2, 512, 1, MIN_CYCLES)
    assert p.kv_fraction == 0.5
    assert scale_plan(H200, gib, cycles=7).cycles == 7


def test_a_scale_the_device_cannot_hold_is_refused_with_the_largest_that_fits() -> None:
    assert tuple(SCALE_GIB) == (8, 32, 64)
    with pytest.raises(ValueError, match=r"100 GiB .* the largest is 85 GiB: pass smaller"):
        scale_plan(H200, 100)
    with pytest.raises(ValueError, match="state_gib must be > 0"):
        scale_plan(H200, 0)
    with pytest.raises(ValueError, match="cycles must be >= 6"):
        scale_plan(H200, 8, cycles=1)


def test_the_summary_puts_each_switch_against_the_ceiling_of_its_own_run() -> None:
    row = figures(
        "hybridmem", state_bytes=81 * 10**9 // 2, moved_bytes=54 * 10**9 // 2, pinned_gbps=54.0
    ).summary()
    # The ceiling is the bytes moved over the host link (the optimizer state), not the
    # state on the device: the parameters stay there.
    assert row["ceiling_s"] == pytest.approx(0.5)  # 27 GB at 54 GB/s
    assert row["to_rollout_over_ceiling"] == pytest.approx(1.0)  # 0.5 s
    assert row["to_trainer_over_ceiling"] == pytest.approx(0.6)  # 0.3 s
    assert (row["state_gib"], row["moved_gib"]) == pytest.approx((40.5e9 / GiB, 27e9 / GiB))
    unknown = figures("naive", state_bytes=GiB).summary()  # nothing moved known: no ratio
    assert unknown["ceiling_s"] is None
    assert unknown["to_rollout_over_ceiling"] is None


def test_results_saved_before_moved_bytes_are_judged_by_the_optimizer_state() -> None:
    # The scale runs of 2026-12-02 saved state_bytes (fp32 parameters + AdamW moments,
    # 12 B a parameter) and a ceiling from it; their optimizer state is 8 B a parameter.
    params = 10**9
    old = figures("hybridmem", state_bytes=12 * params, pinned_gbps=54.0)
    raw = {k: v for k, v in old.__dict__.items() if k != "moved_bytes"}
    plan = {"params": params}
    assert moved_bytes_of(raw, plan) == 8 * params
    assert moved_bytes_of({**raw, "moved_bytes": 5}, plan) == 5  # saved: taken as saved
    assert moved_bytes_of(raw, None) == 0  # cannot be known
    stale = {"summary": {"ceiling_s": 12 * params / 54e9}, "raw": raw}
    again = resummarise(stale, plan)["summary"]
    assert again["ceiling_s"] == pytest.approx(8 * params / 54e9)
    assert again["to_rollout_over_ceiling"] == pytest.approx(0.5 / (8 * params / 54e9))
    assert resummarise({"summary": {"x": 1}, "raw": {}}, plan) == {"summary": {"x": 1}, "raw": {}}


def _size(gib: float, slow: float) -> dict[str, Any]:
    """Saved results for one size: hybridmem at the ceiling x ``slow``, handrolled 2x."""
    state = int(gib * GiB)
    ceiling = state / 54e9
    results = {
        name: {
            "summary": figures(
                name,
                state_bytes=state * 3 // 2,
                moved_bytes=state,
                to_rollout_s=[ceiling * factor] * 4,
                to_trainer_s=[ceiling * factor] * 4,
            ).summary()
        }
        for name, factor in (("handrolled", 2.0), ("hybridmem", slow))
    }
    return {"state_gib": gib, "plan": {}, "results": results}


def test_the_table_and_verdicts_say_which_sizes_meet_the_target() -> None:
    sizes = [_size(8, 1.05), _size(64, 1.3)]
    table = "\n".join(format_scale_table(sizes))
    assert (
        "== 8 GiB of trainer state; ceiling 0.159 s each way (its 8.0 GiB of optimizer "
        "state at the pinned copy rate)"
    ) in table
    assert "handrolled" in table
    assert "2.00" in table  # handrolled: twice the ceiling
    judged = scale_verdicts(sizes)
    assert judged[0] == "8 GiB to rollout: 1.05x the ceiling (target <= 1.1x): met"
    assert judged[3] == "64 GiB to trainer: 1.30x the ceiling (target <= 1.1x): NOT met"


def test_the_scale_plot_is_a_non_trivial_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "scale.png"
    plot_scale([_size(8, 1.0), _size(32, 1.05), _size(64, 1.1)], str(out))
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG")
    assert len(data) > 20_000


def an_h200_running(monkeypatch: pytest.MonkeyPatch, child: Any) -> None:
    """A CPU machine that says it has an H200, whose strategy runs ``child`` answers."""
    import torch

    from hybridmem.bench import engine_memory

    monkeypatch.setattr(_torch, "cuda_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=H200)
    )
    monkeypatch.setattr("hybridmem._devices.device_index", lambda device: 0)
    monkeypatch.setattr(engine_memory, "resolve", lambda engine: "handmade")
    monkeypatch.setattr(engine_memory, "available", lambda: False)
    monkeypatch.setattr(bench_run, "child_run", child)


def test_a_plain_bench_with_anatomy_says_its_seconds_are_no_figures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plans: list[BenchPlan] = []

    def child(name: str, p: BenchPlan, timeline: str | None) -> dict[str, Any]:
        plans.append(p)
        return {"summary": figures(name, state_bytes=p.state_bytes).summary()}

    an_h200_running(monkeypatch, child)
    main(["bench", "--quick", "--strategies", "hybridmem", "--anatomy", "--train-s", "0.25"])
    assert [(p.anatomy, p.train_s) for p in plans] == [(True, 0.25)]
    out = capsys.readouterr().out
    assert "training 0.25 s longer" in out
    assert "this run's seconds diagnose; they are not figures" in out
    plans.clear()
    main(["bench", "--quick", "--strategies", "hybridmem"])
    assert [(p.anatomy, p.train_s) for p in plans] == [(False, 0.0)]
    assert "not figures" not in capsys.readouterr().out


def test_bench_scale_runs_every_strategy_at_every_size_and_saves_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:

    ran: list[tuple[str, float]] = []
    rollouts: list[float] = []
    trainings: list[float] = []
    anatomies: list[bool] = []

    def child(name: str, p: BenchPlan, timeline: str | None) -> dict[str, Any]:
        assert timeline is None
        ran.append((name, round(p.state_bytes / GiB)))
        rollouts.append(p.rollout_s)
        trainings.append(p.train_s)
        anatomies.append(p.anatomy)
        return {"summary": figures(name, state_bytes=p.state_bytes).summary()}

    an_h200_running(monkeypatch, child)
    out = tmp_path / "scale.json"
    code = main(
        [
            "bench",
            "--scale",
            "8",
            "32",
            "--json",
            str(out),
            "--cycles",
            "6",
            "--rollout-s",
            "1.5",
            "--train-s",
            "0.5",
            "--anatomy",
        ]
    )
    assert code == 0
    assert set(rollouts) == {1.5}  # every plan's rollout lasts 1.5 s more
    assert set(trainings) == {0.5}  # and its training 0.5 s
    assert set(anatomies) == {True}  # each records its caches' anatomy
    assert ran == [(n, g) for g in (8, 32) for n in ("naive", "handrolled", "hybridmem")]
    saved = json.loads(out.read_text())
    assert [s["state_gib"] for s in saved["scale"]] == [8, 32]
    assert saved["scale"][0]["plan"]["cycles"] == 6
    assert saved["scale"][1]["plan"]["rollout_s"] == 1.5
    assert saved["scale"][1]["plan"]["train_s"] == 0.5
    assert any("8 GiB to rollout" in v for v in saved["verdicts"])
    printed = capsys.readouterr()
    assert "== 32 GiB of trainer state" in printed.out
    assert "rollouts of 1.5 s more, training 0.5 s longer" in printed.out
    assert "this run's seconds diagnose; they are not figures" in printed.out  # --anatomy
    assert "strategy tms skipped" in printed.err
    # a size that cannot fit is refused before anything runs
    ran.clear()
    assert main(["bench", "--scale", "8", "200"]) == 2
    assert ran == []
    assert "200 GiB" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scale", "8", "--quick"], "--scale runs plans of its own: leave out --quick"),
        (["--scale", "--timeline", "t"], "leave out --timeline"),
        (["--scale", "-1"], "--scale sizes are GiB of trainer state (> 0), got -1"),
        (["--rollout-s", "-1"], "--rollout-s must be seconds from 0 to 600, got -1"),
        (["--scale", "--rollout-s", "601"], "--rollout-s must be seconds from 0 to 600, got 601"),
        (["--train-s", "-2"], "--train-s must be seconds from 0 to 600, got -2"),
        (["--scale", "--train-s", "700"], "--train-s must be seconds from 0 to 600, got 700"),
        (["--need", "0.5"], "--need sizes the rollout at model scale: pass --scale too"),
        (["--scale", "8", "--need", "1.5"], "--need shares are from 0 to 1, got 1.5"),
        (
            ["--scale", "8", "--need", "0.5", "--strategies", "naive", "planned"],
            "--need compares hybridmem, planned and fraction: leave out naive",
        ),
        (["--strategies", "planned"], "strategies planned and fraction run with --scale"),
    ],
)
def test_scale_misuse_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_scale_without_a_gpu_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_torch, "cuda_available", lambda: False)
    assert main(["bench", "--scale"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _saved_scale(tmp_path: Path, name: str, sizes: dict[float, dict[str, float]]) -> str:
    """A scale file: at each size, each strategy's to-rollout seconds (raw figures kept)."""
    measured = []
    for gib, strategies in sizes.items():
        params = int(gib * GiB) // 16
        results = {}
        for strategy, seconds in strategies.items():
            raw = figures(
                strategy, state_bytes=12 * params, moved_bytes=8 * params, to_rollout_s=[seconds]
            )
            results[strategy] = {"summary": raw.summary(), "raw": raw.__dict__}
        measured.append({"state_gib": gib, "plan": {"params": params}, "results": results})
    path = tmp_path / name
    path.write_text(json.dumps({"scale": measured, "verdicts": []}))
    return str(path)


def test_scale_results_saved_apart_merge_by_size_without_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _saved_scale(tmp_path, "a.json", {32: {"naive": 9.0, "hybridmem": 0.4}})
    second = _saved_scale(tmp_path, "b.json", {64: {"naive": 20.0, "hybridmem": 0.8}})
    again = _saved_scale(tmp_path, "c.json", {32: {"hybridmem": 0.35}})  # one strategy re-run
    merged = tmp_path / "merged.json"
    argv = ["bench", "--from-json", second, first, again, "--json", str(merged)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("== 32 GiB") < out.index("== 64 GiB")  # by size, not by file
    data = json.loads(merged.read_text())
    assert [size["state_gib"] for size in data["scale"]] == [32, 64]
    at_32 = data["scale"][0]["results"]
    assert sorted(at_32) == ["hybridmem", "naive"]  # the re-run replaced only itself
    assert at_32["hybridmem"]["summary"]["to_rollout_s"] == 0.35
    assert any(v.startswith("64 GiB to rollout") for v in data["verdicts"])


def test_scale_and_bench_results_do_not_mix_and_bad_scale_files_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.test_bench import saved

    scale = _saved_scale(tmp_path, "scale.json", {8: {"hybridmem": 0.1}})
    quick = saved(tmp_path, "quick.json", "hybridmem")
    assert main(["bench", "--from-json", scale, quick]) == 2
    assert "quick.json: not scale results, and the others are" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"scale": []}))
    assert main(["bench", "--from-json", str(empty)]) == 2
    assert "empty.json is not saved scale results" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"scale": [{"state_gib": 8, "results": {}}]}))
    assert main(["bench", "--from-json", str(broken)]) == 2
    assert "broken.json (8 GiB) is not saved bench results" in capsys.readouterr().err


def test_the_summary_puts_each_switch_against_the_ceiling_with_the_engines_calls_aside() -> None:
    row = figures(
        "hybridmem",
        moved_bytes=27 * 10**9,  # ceiling 0.5 s at 54 GB/s
        to_rollout_s=[0.6, 0.6, 0.7, 0.6],
        to_trainer_s=[0.8, 0.9, 0.8, 0.8],
        engine_wake_s=[0.05, 0.05, 0.15, 0.05],  # a slow wake in cycle 3, paired with it
        engine_sleep_s=[0.2, 0.3, 0.2, 0.2],
    ).summary()
    assert row["engine_wake_s"] == pytest.approx(0.05)
    assert row["engine_sleep_s"] == pytest.approx(0.2)
    assert row["to_rollout_over_ceiling"] == pytest.approx(1.2)
    assert row["to_rollout_over_ceiling_engine_aside"] == pytest.approx(1.1)  # 0.55 s each
    assert row["to_trainer_over_ceiling_engine_aside"] == pytest.approx(1.2)  # 0.6 s each
    # The first cycle is a warm-up: the median of the other three, their worst beside.
    assert row["counted_cycles"] == 3
    assert row["to_trainer_over_ceiling"] == pytest.approx(1.6)  # 0.9, 0.8, 0.8 (not 0.8 first)
    assert row["to_rollout_over_ceiling_worst"] == pytest.approx(1.4)  # 0.7
    assert row["to_trainer_over_ceiling_worst"] == pytest.approx(1.8)  # 0.9
    saved_before = figures("hybridmem", moved_bytes=27 * 10**9).summary()  # no engine times
    assert saved_before["engine_wake_s"] is None
    assert saved_before["to_trainer_over_ceiling_engine_aside"] is None
    unpaired = figures("hybridmem", moved_bytes=27 * 10**9, engine_wake_s=[0.05]).summary()
    assert unpaired["to_rollout_over_ceiling_engine_aside"] is None  # cycles do not pair


def test_hybridmems_verdicts_and_the_table_give_the_engines_own_calls() -> None:
    size = _size(8, 1.3)
    row = size["results"]["hybridmem"]["summary"]
    row.update(
        engine_wake_s=0.012,
        engine_sleep_s=0.034,
        to_rollout_over_ceiling_engine_aside=1.21,
        to_trainer_over_ceiling_engine_aside=1.05,
    )
    judged = scale_verdicts([size])
    assert judged == [
        "8 GiB to rollout: 1.30x the ceiling (target <= 1.1x): NOT met "
        "(1.21x with the engine's own calls aside)",
        "8 GiB to trainer: 1.30x the ceiling (target <= 1.1x): NOT met "
        "(1.05x with the engine's own calls aside)",
    ]
    row.update(to_trainer_over_ceiling_worst=1.42)
    assert scale_verdicts([size])[1] == (
        "8 GiB to trainer: 1.30x the ceiling (target <= 1.1x): NOT met "
        "(1.42x the worst counted cycle; 1.05x with the engine's own calls aside)"
    )
    table = format_scale_table([size])
    assert "engine wake s" in table[1]
    assert table[1].endswith("engine sleep s")
    line = next(line for line in table if line.startswith("hybridmem"))
    assert line.split()[-2:] == ["0.012", "0.034"]
    assert next(line for line in table if line.startswith("handrolled")).split()[-2:] == ["-", "-"]


def test_the_engine_client_counts_only_wake_and_sleep_as_the_engines_own_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybridmem.bench import engine as bench_engine

    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))  # the engine's clock
    # The engine's end of the pipe, answering every command at once.
    conn = ScriptedChannel(
        answer=lambda command: [("ok", 0, 0) if command[0] == "stats" else ("ok",)]
    )
    client = bench_engine.EngineClient(conn, 0, H200)  # type: ignore[arg-type]
    client.call("wake", ["weights"])  # 1 s on this clock
    client.call("stats")
    client.call("sync_tensors", {})
    client.call("sleep")
    assert client.engine_seconds == 4.0
    assert client.memory_seconds == 2.0


@pytest.mark.parametrize(("copy_seconds", "expected"), [(0.05, 0.05), (None, 0.2)])
def test_hybridmems_offload_rate_is_its_copies_own_time(
    copy_seconds: float | None, expected: float
) -> None:
    """Decision 90: the report's wall time runs on to the landing after the KV wake."""
    from hybridmem.bench.strategies import Hybridmem
    from hybridmem.memory.offload_report import OffloadReport

    report = OffloadReport("offload", ("optimizer",), GiB, 3, 0.2, GiB, "cuda:0", 0, copy_seconds)
    switch = SimpleNamespace(
        to_rollout=lambda: _switch_report("to_rollout", offload=0.2),
        offload_report=report,
        plan=None,
    )
    strategy = SimpleNamespace(
        switch=switch, offloader=SimpleNamespace(host_bytes=GiB), _sync_s=0.01
    )
    moved = Hybridmem.to_rollout(strategy)  # type: ignore[arg-type]
    assert moved.copy_s == expected
    assert moved.copy_bytes == GiB
    assert moved.sync_s == 0.01


def test_a_planned_switch_with_nothing_short_copies_nothing_either_way() -> None:
    from hybridmem.bench.strategies import Hybridmem
    from hybridmem.memory.need_plan import NeedPlan

    switch = SimpleNamespace(
        to_rollout=lambda: _switch_report("to_rollout", plan=0.001, offload=0.0),
        to_trainer=lambda: _switch_report("to_trainer", reload=0.0, release=0.001),
        offload_report=None,
        plan=NeedPlan(need=GiB, free=8 * GiB, margin=0, deficit=0),
    )
    strategy = SimpleNamespace(
        switch=switch, offloader=SimpleNamespace(host_bytes=GiB), _sync_s=0.01, _moved=GiB
    )
    out = Hybridmem.to_rollout(strategy)  # type: ignore[arg-type]
    back = Hybridmem.to_trainer(strategy)  # type: ignore[arg-type]
    assert (out.copy_s, out.copy_bytes, back.copy_bytes) == (0.0, 0, 0)
    # Where each way's time went, stage by stage, in the switch's order.
    assert out.stages == {"plan": 0.001, "offload": 0.0}
    assert back.stages == {"reload": 0.0, "release": 0.001}


def _switch_report(direction: Any, **seconds: float) -> Any:
    """A switch's report whose stages took ``seconds`` (by name, in order), no device."""
    from hybridmem.engine.reports import StageReport, SwitchReport
    from hybridmem.observe.memory import MemoryInfo

    none = MemoryInfo(device=None, available=False)
    stages = [StageReport(name, s, none, none, 0.0) for name, s in seconds.items()]
    return SwitchReport(direction, 0, stages)


def test_a_stage_run_twice_in_a_switch_is_summed() -> None:
    from hybridmem.bench.strategies import _stage_seconds

    report = _switch_report("to_rollout", release=0.002, wake_kv=0.01)
    report.stages.append(report.stages[0])  # a second release
    assert _stage_seconds(report) == {"release": 0.004, "wake_kv": 0.01}


def _cycle_fakes(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """torch.cuda's calls in ``_cycle`` made harmless; an engine that answers ``ok``."""
    import torch

    for name, value in (
        ("synchronize", None),
        ("reset_peak_memory_stats", None),
        ("max_memory_reserved", GiB),
        ("max_memory_allocated", GiB),
    ):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _v=value: _v)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * GiB, H200))
    engine = SimpleNamespace(
        engine_seconds=0.0,
        memory_seconds=9.0,
        last_kv=GiB,
        last_handback=0.999,
        last_handback_pages=0.9995,
        last_missing={},
        last_anatomy={},
    )
    engine.call = lambda *command: ("ok", 0, 0)
    engine.read_handback = lambda: None
    return engine


class _Script:
    """A clock the cycle reads and the order of what ran: each step logs its name and
    moves the clock by its seconds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 100.0
        self.calls: list[str] = []
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)

    def step(self, seconds: float, name: str, answer: Any = None) -> Any:
        """A call that takes ``seconds`` and answers ``answer`` (a ``Moved()`` by default)."""
        from hybridmem.bench.strategies import Moved

        def call(*args: Any) -> Any:
            self.calls.append(name)
            self.now += seconds
            return Moved() if answer is None else answer

        return call


def test_each_cycle_records_the_engines_wake_and_sleep_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybridmem.bench.strategies import Moved

    engine = _cycle_fakes(monkeypatch)
    read: list[str] = []
    engine.read_handback = lambda: read.append("hand-back")  # after the switch, untimed

    class Strategy:
        def train_scope(self) -> Any:
            return contextlib.nullcontext()

        def to_rollout(self) -> Moved:
            engine.memory_seconds += 0.25  # the engine's wake-ups
            return Moved()

        def to_trainer(self) -> Moved:
            engine.memory_seconds += 0.125  # its sleep
            return Moved()

    got = figures("hybridmem", to_rollout_s=[], to_trainer_s=[])
    bench_run._cycle(0, tiny("torch"), Strategy(), engine, lambda: None, got)
    assert got.errors == []
    assert got.engine_wake_s == [0.25]  # counted from 0 at each switch, not from 9
    assert got.stages_to_rollout_s == got.stages_to_trainer_s == []  # not a HybridSwitch
    assert got.engine_sleep_s == [0.125]
    assert read == ["hand-back"]
    assert got.handback[-1] == 0.999


def test_each_cycle_records_the_switchs_stages_and_what_ran_outside_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybridmem.bench.strategies import Moved

    engine = _cycle_fakes(monkeypatch)
    engine.last_missing = {"trainer_cached": 0}
    script = _Script(monkeypatch)
    out = Moved(sync_s=0.12, stages={"plan": 0.01, "weight_sync": 0.125})
    back = Moved(stages={"reload": 0.25, "release": 0.125})
    strategy = SimpleNamespace(
        train_scope=contextlib.nullcontext,
        to_rollout=script.step(0.25, "to_rollout", out),
        to_trainer=script.step(0.5, "to_trainer", back),
    )
    got = figures("planned", to_rollout_s=[], to_trainer_s=[])
    for cycle in range(2):
        bench_run._cycle(cycle, tiny("torch"), strategy, engine, lambda: None, got)
    assert got.errors == []
    assert got.sync_s == [0.12, 0.12]
    outside = bench_run.OUTSIDE_STAGES
    assert got.stages_to_rollout_s[0] == {
        "plan": 0.01,
        "weight_sync": 0.125,
        outside: pytest.approx(0.115),
    }
    assert got.stages_to_trainer_s[1] == {"reload": 0.25, "release": 0.125, outside: 0.125}
    summary = got.summary()
    assert summary["sync_s"] == 0.12
    assert summary["stages_to_trainer_ms"] == {"reload": 250.0, "release": 125.0, outside: 125.0}
    assert list(summary["stages_to_rollout_ms"]) == ["plan", "weight_sync", outside]


def test_the_training_steps_queued_work_is_waited_for_before_the_switch_is_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU's backlog of the step is drained before the switch, and counted apart."""
    import torch

    engine = _cycle_fakes(monkeypatch)
    engine.last_missing = {"trainer_cached": 0}
    script = _Script(monkeypatch)
    calls = script.calls

    def synchronize(*args: Any) -> None:
        calls.append("synchronize")
        if calls[-2:-1] == ["train"]:  # the step's kernels finish 0.5 s after its host part
            script.now += 0.5

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    strategy = SimpleNamespace(
        train_scope=contextlib.nullcontext,
        to_rollout=script.step(0.25, "to_rollout"),
        to_trainer=script.step(0.125, "to_trainer"),
    )
    got = figures("hybridmem", to_rollout_s=[], to_trainer_s=[])
    bench_run._cycle(0, tiny("torch"), strategy, engine, lambda: calls.append("train"), got)
    assert got.errors == []
    train = calls.index("train")
    assert calls[train + 1 : train + 3] == ["synchronize", "to_rollout"]
    assert got.train_drain_s == [pytest.approx(0.5)]
    assert got.to_rollout_s == [pytest.approx(0.25)]  # the switch's own time only
    assert got.to_trainer_s == [pytest.approx(0.125)]
    assert got.summary()["train_drain_s"] == pytest.approx(0.5)


def test_the_longer_training_and_rollout_are_waited_untimed_in_their_places(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--train-s`` waits after the step, before the switch; ``--rollout-s`` after generating."""
    import dataclasses

    engine = _cycle_fakes(monkeypatch)
    script = _Script(monkeypatch)
    calls = script.calls

    def sleep(seconds: float) -> None:
        calls.append(f"wait {seconds:g}")
        script.now += seconds

    monkeypatch.setattr(time, "sleep", sleep)
    engine.call = lambda *command: script.step(0.0, command[0], ("ok", 0, 0))()
    strategy = SimpleNamespace(
        train_scope=contextlib.nullcontext,
        to_rollout=script.step(0.25, "to_rollout"),
        to_trainer=script.step(0.125, "to_trainer"),
    )
    p = dataclasses.replace(tiny("torch"), train_s=1.5, rollout_s=2.0)
    got = figures("hybridmem", to_rollout_s=[], to_trainer_s=[])
    bench_run._cycle(0, p, strategy, engine, lambda: calls.append("train"), got)
    assert got.errors == []
    assert calls[: calls.index("to_trainer") + 1] == [
        "train",
        "wait 1.5",
        "to_rollout",
        "generate",
        "wait 2",
        "to_trainer",
    ]
    assert got.to_rollout_s == [pytest.approx(0.25)]  # neither wait is the switch's
    assert got.to_trainer_s == [pytest.approx(0.125)]
    assert got.train_drain_s == [0.0]
    calls.clear()
    bench_run._cycle(1, tiny("torch"), strategy, engine, lambda: calls.append("train"), got)
    assert not [c for c in calls if c.startswith("wait")]  # none by default


def _client_on(fake: Any, conn_answers: dict[str, tuple[Any, ...]]) -> Any:
    from hybridmem.bench import engine as bench_engine

    conn = ScriptedChannel(answer=lambda command: [conn_answers[command[0]]])
    return bench_engine.EngineClient(conn, 0, H200)  # type: ignore[arg-type]


def test_the_hand_back_is_read_after_the_switch_with_the_kv_wake_given_back(
    fake_gpu: Any,
) -> None:
    """The figure of the moment before the KV wake, read once the switch is done."""
    from hybridmem.bench.figures import handback_ratio

    device = fake_gpu.devices[0]  # the trainer: 2 GiB allocated, 10 GiB reserved
    device.reserved = device.allocated  # released: nothing cached
    engine: dict[str, tuple[Any, ...]] = {
        "stats": ("ok", 3 * GiB, 3 * GiB + 64 * 2**20),
        "anatomy": ("ok", {}),
    }

    def wake_taking(nbytes: int) -> Any:
        def wake(command: Any) -> list[Any]:
            device.other += nbytes  # the engine's KV cache, on the same GPU
            return [("ok", nbytes)]

        return wake

    answers = dict(engine)
    client = _client_on(fake_gpu, answers)
    client.read_handback()  # no KV wake yet: nothing read
    assert client.last_handback == 0.0
    free_before = device.free
    client.conn.answer = lambda c: wake_taking(40 * GiB)(c) if c[0] == "wake" else [answers[c[0]]]
    fake_gpu.events.clear()
    # A 20 MiB page that holds a kept tensor's last KiB: its free part counts as kept.
    page = 20 << 20
    fake_gpu.allocator_snapshot = {
        "segments": [
            {
                "address": 0,
                "total_size": 2 * page,
                "is_expandable": True,
                "segment_type": "large",
                "blocks": [
                    {"address": 0, "size": page + 1024, "state": "active_allocated"},
                    {"address": page + 1024, "size": page - 1024, "state": "inactive"},
                ],
            }
        ]
    }
    client.resume_memory_occupation(["kv_cache"])
    assert not [e for e in fake_gpu.events if e.startswith("sync:")]  # copies may still run
    assert client.last_kv == 40 * GiB
    client.read_handback()
    # As read before the wake: free memory over free plus both processes' caches.
    cached_engine = 64 * 2**20
    assert client.last_handback == pytest.approx(free_before / (free_before + cached_engine))
    assert client.last_handback == handback_ratio(
        free_before,
        device.total,
        device.allocated + 3 * GiB,
        device.total - free_before - device.reserved - engine["stats"][2],
    )
    assert client.last_missing["trainer_cached"] == 0
    assert client.last_missing["engine_cached"] == cached_engine
    assert client.last_handback_pages == handback_ratio(
        free_before,
        device.total,
        device.allocated + 3 * GiB + page - 1024,
        device.total - free_before - device.reserved - engine["stats"][2],
    )
    assert client.last_handback_pages > client.last_handback
    fake_gpu.allocator_snapshot = None  # none to read pages from: no figure
    # Copies that landed after the KV wake and left 1 GiB cached: the shortfall shows.
    client.resume_memory_occupation(["kv_cache"])
    device.reserved += GiB
    client.read_handback()
    assert client.last_missing["trainer_cached"] == GiB
    assert client.last_handback < 0.99
    assert client.last_handback_pages is None
    before = client.last_handback
    client.read_handback()  # read once per KV wake
    assert client.last_handback == before


def test_the_shortfall_names_what_the_trainers_communicators_hold(
    fake_gpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL's buffers held through the rollout: their own part, out of the context's growth."""
    from hybridmem.observe import memory as observe_memory
    from hybridmem.observe.communicators import CommunicatorMemory

    device = fake_gpu.devices[0]
    device.reserved = device.allocated
    held = [
        CommunicatorMemory(
            "0",
            "default_pg",
            "nccl",
            (0,),
            0,
            True,
            s,
            96 << 20,
            s + (96 << 20),
            False,
            "ncclCommMemStats",
        )
        for s in (512 << 20, 0)
    ]
    monkeypatch.setattr(observe_memory, "communicator_memory", lambda index: tuple(held))

    def wake(command: Any) -> list[Any]:
        if command[0] == "wake":
            device.other += 8 * GiB
            return [("ok", 8 * GiB)]
        return [{"stats": ("ok", GiB, GiB), "anatomy": ("ok", {})}[command[0]]]

    client = _client_on(fake_gpu, {})
    client.conn.answer = wake
    device.other += (512 << 20) + 2 * (96 << 20)  # what NCCL allocated after the start
    client.resume_memory_occupation(["kv_cache"])
    client.read_handback()
    # what a suspend would give back is missing; the persistent part is context
    assert client.last_missing["communicators"] == 512 << 20
    assert client.last_missing["context_growth"] == 2 * (96 << 20)
    held_back = client.last_handback
    assert held_back < 0.995
    held[0] = dataclasses.replace(held[0], suspended=True)  # hm.suspend_communicators()
    device.other -= 512 << 20
    client.resume_memory_occupation(["kv_cache"])
    client.read_handback()
    assert client.last_missing["communicators"] == 0
    assert client.last_handback == pytest.approx(1.0)
    assert client.last_handback > held_back


def test_the_rollout_and_training_lengths_are_checked_where_they_are_given() -> None:
    from hybridmem.bench.plan import with_phase_lengths

    p = scale_plan(H200, 8)
    longer = with_phase_lengths(p, rollout_s=2, train_s=1)
    assert (longer.rollout_s, longer.train_s) == (2.0, 1.0)
    assert longer.layers == p.layers  # the rest of the plan as it was
    with pytest.raises(ValueError, match="rollout_s must be seconds from 0 to 600"):
        with_phase_lengths(p, rollout_s=-0.5, train_s=0)
    with pytest.raises(TypeError, match="rollout_s must be seconds"):
        with_phase_lengths(p, rollout_s="1s", train_s=0)
    with pytest.raises(ValueError, match="train_s must be seconds from 0 to 600"):
        with_phase_lengths(p, rollout_s=0, train_s=601)
    assert scale_plan(H200, 8).rollout_s == 0.0  # the bench's own rollout by default
    assert scale_plan(H200, 8).train_s == 0.0  # and its own training


def test_an_engine_out_of_memory_at_generate_is_the_cycles_error_and_the_cycle_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fixed share that leaves the rollout short: said per cycle, the switch back still run.

    On an H100 (2026-12-06, need 1, the fixed half) the engine's generate ran out of
    memory and the engine process died; the table said only that the engine died.
    """
    from hybridmem.bench import engine as bench_engine
    from hybridmem.bench.strategies import Moved

    engine = _cycle_fakes(monkeypatch)
    script = _Script(monkeypatch)

    def call(*command: Any) -> tuple[Any, ...]:
        if command[0] == "generate":
            raise bench_engine.EngineOutOfMemory(
                "the engine ran out of device memory in 'generate': CUDA out of memory."
            )
        return ("ok", 0, 0)

    engine.call = call
    strategy = SimpleNamespace(
        train_scope=contextlib.nullcontext,
        to_rollout=script.step(0.25, "to_rollout", Moved(copy_bytes=2 * GiB)),
        to_trainer=script.step(0.125, "to_trainer"),
    )
    got = figures("fraction", to_rollout_s=[], to_trainer_s=[])
    got.need, got.deficit_bytes = 1.0, int(3.75 * GiB)
    bench_run._cycle(2, tiny("torch"), strategy, engine, lambda: None, got)
    assert got.errors == [
        "cycle 2: the engine ran out of device memory in 'generate': CUDA out of memory; "
        "the switch moved 2.00 GiB where the rollout lacked 3.75 GiB"
    ]
    assert script.calls == ["to_rollout", "to_trainer"]  # the switch back still ran
    assert got.to_trainer_s == [pytest.approx(0.125)]


def test_the_engine_answers_a_failed_command_instead_of_dying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from hybridmem.bench import engine as bench_engine

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    class Engine:
        def __init__(self, error: BaseException | None) -> None:
            self.error = error

        def run(self, command: str, args: list[Any]) -> tuple[Any, ...]:
            if self.error is not None:
                raise self.error
            return ("ok", command)

    oom = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "79.18 GiB of which 8.62 MiB is free. Process 1674 has 5.23 GiB memory in use."
    )
    assert bench_engine.answer(Engine(oom), "generate", []) == (
        "oom",
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "79.18 GiB of which 8.62 MiB is free.",
    )
    assert emptied == [True]  # what the failed command left cached goes back
    assert bench_engine.answer(Engine(AssertionError("no weights")), "sync_bucket", []) == (
        "error",
        "AssertionError: no weights",
    )
    assert bench_engine.answer(Engine(None), "sleep", []) == ("ok", "sleep")
    assert emptied == [True]


def test_the_engine_client_raises_the_engines_out_of_memory_by_its_type() -> None:
    from hybridmem.bench import engine as bench_engine

    answers = {"generate": ("oom", "CUDA out of memory."), "sync_tensors": ("error", "x")}
    conn = ScriptedChannel(answer=lambda command: [answers[command[0]]])
    client = bench_engine.EngineClient(conn, 0, H200)  # type: ignore[arg-type]
    with pytest.raises(bench_engine.EngineOutOfMemory, match="in 'generate': CUDA out of memory"):
        client.call("generate", 128)
    with pytest.raises(RuntimeError, match=r"engine answered \('error', 'x'\)") as other:
        client.call("sync_tensors", {})
    assert not isinstance(other.value, bench_engine.EngineOutOfMemory)


def test_a_run_cut_short_keeps_every_strategy_that_finished(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A --need run of many minutes killed by a time limit in its last strategy: the
    # strategies before it are in --json, marked unfinished, and --from-json prints them.
    def child(name: str, p: BenchPlan, timeline: str | None) -> dict[str, Any]:
        if p.need == 1 and name == "planned":
            raise KeyboardInterrupt  # the time limit's signal, mid-strategy
        return {"summary": figures(name, state_bytes=p.state_bytes).summary()}

    an_h200_running(monkeypatch, child)
    out = tmp_path / "need.json"
    argv = ["bench", "--scale", "8", "--need", "0.5", "1", "--cycles", "6"]
    with pytest.raises(KeyboardInterrupt):
        main([*argv, "--strategies", "hybridmem", "planned", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["unfinished"] is True
    assert saved["verdicts"] == []
    assert [(size["need"], sorted(size["results"])) for size in saved["scale"]] == [
        (0.5, ["hybridmem", "planned"]),
        (1, ["hybridmem"]),
    ]
    capsys.readouterr()
    assert main(["bench", "--from-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "planned" in printed
    assert "hybridmem" in printed


def test_a_finished_run_replaces_what_it_saved_so_far(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[dict[str, Any]] = []
    out = tmp_path / "quick.json"

    def child(name: str, p: BenchPlan, timeline: str | None) -> dict[str, Any]:
        if out.exists():  # what a run cut short here would have kept
            seen.append(json.loads(out.read_text()))
        return {"summary": figures(name, state_bytes=p.state_bytes).summary()}

    an_h200_running(monkeypatch, child)
    assert main(["bench", "--quick", "--strategies", "naive", "hybridmem", "--json", str(out)]) == 0
    assert [sorted(s["results"]) for s in seen] == [["naive"]]
    assert seen[0]["unfinished"] is True
    final = json.loads(out.read_text())
    assert "unfinished" not in final
    assert sorted(final["results"]) == ["hybridmem", "naive"]
    assert final["verdicts"]


def test_communicators_are_checked_where_they_are_given() -> None:
    from hybridmem.bench.plan import MAX_COMMUNICATORS, plan, with_communicators

    p = plan(141 * GiB, quick=True)
    assert with_communicators(p, 5).communicators == 5
    assert with_communicators(p, 5).as_dict()["communicators"] == 5
    with pytest.raises(TypeError, match="communicators must be an int"):
        with_communicators(p, 2.5)
    with pytest.raises(ValueError, match=f"0 to {MAX_COMMUNICATORS}"):
        with_communicators(p, MAX_COMMUNICATORS + 1)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--communicators", "-1"], "--communicators must be 0 to 64"),
        (["--communicators", "2", "--scale"], "leave out --scale"),
    ],
)
def test_the_cli_refuses_communicators_it_cannot_run(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridmem.cli import main

    with pytest.raises(SystemExit):
        main(["bench", *argv])
    assert said in capsys.readouterr().err


def test_the_suspended_strategy_holds_the_scope_from_rollout_to_trainer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybridmem.bench import strategies

    calls: list[str] = []

    class Scope:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> None:
            calls.append("suspend")

        def __exit__(self, *exc: object) -> None:
            calls.append("resume")

    monkeypatch.setattr(strategies, "SuspendCommunicators", Scope)
    monkeypatch.setattr(strategies.Hybridmem, "__init__", lambda self, *a: None)

    def to_rollout(self: Any) -> strategies.Moved:
        calls.append("switch to rollout")
        return strategies.Moved(stages={"wake": 1.0})

    def to_trainer(self: Any) -> strategies.Moved:
        calls.append("switch to trainer")
        return strategies.Moved()

    monkeypatch.setattr(strategies.Hybridmem, "to_rollout", to_rollout)
    monkeypatch.setattr(strategies.Hybridmem, "to_trainer", to_trainer)
    strategy = strategies.strategy_classes()["suspended"]()  # type: ignore[call-arg]
    out = strategy.to_rollout()
    back = strategy.to_trainer()
    assert calls == ["suspend", "switch to rollout", "switch to trainer", "resume"]
    assert list(out.stages) == ["suspend communicators", "wake"]
    assert "resume communicators" in back.stages
