"""The TRL drop-in's offload by need on a GPU, over vLLM's own sleep-mode pool (0.33's files)."""

from __future__ import annotations

import json
import os

import pytest

from tests.gpu.runner import run_scenario
from tests.gpu.vllm_sleep_scenarios import FILES_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not os.environ.get(FILES_ENV),
        reason=f"needs vLLM's allocator files: {FILES_ENV}=<vllm wheel or folder> "
        "(pip download --no-deps vllm==0.33.0; docs/backends/vllm.md says how)",
    ),
]
GiB = 1 << 30


def test_the_kv_wake_fits_by_offloading_only_what_it_lacks() -> None:
    facts = run_scenario(
        "offload_by_need", "tests.gpu.trl_scenarios", HYBRIDMEM_VLLM_FILES=os.environ[FILES_ENV]
    )
    print("\n" + json.dumps(facts, indent=1))
    plan = facts["plan"]
    assert facts["kv_need"] == 8 * GiB  # read from vLLM's pool: what the wake maps
    assert plan["need"] == facts["kv_need"]
    assert plan["deficit"] >= facts["short"]  # the device was short; the plan saw it
    moved = plan["moved"]["optimizer"]
    assert plan["deficit"] <= moved < facts["state_bytes"]  # by need: not the whole state
    assert plan["short"] == 0
    assert facts["offloaded_at_end"] == []  # back once the engine slept
    assert facts["state_intact"] is True  # the same bytes
