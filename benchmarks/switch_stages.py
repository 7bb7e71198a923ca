"""The bench's ``hybridmem`` strategy with every switch's stages logged, in this process.

Issue #25, item 3: ``hybridmem bench`` reports each switch's total; where its time
goes is in the switch's own reports (``SwitchReport``, logged at INFO by the
``hybridmem`` logger), which the bench's child processes do not keep. This runs the
strategy in-process for each plan named (a size in GiB of trainer state, or
``quick``), writes the ``hybridmem`` log (stage by stage, with each reload's bytes and
seconds) to ``LOG``, and prints the summary and per-cycle seconds of each plan.
``TAIL_SHARE=0.75`` in the environment sizes the early reload's tail at another share
of the offload's rate (``hybridmem.engine.switch_reload.TAIL_SHARE``); ``RELOAD_BY``
sets ``HybridSwitch(reload_by=...)``; ``KV_UNDER=0`` sets
``HybridSwitch(kv_under_offload=False)`` (decision 89: the KV cache after the copies).
``ROLLOUT_S=1`` waits that many seconds after each rollout's generation, before the
switch to the trainer: the bench's own rollout lasts about 18 ms, where a real one
lasts seconds (decision 94: does the head then run at the full rate?).

Run on a GPU with torch_memory_saver installed: ``python benchmarks/switch_stages.py
LOG 8 32 quick``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUMMARY = (
    "to_rollout_s",
    "to_rollout_over_ceiling",
    "to_trainer_s",
    "to_trainer_over_ceiling",
    "handback",
    "drift_mib_per_cycle",
    "engine_sleep_s",
    "offload_of_pinned",
)


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    import hybridmem.bench.strategies as strategies
    import hybridmem.engine.switch_reload as switch_reload
    from hybridmem.bench.plan import plan, scale_plan
    from hybridmem.bench.run import run_strategy

    if os.environ.get("TAIL_SHARE"):
        switch_reload.TAIL_SHARE = float(os.environ["TAIL_SHARE"])
    options: dict[str, Any] = {}
    if os.environ.get("RELOAD_BY"):
        options["reload_by"] = os.environ["RELOAD_BY"]
    if os.environ.get("KV_UNDER") == "0":
        options["kv_under_offload"] = False
    if os.environ.get("ROLLOUT_S"):
        from hybridmem.bench.engine import EngineClient

        rollout_s = float(os.environ["ROLLOUT_S"])
        real_call = EngineClient.call

        def call(self: EngineClient, *command: Any) -> tuple[Any, ...]:
            answer = real_call(self, *command)
            if command[0] == "generate":
                time.sleep(rollout_s)  # the rest of a rollout's length
            return answer

        setattr(EngineClient, "call", call)  # noqa: B010
    if options:
        made: Any = getattr(strategies, "HybridSwitch")  # noqa: B009 (not re-exported)
        setattr(strategies, "HybridSwitch", functools.partial(made, **options))  # noqa: B010
    handler = logging.FileHandler(sys.argv[1])
    handler.setFormatter(logging.Formatter("%(relativeCreated)9.1f %(message)s"))
    log = logging.getLogger("hybridmem")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    total = torch.cuda.mem_get_info()[1]
    for item in sys.argv[2:]:
        p = (
            plan(total, quick=True, engine="tms")
            if item == "quick"
            else scale_plan(total, float(item), cycles=4, model="auto", engine="tms")
        )
        log.info("=== plan %s", item)
        result = run_strategy("hybridmem", p, None)
        summary, raw = result["summary"], result["raw"]
        print(item, json.dumps({k: summary.get(k) for k in SUMMARY}), flush=True)
        print(
            item,
            "raw to_rollout",
            raw["to_rollout_s"],
            "to_trainer",
            raw["to_trainer_s"],
            "sleep",
            raw["engine_sleep_s"],
            flush=True,
        )
    return 0


if __name__ == "__main__":  # spawned children import this module: run only as a script
    raise SystemExit(main())
