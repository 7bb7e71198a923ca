"""hybridmem beside vLLM's own sleep-mode allocator (vLLM 0.33's files, on the GPU at hand).

Composition: what torch runs with (its snapshot) against what ``hm.allocator_state()``
says, at every step of hybridmem's scopes nested with vLLM's ``use_memory_pool`` in
both orders, with an exception inside each and vLLM's pool in another thread. Level-1
sleep: vLLM's own sleep and wake beside copies into host memory pinned once.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.gpu.runner import run_scenario
from tests.gpu.vllm_sleep_scenarios import FILES_ENV, USER_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not os.environ.get(FILES_ENV),
        reason=f"needs vLLM 0.33's allocator files: {FILES_ENV}=<vllm wheel or folder> "
        "(pip download --no-deps vllm==0.33.0; docs/backends/vllm.md says how)",
    ),
]
MODULE = "tests.gpu.vllm_sleep_scenarios"


def test_hybridmem_composes_with_vllms_pool_toggle() -> None:
    facts = run_scenario(
        "composition",
        MODULE,
        PYTORCH_CUDA_ALLOC_CONF=USER_ENV,
        HYBRIDMEM_VLLM_FILES=os.environ[FILES_ENV],
    )
    print("\n" + json.dumps(facts, indent=1))
    rows = {row["at"]: row for row in facts["rows"]}
    # never a value torch is not running with
    assert all(row["agree"] for row in facts["rows"]), facts["rows"]
    # vLLM's pool turned expandable segments off inside hybridmem's scope: seen...
    assert rows["pool inside scope"]["torch"]["expandable_segments"] is False
    assert rows["pool inside scope"]["hm"]["source"] == "outside"
    # ...and a scope that exits inside the pool leaves the pool's setting in force
    assert rows["scope left inside pool"]["torch"]["expandable_segments"] is False
    # a scope entered inside the pool applies, and gives the pool its setting back
    assert rows["scope inside pool (on)"]["torch"]["expandable_segments"] is True
    assert rows["scope left inside pool (on)"]["torch"]["expandable_segments"] is False
    # the other thread's pool stays in force as this thread's scope exits
    assert (
        rows["scope left under a pool of another thread"]["torch"]["expandable_segments"] is False
    )
    # the user's other settings throughout, and the env's settings at the end
    for row in facts["rows"]:
        assert row["torch"]["garbage_collection_threshold"] == 0.6, row
    assert rows["end"]["torch"]["expandable_segments"] is True
    assert facts["weights_intact_after_sleep"] is True
    # vLLM's own pool, asleep: a weight update is refused before anything is touched
    assert facts["asleep"] == ["kv_cache", "weights"]
    assert "a weight update came while vLLM's 'weights' memory sleeps" in facts["refused"]
    assert facts["asleep_after_weights"] == ["kv_cache"]
    assert facts["asleep_at_end"] == []


@pytest.mark.parametrize("gib", [1, 4, 16])
def test_level1_sleep_beside_pinned_copies(gib: int) -> None:
    facts = run_scenario(
        "level1", MODULE, SIZE_GIB=str(gib), HYBRIDMEM_VLLM_FILES=os.environ[FILES_ENV]
    )
    row = facts["rows"][0]
    print(f"\n{gib} GiB: {json.dumps(row)}")
    assert row["intact"] is True
    # a measurement: the figures go to docs/backends/vllm.md; the test asserts only
    # that every figure was taken
    assert row["sleep_first_s"] > 0
    assert row["pinned_down_s"] > 0
