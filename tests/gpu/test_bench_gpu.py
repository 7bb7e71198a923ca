"""``hybridmem bench`` end to end on a GPU: every strategy runs and reports sane figures.

The quick plan (6 cycles) for each strategy (about a minute each on an H200),
with torch_memory_saver's engine, and its ``tms`` trainer strategy, where it is
installed. The engine's cache once asleep
is checked from the second cycle on, where a reference kept by the engine's
serving loop once showed up as one weight's worth of cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.gpu.runner import run_alone

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def test_quick_bench_runs_every_strategy(tmp_path: Path) -> None:
    # HYBRIDMEM_GPU_ARTIFACTS=DIR keeps the results and the timelines there (the run
    # quoted in docs/benchmarks.md is this test's).
    keep = os.environ.get("HYBRIDMEM_GPU_ARTIFACTS")
    folder = Path(keep) if keep else tmp_path
    out = folder / "bench.json"
    done = run_alone(
        "-m",
        "hybridmem.cli",
        "bench",
        "--quick",
        "--json",
        str(out),
        "--timeline",
        str(folder / "timeline"),
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    print("\n" + done.stdout)
    saved = json.loads(out.read_text())
    rows = {name: result["summary"] for name, result in saved["results"].items()}
    expected = ["handrolled", "hybridmem", "naive"]
    if importlib.util.find_spec("torch_memory_saver") is not None:
        expected.append("tms")  # the trainer offloading through torch_memory_saver
    assert sorted(rows) == expected
    for name, row in rows.items():
        assert row["errors"] == [], name
        assert row["cycles"] == 6
        assert row["kv_obtained_gib"] > 0, name
        assert 0.9 < row["handback"] <= 1.0, name
        assert row["to_rollout_s"] > 0, name
        assert row["offload_gbps"] > 0, name
        assert row["engine"] in ("torch_memory_saver (preload)", "handmade"), name
        raw = saved["results"][name]["raw"]
        # Once asleep the engine keeps (almost) nothing cached outside its paused regions.
        later = raw["engine_cached_after_sleep"][1:]
        assert max(later) < 16 * MiB, (name, [m / MiB for m in later])
    assert rows["hybridmem"]["offload_of_pinned"] > 0.5
    # hm.compact moved the resident weights out of classic segments (issue #12)
    assert rows["hybridmem"]["trainer_cached_mib"] <= 64, rows["hybridmem"]["missing_mib"]
    assert any(line.startswith("handback:") for line in saved["verdicts"])
    # hybridmem hands back at least as much as every baseline (issue #12)
    assert rows["hybridmem"]["handback"] >= 0.998
    for name in rows:
        assert rows["hybridmem"]["handback"] >= rows[name]["handback"] - 0.0005, name
