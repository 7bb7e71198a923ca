"""The sglang recipe against the real torch_memory_saver, in both hook modes (H200).

What each step buys, with the trainer training with expandable segments on: a region
allocated while they are on is not freed by ``pause()`` in preload mode (the
control); allocated inside ``hm.phase("wake_up")`` or ``hm.phase("rollout")`` of the
sglang backend it is freed and taken back, its CPU-backed weights intact. In the
same process as the trainer and in an engine process of its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hybridmem.bench.engine_memory import available, preload_library
from tests.gpu import TMS_REASON, tms_scenarios

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (available() and preload_library()),
        reason=TMS_REASON,
    ),
]
REGION_MIB = (tms_scenarios.KV_BYTES + tms_scenarios.WEIGHT_BYTES) / tms_scenarios.MiB


def _keep(name: str, facts: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "gpu_facts.jsonl", "a") as fh:
            fh.write(json.dumps({"scenario": name, "facts": facts}) + "\n")


def _pausable(case: dict[str, Any]) -> bool:
    return bool(
        case["freed_mib"] >= 0.95 * REGION_MIB
        and case["retaken_mib"] >= 0.95 * REGION_MIB
        and case["weights_intact"]
        and case["kv_writable"]
    )


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_recipe_in_the_trainers_own_process(mode: str) -> None:
    facts = tms_scenarios.run("same", mode, preload=mode == "preload")
    _keep(f"tms_same_{mode}", facts)
    print(f"\nsame process, {mode}: {json.dumps(facts['cases'])}")
    assert facts["trainer_legacy_ipc"] is False  # the trainer really trained expandable
    cases = facts["cases"]
    assert _pausable(cases["wake_up_phase"])
    assert _pausable(cases["rollout_phase"])
    control = cases["control_expandable_on"]
    if mode == "preload":
        # The control shows the step is needed: expandable segments on, nothing freed.
        assert control["freed_mib"] < 0.05 * REGION_MIB
    else:
        assert _pausable(control)  # torch mode: TMS's pool ignores the toggle


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_recipe_in_an_engine_process(mode: str) -> None:
    facts = tms_scenarios.run("other", mode, preload=False)
    _keep(f"tms_other_{mode}", facts)
    engine = facts["engine"]
    print(f"\nengine process, {mode}: {json.dumps(engine)}")
    assert facts["trainer_legacy_ipc"] is False
    assert engine["pid"] != facts["trainer_pid"]
    # The trainer's toggle stays in the trainer: the engine's defaults are classic.
    assert _pausable(engine["default_settings"])
    assert _pausable(engine["wake_up_phase"])
    assert _pausable(engine["rollout_phase"])
    control = engine["control_expandable_on"]
    if mode == "preload":
        assert control["freed_mib"] < 0.05 * REGION_MIB
    else:
        assert _pausable(control)


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_an_engines_weights_pack_into_one_segment(mode: str) -> None:
    facts = tms_scenarios.run("packed", mode, preload=mode == "preload")
    _keep(f"tms_packed_{mode}", facts)
    print(f"\npacked, {mode}: {json.dumps(facts)}")
    # The default pool: every weight over 1 MiB carved from the one segment; left
    # cached: the norms' 2 MiB small segment and the one segment's rounding (< 2 MiB).
    plain = facts["plain"]
    assert plain["bits_equal"]
    assert plain["cached_before_mib"] > 16  # 32 weights of 10.7 MiB, each rounded to 12
    assert (plain["moved"], plain["stuck"]) == (plain["large"], 0)
    assert plain["cached_after_mib"] < 4
    # A region is a private pool: a move would keep the old segments cached beside the
    # new, so nothing moves, and the region still pauses and resumes whole.
    compacted = facts["region_compact"]
    assert (compacted["moved"], compacted["kept"]) == (0, compacted["storages"])
    assert compacted["cached_after_mib"] <= compacted["cached_before_mib"]
    assert compacted["bits_equal"]
    assert compacted["intact_after_resume"]
    # Made inside hm.one_segment, in the region: the rounding is paid once.
    packed = facts["region_one_segment"]
    assert packed["cached_mib"] < 4, packed["report"]
    assert packed["region_mib"] < packed["weights_mib"] + 4
    assert packed["freed_mib"] >= 0.95 * packed["region_mib"]
    assert packed["retaken_mib"] >= 0.95 * packed["region_mib"]
    assert packed["intact_after_resume"]
