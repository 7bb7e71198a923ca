"""The vLLM backend's trainer side on a GPU, with every transport, against its worker code.

Runs benchmarks/vllm_transfer.py small (an 8B Llama's layer shapes, 2 layers' worth)
with ``--check``: a worker process running the backend's engine-side code
(``EngineLink``, what vLLM's worker calls) loads each sync into its own copy, and
every tensor must arrive bit for bit. The ``fd`` worker runs under a seccomp filter
that denies ``pidfd_getfd`` (a locked-down container). vLLM's per-tensor ``ipc``
handles run beside them as the baseline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.gpu.runner import run_alone

pytestmark = pytest.mark.gpu


def test_every_transport_delivers_whole_syncs_intact_and_memory_stays_flat(
    tmp_path: Path,
) -> None:
    out = tmp_path / "vllm_transfer.json"
    result = run_alone(
        "benchmarks/vllm_transfer.py",
        "--gib", "1", "--syncs", "3", "--bucket-mib", "64", "--check", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    print("\n" + result.stdout)
    report = json.loads(out.read_text())
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "vllm_transfer_gpu_test.json").write_text(out.read_text())
    rows = {row["method"]: row for row in report["rows"]}
    assert set(rows) == {"hybridmem-cuda", "hybridmem-fd", "hybridmem-host", "vllm-ipc"}
    for method, row in rows.items():
        assert row["intact"], method
        assert row["growth_mib_per_sync"] < 64, (method, row)  # no bucket leaked per sync
    # Each transport is the one asked for: fd passing reached a worker denied pidfd_getfd.
    assert rows["hybridmem-cuda"]["transport"] == "cuda"
    assert rows["hybridmem-fd"]["transport"] == "fd"
    assert rows["hybridmem-host"]["transport"] == "host"
