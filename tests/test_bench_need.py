"""``hybridmem bench --scale --need``: the KV cache sized to a shortfall, the strategies
compared at it, the table, the verdicts, the plot and the CLI (its misuse: test_bench_scale.py).

The runs themselves need a GPU; here every child is faked and everything else is real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridmem.bench.need_report import (
    format_need_table,
    is_need_run,
    need_verdicts,
    plot_need,
)
from hybridmem.bench.outputs import merge_scale
from hybridmem.bench.plan import (
    ANATOMY_NOTE,
    FIXED_FRACTION,
    NEED_SPARE_BYTES,
    NEED_STRATEGIES,
    BenchPlan,
    check_need,
    choose_strategies,
    need_kv_target,
)
from hybridmem.bench.report import scale_verdicts, verdicts
from hybridmem.bench.strategies import fixed_share, strategy_classes
from hybridmem.cli import main
from tests.test_bench import figures
from tests.test_bench_scale import an_h200_running

GiB = 2**30
MiB = 2**20
H200 = 141 * GiB
MARGIN = 256 * MiB


@pytest.mark.parametrize("need", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("step", [GiB, 32 * MiB, 2 * MiB])
@pytest.mark.parametrize("odd", [0, 13 * MiB + 512])  # free memory is no round number
def test_the_kv_cache_leaves_the_rollout_that_share_short(need: float, step: int, odd: int) -> None:
    free, weights, optimizer = 90 * GiB + odd, 16 * GiB, 32 * GiB
    kv, deficit = need_kv_target(free, weights, optimizer, need, MARGIN, step=step)
    assert kv % step == 0  # whole steps, as the bench's engine allocates its cache
    assert deficit == max(0, weights + kv + MARGIN - free)
    if need == 0:  # nothing short, with room for the contexts to grow
        assert deficit == 0
        assert weights + kv + MARGIN + NEED_SPARE_BYTES <= free
    else:  # the share asked for, less the cut to whole steps, and never all of it
        asked = min(need * optimizer, optimizer - NEED_SPARE_BYTES)
        assert asked - step < deficit <= asked
    # with the optimizer state offloaded but its spare, the rollout fits
    assert weights + kv + MARGIN <= free + optimizer - NEED_SPARE_BYTES


def test_a_small_state_is_short_by_its_share_not_by_a_gib_cut() -> None:
    # An 8 GiB trainer state: 4 GiB of optimizer state, 2 GiB of weights. Cut to whole
    # GiB, "25% short" (1 GiB) lost up to a GiB to the cut (0.02 GiB was left on an
    # H100); cut to the engine's 32 MiB unit (16 pieces of 2 MiB pages), under 32 MiB.
    free, weights, optimizer = 70 * GiB + 13 * MiB, 2 * GiB, 4 * GiB
    coarse = need_kv_target(free, weights, optimizer, 0.25, MARGIN, step=GiB)[1]
    fine = need_kv_target(free, weights, optimizer, 0.25, MARGIN, step=32 * MiB)[1]
    assert coarse < 0.25 * GiB
    assert GiB - 32 * MiB < fine <= GiB
    # Both ends keep the spare, for the contexts' growth between the sizing and the
    # switch: "all of it short" stays coverable, "nothing short" stays so.
    whole = need_kv_target(free, weights, optimizer, 1.0, MARGIN, step=32 * MiB)[1]
    assert optimizer - NEED_SPARE_BYTES - 32 * MiB < whole <= optimizer - NEED_SPARE_BYTES
    kv, none = need_kv_target(free, weights, optimizer, 0.0, MARGIN, step=32 * MiB)
    assert none == 0
    assert NEED_SPARE_BYTES <= free - (weights + kv + MARGIN) < NEED_SPARE_BYTES + 32 * MiB
    for bad in (0, -1, 1.5, True):
        with pytest.raises((TypeError, ValueError), match="step"):
            need_kv_target(free, weights, optimizer, 0.25, MARGIN, step=bad)  # type: ignore[arg-type]
    for bad in (-1, 0.5, False):
        with pytest.raises((TypeError, ValueError), match="spare"):
            need_kv_target(free, weights, optimizer, 0.25, MARGIN, spare=bad)  # type: ignore[arg-type]


def test_a_need_with_nothing_short_copies_nothing_and_bad_needs_are_refused() -> None:
    assert need_kv_target(90 * GiB, 16 * GiB, 32 * GiB, 0.0, MARGIN)[1] == 0
    with pytest.raises(ValueError, match="no KV cache fits"):
        need_kv_target(10 * GiB, 16 * GiB, 4 * GiB, 0.0, MARGIN)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="need"):
            check_need(bad)
    with pytest.raises(TypeError, match="need"):
        check_need("half")


def test_the_need_strategies_are_known_to_the_bench() -> None:
    assert NEED_STRATEGIES == ("hybridmem", "planned", "fraction")
    classes = strategy_classes()
    assert {name: classes[name].name for name in NEED_STRATEGIES} == {n: n for n in NEED_STRATEGIES}
    assert choose_strategies(["planned", "fraction"], tms=False) == (["planned", "fraction"], "")
    # the default run is unchanged: the need strategies run with --need
    assert "planned" not in choose_strategies(None, tms=True)[0]


def test_a_fixed_fraction_takes_whole_parameter_states_up_to_its_share() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    states = list(optimizer.state.values())

    def size(chosen: list[dict[str, Any]]) -> int:
        return sum(t.nbytes for s in chosen for t in s.values() if t.numel() > 1)

    half = fixed_share(optimizer, FIXED_FRACTION)
    assert half == states[: len(half)]  # the first ones, in order, each whole
    assert size(half) >= FIXED_FRACTION * size(states)
    assert size(half[:-1]) < FIXED_FRACTION * size(states)  # no more than the share needs
    assert fixed_share(optimizer, 0.0) == []
    assert fixed_share(optimizer, 1.0) == states


def test_with_need_the_ceiling_is_each_strategys_own_copied_bytes() -> None:
    planned = figures(
        "planned",
        need=0.5,
        deficit_bytes=16 * GiB,
        copied_bytes=[16 * GiB] * 4,
        moved_bytes=32 * GiB,  # the whole optimizer state: not what planned copies
        pinned_gbps=54.0,
        to_rollout_s=[16 * GiB / 54e9] * 4,
    ).summary()
    assert planned["ceiling_s"] == pytest.approx(16 * GiB / 54e9)
    assert planned["to_rollout_over_ceiling"] == pytest.approx(1.0)
    assert (planned["copied_gib"], planned["deficit_gib"]) == (16.0, 16.0)
    nothing = figures("planned", need=0.0, copied_bytes=[0] * 4).summary()
    assert nothing["ceiling_s"] is None  # nothing copied: no ratio, the verdict says so
    plain = figures("hybridmem", moved_bytes=32 * GiB, copied_bytes=[GiB] * 4).summary()
    assert plain["ceiling_s"] == pytest.approx(32 * GiB / 54e9)  # without --need: as before


def _point(gib: float, need: float, planned_copied: float, slow: float = 1.05) -> dict[str, Any]:
    """Saved results at one size and share: offload-all, planned and a fixed half."""
    optimizer = gib * GiB / 2
    deficit = int(need * optimizer)
    results = {}
    for name, copied in (
        ("hybridmem", optimizer),
        ("planned", planned_copied * GiB),
        ("fraction", optimizer / 2),
    ):
        seconds = copied / 54e9 * slow
        results[name] = {
            "summary": figures(
                name,
                need=need,
                deficit_bytes=deficit,
                copied_bytes=[int(copied)] * 4,
                to_rollout_s=[seconds + 0.02] * 4,
                to_trainer_s=[seconds + 0.03] * 4,
                engine_wake_s=[0.02] * 4,
                engine_sleep_s=[0.03] * 4,
                kv_target=40 * GiB,
                kv_obtained=[40 * GiB] * 4,
                handback=[0.9999] * 4,
            ).summary()
        }
    return {"state_gib": gib, "need": need, "plan": {}, "results": results}


def test_the_need_table_and_verdicts_follow_the_deficit() -> None:
    points = [_point(32, 0.0, 0.0), _point(32, 0.5, 8.0), _point(64, 1.0, 32.0, slow=1.3)]
    assert is_need_run(points)
    assert not is_need_run([{"state_gib": 8, "results": {}}])
    table = "\n".join(format_need_table(points))
    assert "== 32 GiB of trainer state, the rollout 50% of the optimizer state short" in table
    assert "(8.00 GiB with everything on the device)" in table
    assert "40.0/40.0" in table  # KV obtained / asked
    judged = need_verdicts(points)
    assert judged[0] == "32 GiB, need 0%: nothing short, 0.00 GiB copied: met"
    assert judged[1].startswith("32 GiB, need 0%: KV cache 40.0 of 40.0 GiB, hand-back 0.9999")
    assert judged[2].startswith("32 GiB, need 50% to rollout: 1.05x its 8.00 GiB at the pinned")
    assert judged[2].endswith(": met")
    assert "1.30x its 32.00 GiB" in judged[5]
    assert judged[5].endswith("NOT met")
    # a planned switch that copied where nothing was short fails its verdict
    wrong = _point(8, 0.0, 2.0)
    assert need_verdicts([wrong])[0].endswith("2.00 GiB copied: NOT met")


def test_verdicts_of_a_run_under_anatomy_say_their_seconds_diagnose(tmp_path: Path) -> None:
    point = _point(8, 0.5, 2.0)
    plain = need_verdicts([point])
    assert ANATOMY_NOTE not in plain
    point["results"]["planned"]["raw"] = {"anatomy": [{"trainer": {}, "engine": {}}]}
    judged = need_verdicts([point])
    assert judged == [ANATOMY_NOTE, *plain]  # first, once, nothing else changed
    # read back (--from-json), the saved run still says it
    saved = tmp_path / "need.json"
    saved.write_text(json.dumps({"scale": [point], "verdicts": judged}))
    out = tmp_path / "again.json"
    assert main(["bench", "--from-json", str(saved), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["verdicts"][0] == ANATOMY_NOTE
    # the plain and the scale verdicts alike
    rows = {"hybridmem": figures("hybridmem").summary()}
    assert verdicts(rows, {"hybridmem": {"anatomy": [{}]}})[0] == ANATOMY_NOTE
    assert ANATOMY_NOTE not in verdicts(rows, {"hybridmem": {"anatomy": []}})
    result: dict[str, Any] = {"summary": rows["hybridmem"]}
    size = {"state_gib": 8, "plan": {}, "results": {"hybridmem": result}}
    assert ANATOMY_NOTE not in scale_verdicts([size])
    result["raw"] = {"anatomy": [{}]}
    assert scale_verdicts([size])[0] == ANATOMY_NOTE


def test_the_verdict_allows_the_releases_where_they_were_timed() -> None:
    # 0.25 GiB copied at the pinned rate in 1.05x its time, plus 7 ms of releases each
    # way beside the engine's calls: over 1.1x with them, within it without them.
    copies = 0.25 * GiB / 54e9 * 1.05
    timed = figures(
        "planned",
        need=0.25,
        deficit_bytes=GiB // 50,
        copied_bytes=[GiB // 4] * 4,
        to_rollout_s=[copies + 0.02 + 0.007] * 4,
        to_trainer_s=[copies + 0.03 + 0.007] * 4,
        engine_wake_s=[0.02] * 4,
        engine_sleep_s=[0.03] * 4,
        release_to_rollout_s=[0.007] * 4,
        release_to_trainer_s=[0.007] * 4,
        kv_target=40 * GiB,
        kv_obtained=[40 * GiB] * 4,
        handback=[0.9999] * 4,
    ).summary()
    assert timed["to_rollout_over_ceiling_engine_and_release_aside"] == pytest.approx(1.05)
    assert timed["to_rollout_over_ceiling_engine_aside"] > 2
    assert timed["release_to_trainer_s"] == pytest.approx(0.007)
    point = {"state_gib": 8, "need": 0.25, "plan": {}, "results": {"planned": {"summary": timed}}}
    to_rollout, to_trainer, _ = need_verdicts([point])
    assert to_rollout.startswith("8 GiB, need 25% to rollout: 1.05x its 0.25 GiB at the pinned")
    assert "engine calls and the releases aside" in to_rollout
    assert to_rollout.endswith(": met")
    assert "x with the releases" in to_trainer
    assert "x -rel" in "\n".join(format_need_table([point]))
    # Saved before releases were timed: judged without the allowance, and saying so.
    del timed["to_rollout_over_ceiling_engine_and_release_aside"]
    old = need_verdicts([point])[0]
    assert "releases not timed" in old
    assert old.endswith("NOT met")


def test_the_to_rollout_verdict_shows_the_figure_with_the_weight_sync_aside() -> None:
    # 0.25 GiB copied in 1.05x its time at the pinned rate, then 6 ms of weight sync:
    # over the target with it, within 1.1x without (what the owner weighs).
    copies = 0.25 * GiB / 54e9 * 1.05
    row = figures(
        "planned",
        need=0.25,
        deficit_bytes=GiB // 50,
        copied_bytes=[GiB // 4] * 4,
        to_rollout_s=[copies + 0.02 + 0.001 + 0.006] * 4,
        to_trainer_s=[copies + 0.03] * 4,
        engine_wake_s=[0.02] * 4,
        engine_sleep_s=[0.03] * 4,
        release_to_rollout_s=[0.001] * 4,
        release_to_trainer_s=[0.0] * 4,
        sync_s=[0.006] * 4,
        kv_target=40 * GiB,
        kv_obtained=[40 * GiB] * 4,
        handback=[0.9999] * 4,
    ).summary()
    assert row["to_rollout_over_ceiling_engine_release_and_sync_aside"] == pytest.approx(1.05)
    assert row["sync_s"] == pytest.approx(0.006)
    point = {"state_gib": 8, "need": 0.25, "plan": {}, "results": {"planned": {"summary": row}}}
    to_rollout, to_trainer, _ = need_verdicts([point])
    assert "; 1.05x with the weight sync aside too (6.0 ms)" in to_rollout
    assert to_rollout.endswith("NOT met")  # judged with it, as the target says
    assert "weight sync" not in to_trainer  # the way back runs none
    old = figures("planned", to_rollout_s=[0.1] * 4, engine_wake_s=[0.0] * 4).summary()
    assert old["to_rollout_over_ceiling_engine_release_and_sync_aside"] is None  # not timed


def test_a_verdict_not_met_names_the_switchs_longest_stages() -> None:
    point = _point(64, 1.0, 32.0, slow=1.3)
    planned = point["results"]["planned"]["summary"]
    stages = {"plan": 0.4, "offload": 600.0, "weight_sync": 9.0, "outside stages": 3.5}
    planned["stages_to_rollout_ms"] = {f"s{i}": 0.01 for i in range(4)} | stages
    to_rollout, to_trainer, _ = need_verdicts([point])
    assert to_rollout.endswith(
        "NOT met; longest stages (ms, median): offload 600.00, weight_sync 9.00, "
        "outside stages 3.50, plan 0.40, s0 0.01"
    )
    assert to_trainer.endswith("NOT met")  # its stages were not saved: nothing said
    met = need_verdicts([_point(32, 0.5, 8.0)])[1]
    assert met.endswith(": met")


def test_the_kv_verdict_says_what_failed() -> None:
    point = _point(32, 0.5, 8.0)
    rows = {name: r["summary"] for name, r in point["results"].items()}
    rows["planned"]["handback"] = 0.999499  # under 0.9995, though four decimals round it up
    assert need_verdicts([point])[-1].endswith(
        "hand-back 0.999499 (target >= 0.9995): NOT met: the hand-back is under its target"
    )
    rows["planned"]["handback"] = 0.9999
    for row in rows.values():  # the device cannot hold it, whatever the strategy frees
        row["kv_obtained_gib"] = 39.875
    short = need_verdicts([point])[-1]
    assert "KV cache 39.9 of 40.0 GiB" in short
    assert short.endswith(
        "NOT met: the KV cache is short (offload-all got 39.88 GiB: the device's limit, "
        "not the plan's)"
    )
    rows["hybridmem"]["kv_obtained_gib"] = 40.0  # offload-all got it: the plan's fault
    assert need_verdicts([point])[-1].endswith("NOT met: the KV cache is short")


def test_the_need_plot_is_a_non_trivial_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "need.png"
    points = [_point(g, n, n * g / 2) for g in (8, 32) for n in (0.0, 0.5, 1.0)]
    plot_need(points, str(out))
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG")
    assert len(data) > 20_000


def test_merged_need_runs_keep_one_entry_per_size_and_share() -> None:
    first = [_point(8, 0.0, 0.0), _point(8, 0.5, 2.0)]
    again = [_point(8, 0.5, 1.5)]
    merged = merge_scale([first, again])
    assert [(m["state_gib"], m["need"]) for m in merged] == [(8, 0.0), (8, 0.5)]
    assert merged[1]["results"]["planned"]["summary"]["copied_gib"] == 1.5  # the later run


def test_bench_scale_need_runs_each_share_with_the_need_strategies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ran: list[tuple[str, int, float | None]] = []

    def child(name: str, p: BenchPlan, timeline: str | None) -> dict[str, Any]:
        ran.append((name, round(p.state_bytes / GiB), p.need))
        assert p.need is not None
        copied = int(p.need * p.state_bytes / 2) if name == "planned" else p.state_bytes // 2
        return {
            "summary": figures(
                name, need=p.need, deficit_bytes=copied, copied_bytes=[copied] * 4
            ).summary()
        }

    an_h200_running(monkeypatch, child)
    out = tmp_path / "need.json"
    code = main(["bench", "--scale", "8", "32", "--need", "0", "0.5", "--json", str(out)])
    assert code == 0
    assert ran == [(name, g, n) for g in (8, 32) for n in (0.0, 0.5) for name in NEED_STRATEGIES]
    saved = json.loads(out.read_text())
    assert [(s["state_gib"], s["need"]) for s in saved["scale"]] == [
        (8, 0.0),
        (8, 0.5),
        (32, 0.0),
        (32, 0.5),
    ]
    assert saved["verdicts"][0].startswith("8 GiB, need 0%: nothing short")
    printed = capsys.readouterr().out
    assert "the rollout 50% of the optimizer state short" in printed


def test_a_saved_need_that_is_not_a_share_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    point = _point(8, 0.5, 2.0)
    point["need"] = 7
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"scale": [point]}))
    assert main(["bench", "--from-json", str(path)]) == 2
    assert "a saved --need share must be from 0 to 1, got 7" in capsys.readouterr().err
