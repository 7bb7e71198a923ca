"""One timeline across processes: a trainer's and its engine's files, merged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.cli import main
from hybridmem.observe import plot
from hybridmem.observe.timeline import chrome_trace, process_label
from tests.conftest import FakeTorch

GiB = 1 << 30


def _event(
    name: str, start: float, pid: int, process: str, used: float, mine: float
) -> dict[str, Any]:
    memory = {
        "allocated": int(mine * GiB),
        "reserved": int((mine + 1) * GiB),
        "used": int(used * GiB),
    }
    return {
        "name": name, "kind": "phase", "backend": "bench", "start": start, "duration": 0.5,
        "device": 0, "rank": 0, "pid": pid, "thread": 1, "before": memory, "after": memory,
        "args": {}, "process": process,
    }  # fmt: skip


def _files(tmp_path: Path, *, engine_memory: bool = True) -> tuple[Path, Path]:
    trainer, engine = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    t = 1000.0
    trainer_lines, engine_lines = [], []
    for cycle in range(3):
        trainer_lines.append(_event("phase:train", t, 100, "trainer", 20, 3 + cycle * 0.1))
        trainer_lines.append(_event("bench:to_rollout", t + 0.5, 100, "trainer", 80, 1))
        engine_event = _event("engine:wake", t + 0.7, 200, "engine", 80, 75)
        if not engine_memory:
            engine_event["before"] = engine_event["after"] = {}
        engine_lines.append(engine_event)
        t += 2.0
    trainer.write_text("".join(json.dumps(e) + "\n" for e in trainer_lines))
    engine.write_text("".join(json.dumps(e) + "\n" for e in engine_lines))
    return trainer, engine


def test_rows_are_processes_in_order_of_their_first_event(tmp_path: Path) -> None:
    trainer, engine = _files(tmp_path)
    events = plot.load_events([engine, trainer])  # any order of files
    assert [e["start"] for e in events] == sorted(e["start"] for e in events)
    assert plot.processes(events) == [
        ((0, 100), "trainer (rank 0, pid 100)"),
        ((0, 200), "engine (rank 0, pid 200)"),
    ]
    assert process_label({"rank": 2, "pid": 7}) == "rank 2, pid 7"


def test_plot_and_merged_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trainer, engine = _files(tmp_path)
    out, trace = tmp_path / "merged.png", tmp_path / "merged.trace.json"
    assert main(["plot", str(trainer), str(engine), "-o", str(out), "--trace", str(trace)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    assert f"wrote {trace}" in printed
    assert out.stat().st_size > 20_000
    merged = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in merged if e["ph"] == "M"}
    assert names == {100: "trainer (rank 0, pid 100)", 200: "engine (rank 0, pid 200)"}
    spans = [e for e in merged if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {100, 200}
    # one time axis: the engine's wake lies between the trainer's spans, in microseconds
    wake = next(e for e in spans if e["name"] == "engine:wake")
    train = [e["ts"] for e in spans if e["name"] == "phase:train"]
    assert train[0] < wake["ts"] < train[1]
    assert main(["plot", str(trainer), "--trace", str(tmp_path / "only.json")]) == 0  # no PNG


def test_a_process_without_memory_data_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    trainer, engine = _files(tmp_path, engine_memory=False)
    texts: list[str] = []
    real_text = matplotlib.axes.Axes.text

    def text(self: Any, x: float, y: float, s: str, *args: Any, **kwargs: Any) -> Any:
        texts.append(s)
        return real_text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", text)
    plot.plot_timeline([trainer, engine], tmp_path / "x.png")
    assert sum("no memory data" in t for t in texts) == 1  # the engine's panel only


def test_a_phase_has_one_colour_in_every_plot() -> None:
    assert plot.phase_colour("train") == plot.phase_colour("phase:train")
    canonical = {
        plot.phase_colour(n) for n in ("train", "wake_up", "weight_sync", "rollout", "sleep")
    }
    assert len(canonical) == 5
    other = plot.phase_colour("bench:to_rollout")
    assert other == plot.phase_colour("bench:to_rollout")
    assert other not in canonical  # a hashed colour never takes a canonical phase's


def test_a_recording_names_its_process(fake_gpu: FakeTorch, tmp_path: Path) -> None:
    with hm.record(tmp_path / "engine", process="engine"), hm.phase("rollout", backend="sglang"):
        pass
    (event,) = [json.loads(line) for line in (tmp_path / "engine.jsonl").read_text().splitlines()]
    assert event["process"] == "engine"
    trace = json.loads((tmp_path / "engine.trace.json").read_text())["traceEvents"]
    meta = [e for e in trace if e["ph"] == "M"]
    assert meta[0]["args"]["name"].startswith("engine (rank 0, pid ")
    assert chrome_trace([])["traceEvents"] == []
    with pytest.raises(TypeError, match="process must be a str or None"):
        hm.record(process=5)  # type: ignore[call-overload]
