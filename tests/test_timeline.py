"""The timeline recorder: events from phases and primitives, exports, env switch, leaks."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.engine import switch as switch_module
from hybridmem.observe import timeline
from hybridmem.observe.memory import MemoryInfo
from tests.conftest import FakeTorch
from tests.helpers import run_python

GiB = 1 << 30
MiB = 1 << 20


def test_off_by_default_and_costs_nothing(fake_gpu: FakeTorch) -> None:
    assert not timeline.recording()
    assert timeline.begin("x") is None
    timeline.end(None)
    hm.release_cache()
    with hm.phase("rollout", backend="vllm"):
        pass
    assert hm.get_timeline().events() == []


def test_phases_and_primitives_record_memory_around_them(fake_gpu: FakeTorch) -> None:
    with hm.record():
        with hm.phase("wake_up", backend="vllm"):
            fake_gpu.devices[0].other += 30 * GiB  # the engine takes memory
        hm.release_cache()
    names = [e.name for e in hm.get_timeline().events()]
    # the phase's own release is recorded inside it; the phase ends after it
    assert names == ["release_cache", "phase:wake_up", "release_cache"]
    wake = hm.get_timeline().events()[1]
    assert wake.kind == "phase"
    assert wake.backend == "vllm"
    assert wake.device == 0
    assert wake.rank == 0
    assert wake.before["free"] - wake.after["free"] == 30 * GiB
    assert set(wake.after) == {"allocated", "reserved", "free", "used"}
    release = hm.get_timeline().events()[0]
    assert release.args["returned"] == 8 * GiB  # 10 GiB reserved, 2 GiB allocated
    assert release.duration >= 0
    assert not timeline.recording()


def test_errors_are_recorded(fake_gpu: FakeTorch) -> None:
    with hm.record(), pytest.raises(KeyError), hm.phase("train", backend="vllm"):
        raise KeyError("boom")
    (event,) = hm.get_timeline().events()
    assert "KeyError" in event.args["error"]


def test_nesting_and_threads(fake_gpu: FakeTorch) -> None:
    outer = hm.record()
    with outer:
        with hm.record():
            pass
        assert timeline.recording()  # the outer scope still records

        def work() -> None:
            hm.release_cache(collect_garbage=False)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not timeline.recording()
    assert len(hm.get_timeline().events()) == 4
    assert len({e.thread for e in hm.get_timeline().events()}) >= 1


def test_decorator_form(fake_gpu: FakeTorch) -> None:
    @hm.record()
    def step() -> None:
        hm.release_cache(collect_garbage=False)

    step()
    hm.release_cache(collect_garbage=False)  # outside: not recorded
    assert [e.name for e in hm.get_timeline().events()] == ["release_cache"]


def test_exports_jsonl_and_chrome_trace(fake_gpu: FakeTorch, tmp_path: Path) -> None:
    with hm.record(tmp_path / "run" / "timeline"), hm.phase("train", backend="sglang"):
        pass
    lines = (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()
    event = json.loads(lines[0])
    assert event["name"] == "phase:train"
    assert event["backend"] == "sglang"
    trace = json.loads((tmp_path / "run" / "timeline.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert spans[0]["name"] == "phase:train"
    assert spans[0]["dur"] >= 0
    assert len(counters) == 2  # memory before and after
    assert set(counters[0]["args"]) == {"allocated", "reserved", "free", "used"}
    first = next(iter(timeline.iter_jsonl(tmp_path / "run" / "timeline.jsonl")))
    assert first["kind"] == "phase"


def test_one_file_per_rank(
    fake_gpu: FakeTorch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with hm.record(tmp_path / "timeline.jsonl"):
        hm.release_cache(collect_garbage=False)
    assert (tmp_path / "timeline.rank1.jsonl").exists()
    assert (tmp_path / "timeline.rank1.trace.json").exists()
    assert hm.get_timeline().events()[0].rank == 1


def test_switch_stages_are_recorded(fake_gpu: FakeTorch) -> None:
    class Engine:
        def sleep(self, level: int) -> None: ...

        def wake_up(self, tags: list[str]) -> None: ...

    switch = hm.HybridSwitch(hm.VLLMEngine(Engine()), "vllm", barrier=None, confirm_timeout_s=0)
    with hm.record(), switch.rollout():
        pass
    stages = [e.name for e in hm.get_timeline().events() if e.kind == "stage"]
    assert stages[:3] == ["stage:offload", "stage:release", "stage:barrier"]
    assert stages[-1] == "stage:reload"
    phases = [e.name for e in hm.get_timeline().events() if e.kind == "phase"]
    assert phases == ["phase:weight_sync", "phase:wake_up", "phase:rollout", "phase:sleep"]


def test_a_stage_reads_memory_once_per_boundary_for_report_and_event(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Engine:
        def sleep(self, level: int) -> None: ...

        def wake_up(self, tags: list[str]) -> None: ...

    readings: list[str] = []
    real = hm.memory_info

    def counting(device: int | None = None) -> MemoryInfo:
        readings.append("read")
        return real(device)

    monkeypatch.setattr(timeline, "memory_info", counting)
    monkeypatch.setattr(switch_module, "memory_info", counting)
    switch = hm.HybridSwitch(hm.VLLMEngine(Engine()), "vllm", barrier=None, confirm_timeout_s=0)
    with hm.record(), switch.rollout():
        pass
    stages = [e for e in hm.get_timeline().events() if e.kind == "stage"]
    reported = [s for r in switch.reports for s in r.stages]
    assert [e.name for e in stages] == [f"stage:{s.name}" for s in reported]
    for event, stage in zip(stages, reported, strict=True):
        assert event.before["free"] == stage.free_before
        assert event.after["free"] == stage.free_after
        assert event.after["allocated"] == stage.allocated_after
    # One reading per stage boundary, shared by the report and the event: a stage
    # opens on the reading that closed the one before it (decision 91), so each
    # direction takes one more than it has stages; the phases and primitives inside
    # the stages read for themselves.
    for report in switch.reports:
        for before, after in itertools.pairwise(report.stages):
            assert after.before is before.after
    inner = [e for e in hm.get_timeline().events() if e.kind != "stage"]
    assert len(readings) == len(stages) + len(switch.reports) + 2 * len(inner)


ENV_CHECK = """
import hybridmem as hm
hm.release_cache(collect_garbage=False)
print(hm.get_timeline().events()[0].name if hm.get_timeline().events() else "none")
"""


def test_env_variable_records_from_import_to_exit(tmp_path: Path) -> None:
    path = tmp_path / "env_timeline"
    done = run_python("-c", ENV_CHECK, env={"HYBRIDMEM_TIMELINE": str(path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "release_cache"
    assert json.loads((tmp_path / "env_timeline.jsonl").read_text())["name"] == "release_cache"


# --------------------------------------------------------------------------- #
# LeakWatch
# --------------------------------------------------------------------------- #


def feed(watch: hm.LeakWatch, values: list[int]) -> list[float | None]:
    return [watch.observe(v) for v in values]


def test_leak_is_flagged_once_with_the_figure() -> None:
    slow = hm.LeakWatch("sleep", window=10, slope_bytes=2 * MiB)
    fitted = feed(slow, [GiB + cycle * MiB for cycle in range(10)])
    assert fitted[:9] == [None] * 9  # not enough cycles yet
    assert fitted[9] == pytest.approx(MiB)  # 1 MiB per cycle: under the threshold
    assert not slow.flagged
    fast = hm.LeakWatch("sleep", window=10, slope_bytes=2 * MiB)
    growing = [GiB + cycle * 3 * MiB for cycle in range(10)]
    with pytest.warns(hm.HybridMemWarning, match=r"grew 3\.00 MiB per cycle over the last 10"):
        feed(fast, growing)
    assert fast.flagged
    fast.observe(3 * GiB)  # no second warning (filterwarnings=error would raise)


def test_noise_without_growth_is_not_a_leak() -> None:
    watch = hm.LeakWatch("sleep", window=5)
    for value in [10, 50, 20, 40, 30, 10, 50, 20, 40, 30]:
        watch.observe(GiB + value * MiB // 10)
    assert not watch.flagged
    assert watch.slope is not None
    assert abs(watch.slope) < 2 * MiB


def test_leak_watch_from_the_timeline(fake_gpu: FakeTorch) -> None:
    watch = hm.LeakWatch("sleep", window=5, attach=True)

    def cycles() -> None:
        for _ in range(6):
            with hm.phase("sleep", backend="vllm"):
                fake_gpu.devices[0].allocated += 16 * MiB  # a leak of 16 MiB a cycle

    with hm.record(), pytest.warns(hm.HybridMemWarning, match="possible leak"):
        cycles()
    assert watch.cycles == 6
    watch.close()


def test_leak_watch_reads_the_device(fake_gpu: FakeTorch) -> None:
    watch = hm.LeakWatch(metric="reserved", window=3)
    watch.observe()
    assert watch.samples[-1] == fake_gpu.devices[0].reserved
    used = hm.LeakWatch(metric="used", window=3)
    used.observe()
    assert used.samples[-1] == fake_gpu.devices[0].total - fake_gpu.devices[0].free


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"boundary": "nap"}, ValueError, "unknown phase 'nap'"),
        ({"metric": "cached"}, ValueError, "metric must be one of"),
        ({"window": 2}, ValueError, "window must be an int from 3 to 1000000"),
        ({"slope_bytes": 0}, ValueError, "slope_bytes must be > 0"),
        ({"slope_bytes": "1"}, TypeError, "slope_bytes must be a number"),
    ],
)
def test_leak_watch_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        hm.LeakWatch(**kwargs)
