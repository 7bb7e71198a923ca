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
    """Saved results at one size and share: offload-all, planned and a fixed half.

    Each switch copies at ``slow`` x the pinned rate (54 GB/s) beside 20 ms of engine
    wakes and 6 ms of weight sync; back at ``slow`` x the pinned rate, which kernels
    copy at 0.8 of.
    """
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
                moved_bytes=int(optimizer),
                copied_bytes=[int(copied)] * 6,
                to_rollout_s=[seconds + 0.026] * 6,
                to_trainer_s=[seconds + 0.03] * 6,
                engine_wake_s=[0.02] * 6,
                engine_sleep_s=[0.03] * 6,
                sync_s=[0.006] * 6,
                release_to_rollout_s=[0.0] * 6,
                release_to_trainer_s=[0.0] * 6,
                kernel_gbps=54.0 * 0.8,
                kv_target=40 * GiB,
                kv_obtained=[40 * GiB] * 6,
                handback=[0.9999] * 6,
                handback_pages=[0.99995] * 6,
            ).summary()
        }
    return {"state_gib": gib, "need": need, "plan": {}, "results": results}


def _said(judged: list[str], start: str) -> str:
    (line,) = [line for line in judged if line.startswith(start)]
    return line


def test_the_need_table_and_verdicts_follow_the_deficit() -> None:
    points = [_point(32, 0.0, 0.0), _point(32, 0.5, 8.0), _point(64, 1.0, 32.0, slow=1.3)]
    assert is_need_run(points)
    assert not is_need_run([{"state_gib": 8, "results": {}}])
    table = "\n".join(format_need_table(points))
    assert "== 32 GiB of trainer state, the rollout 50% of the optimizer state short" in table
    assert "(8.00 GiB with everything on the device)" in table
    assert "40.0/40.0" in table  # KV obtained / asked
    assert "a warm-up" in table
    judged = need_verdicts(points)
    assert _said(judged, "32 GiB, need 0%, planned: nothing").endswith("0.00 GiB copied: met")
    assert _said(judged, "32 GiB, need 0%, planned to rollout:").startswith(
        "32 GiB, need 0%, planned to rollout: 1.00x what every strategy pays"
    )
    assert _said(judged, "32 GiB, need 0%, planned to trainer:").endswith(
        "nothing to reload, 0.030 s: met"
    )
    half = _said(judged, "32 GiB, need 50%, planned to rollout:")
    assert "8.00 GiB copied, weight sync 6.0 ms, engine wakes 20.0 ms" in half
    assert half.endswith(": met")
    back = _said(judged, "32 GiB, need 50%, planned to trainer:")
    assert back.startswith(
        "32 GiB, need 50%, planned to trainer: 0.84x its bytes at the kernels' copy rate"
    )
    assert "1.05x at the pinned rate, kernels at 0.80 of it" in back
    assert _said(judged, "32 GiB, need 50%, planned to rollout against offload-all").endswith("met")
    # Partial: judged with the pages that hold kept state not reclaimable, raw beside.
    kept = _said(judged, "32 GiB, need 50%, planned: KV")
    assert "hand-back 0.999950 with the pages that hold kept state not reclaimable" in kept
    assert "(target >= 0.9995; 0.999900 raw)" in kept
    # Full plans (offload-all everywhere, planned at need 1): the raw hand-back, 0.9997.
    assert "hand-back 0.999900 raw (target >= 0.9997): met" in _said(
        judged, "32 GiB, need 50%, offload-all: KV"
    )
    slow = _said(judged, "64 GiB, need 100%, planned to rollout:")
    assert slow.startswith("64 GiB, need 100%, planned to rollout: 1.29x what every")
    assert slow.endswith("NOT met")
    assert not [line for line in judged if line.startswith("32 GiB, need 50%, fraction")]
    # a planned switch that copied where nothing was short fails its verdict
    wrong = _point(8, 0.0, 2.0)
    assert _said(need_verdicts([wrong]), "8 GiB, need 0%, planned: nothing").endswith(
        "2.00 GiB copied: NOT met"
    )


