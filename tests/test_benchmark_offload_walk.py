"""``benchmarks/offload_walk.py`` runs on a CPU machine and reports what it measured."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_python


def test_the_walk_benchmark_runs_and_counts_the_storages_it_walked(tmp_path: Path) -> None:
    out = tmp_path / "walk.json"
    done = run_python(
        "benchmarks/offload_walk.py", "--device", "cpu", "--layers", "1", "2", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "tensors on cpu" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    # Per layer 9 parameters (7 matrices, 2 norms) plus the embedding, the last norm and
    # the head; AdamW's two moments and its step counter beside each parameter; CPU
    # tensors stand in for device ones, so the step counters are walked too.
    assert [(r["layers"], r["parameters"], r["storages"]) for r in rows] == [
        (1, 12, 48),
        (2, 21, 84),
    ]
    keys = ("walk_ms", "hand_written_ms", "planned_kept_walk_ms", "planned_two_walks_ms")
    assert all(row[key] > 0 for row in rows for key in keys)
