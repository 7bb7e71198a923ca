"""The examples run as documented (on the CPU here; on the GPU in the device run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quickstart_runs() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "HYBRIDMEM_"))}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2: loss" in result.stdout
    assert "garbage_collection_threshold" in result.stdout
    assert "Traceback" not in result.stderr