def test_the_to_rollout_verdict_allows_what_every_strategy_pays_and_nothing_else() -> None:
    # 0.25 GiB copied at the pinned rate, 6 ms of weight sync and 20 ms of engine wakes:
    # 1.0x. A release of 7 ms more is the switch's own: over 1.1x at these seconds.
    copies = 0.25 * GiB / 54e9
    row = figures(
        "planned",
        need=0.25,
        deficit_bytes=GiB // 50,
        copied_bytes=[GiB // 4] * 6,
        to_rollout_s=[copies + 0.026] * 6,
        engine_wake_s=[0.02] * 6,
        sync_s=[0.006] * 6,
    ).summary()
    assert row["to_rollout_over_paid"] == pytest.approx(1.0)
    released = figures(
        "planned",
        need=0.25,
        deficit_bytes=GiB // 50,
        copied_bytes=[GiB // 4] * 6,
        to_rollout_s=[copies + 0.026 + 0.007] * 6,
        engine_wake_s=[0.02] * 6,
        sync_s=[0.006] * 6,
    ).summary()
    assert released["to_rollout_over_paid"] == pytest.approx((copies + 0.033) / (copies + 0.026))
    point: dict[str, Any] = {"state_gib": 8, "need": 0.25, "plan": {}}
    point["results"] = {"planned": {"summary": released}}
    to_rollout = _said(need_verdicts([point]), "8 GiB, need 25%, planned to rollout")
    assert to_rollout.endswith("NOT met")
    # The first cycle is a warm-up; the worst of the others is said beside the median.
    uneven = figures(
        "planned",
        need=0.25,
        deficit_bytes=GiB // 50,
        copied_bytes=[GiB // 4] * 6,
        to_rollout_s=[1.0] + [copies + 0.026] * 4 + [2 * (copies + 0.026)],
        engine_wake_s=[0.02] * 6,
        sync_s=[0.006] * 6,
    ).summary()
    assert uneven["to_rollout_over_paid"] == pytest.approx(1.0)
    assert uneven["to_rollout_over_paid_worst"] == pytest.approx(2.0)
    point["results"]["planned"]["summary"] = uneven
    assert "1.00x what every strategy pays, worst 2.00" in _said(
        need_verdicts([point]), "8 GiB, need 25%, planned to rollout"
    )
    saved_before = figures("planned", to_rollout_s=[0.1] * 6).summary()  # no sync timed
    assert saved_before["to_rollout_over_paid"] is None


def test_the_planned_switch_never_loses_to_offload_all() -> None:
    point = _point(32, 1.0, 16.0)
    rows = {name: r["summary"] for name, r in point["results"].items()}
    rows["planned"]["to_trainer_s"] = rows["hybridmem"]["to_trainer_s"] * 1.06
    judged = need_verdicts([point])
    assert _said(judged, "32 GiB, need 100%, planned to rollout against offload-all").endswith(
        "(target <= 1.05x): met"
    )
    assert _said(judged, "32 GiB, need 100%, planned to trainer against offload-all").endswith(
        "1.06x (target <= 1.05x): NOT met"
    )


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


def test_a_verdict_not_met_names_the_switchs_longest_stages() -> None:
    point = _point(64, 1.0, 32.0, slow=1.3)
    planned = point["results"]["planned"]["summary"]
    stages = {"plan": 0.4, "offload": 600.0, "weight_sync": 9.0, "outside stages": 3.5}
    planned["stages_to_rollout_ms"] = {f"s{i}": 0.01 for i in range(4)} | stages
    judged = need_verdicts([point])
    assert _said(judged, "64 GiB, need 100%, planned to rollout:").endswith(
        "NOT met; longest stages (ms, median): offload 600.00, weight_sync 9.00, "
        "outside stages 3.50, plan 0.40, s0 0.01"
    )
    assert _said(judged, "64 GiB, need 100%, offload-all to rollout:").endswith("NOT met")
    met = need_verdicts([_point(32, 0.5, 8.0)])
    assert _said(met, "32 GiB, need 50%, planned to rollout:").endswith(": met")


def test_a_failed_strategy_is_its_points_verdict() -> None:
    point = _point(8, 1.0, 4.0)
    point["results"]["planned"]["summary"]["errors"] = ["cycle 0: the engine ran out of memory"]
    assert _said(need_verdicts([point]), "8 GiB, need 100%, planned").endswith(
        "NOT met: cycle 0: the engine ran out of memory"
    )


def test_the_kv_verdict_says_what_failed() -> None:
    point = _point(32, 0.5, 8.0)
    rows = {name: r["summary"] for name, r in point["results"].items()}
    rows["planned"]["handback_pages"] = 0.999499  # under 0.9995, though 4 decimals round it up
    assert need_verdicts([point])[-1].endswith(
        "(target >= 0.9995; 0.999900 raw): NOT met: the hand-back is under its target"
    )
    rows["planned"]["handback_pages"] = 0.9999
    rows["hybridmem"]["handback"] = 0.99969  # a full plan is judged raw, at 0.9997
    rows["hybridmem"]["handback_worst"] = 0.99969
    assert _said(need_verdicts([point]), "32 GiB, need 50%, offload-all: KV").endswith(
        "hand-back 0.999690 raw (target >= 0.9997): NOT met: the hand-back is under its target"
    )
    rows["hybridmem"]["handback"] = 0.9999
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
    assert any(v.startswith("8 GiB, need 0%, planned: nothing short") for v in saved["verdicts"])
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


def test_offload_all_is_a_full_plan_whatever_its_byte_counts_round_to() -> None:
    # Saved H100 results: offload-all copied 4.0001373 GiB of a 4.0001376 GiB state (the
    # two counts differ by a few hundred bytes): still a full plan, judged raw.
    point = _point(8, 0.25, 1.0)
    rows = {name: r["summary"] for name, r in point["results"].items()}
    rows["hybridmem"]["copied_gib"] = rows["hybridmem"]["moved_gib"] - 3e-7
    rows["hybridmem"]["handback_pages"] = None
    line = _said(need_verdicts([point]), "8 GiB, need 25%, offload-all: KV")
    assert line.endswith("hand-back 0.999900 raw (target >= 0.9997): met")
    # A planned switch that kept less than a MiB of the state moved it all: judged raw.
    rows["planned"]["copied_gib"] = rows["planned"]["moved_gib"] - 3e-7
    assert "0.999900 raw (target >= 0.9997)" in _said(
        need_verdicts([point]), "8 GiB, need 25%, planned: KV"
    )


def test_a_partial_plan_saved_without_a_page_count_is_said_not_failed() -> None:
    point = _point(8, 0.25, 1.0)
    point["results"]["planned"]["summary"]["handback_pages"] = None
    line = _said(need_verdicts([point]), "8 GiB, need 25%, planned: KV")
    assert "hand-back 0.999900 raw" in line
    assert "not judged, these results have no page count" in line
    assert line.endswith(": met for the KV cache")
    point["results"]["planned"]["summary"]["kv_obtained_gib"] = 39.0
    line = _said(need_verdicts([point]), "8 GiB, need 25%, planned: KV")
    assert line.endswith("NOT met: the KV cache is short")
