"""Two (or more) CPU ranks over gloo running HybridSwitch cycles; one fails on purpose.

Usage (one process per rank; the test starts them)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.gloo_ranks OUT FAIL

``FAIL`` is ``rank:cycle:stage`` (stage ``sync`` or ``wake_kv`` or ``generate``): that rank
fails there in that cycle. Each rank writes its events as JSON lines to ``OUT/rank<r>.jsonl``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

import hybridmem as hm
from tests.gloo_teardown import leave_group

CYCLES = 4


class Boom(RuntimeError):
    pass


class Engine(hm.EngineAdapter):
    def __init__(self, record: Any, fail: tuple[int, int, str], rank: int) -> None:
        super().__init__(object(), ())
        self.record, self.fail, self.rank, self.cycle = record, fail, rank, 0

    def sleep(self) -> None:
        self.record("sleep")

    def wake_up(self, tags: Any) -> None:
        if self.fail == (self.rank, self.cycle, f"wake_{tags[0]}"):
            raise Boom(f"wake {tags[0]} failed")
        self.record(f"wake:{tags[0]}")


def main(out: Path, fail_spec: str) -> None:
    rank = int(os.environ["RANK"])
    r, c, stage = fail_spec.split(":")
    fail = (int(r), int(c), stage)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    lines = open(out / f"rank{rank}.jsonl", "w")  # noqa: SIM115 - closed below

    def record(event: str, **extra: Any) -> None:
        row = {"rank": rank, "cycle": engine.cycle, "event": event, "t": time.time(), **extra}
        lines.write(json.dumps(row) + "\n")
        lines.flush()

    engine = Engine(record, fail, rank)

    def sync(adapter: hm.EngineAdapter) -> None:
        record("sync:start")
        if fail == (rank, engine.cycle, "sync"):
            time.sleep(0.3)  # the other rank reaches barrier_kv first and waits there
            raise Boom("weight sync lost a batch")
        record("sync:end")

    plain = hm.BackendProfile("plain", "no allocator steps", {})
    switch = hm.HybridSwitch(engine, plain, sync_weights=sync, confirm_timeout_s=0)
    for cycle in range(CYCLES):
        engine.cycle = cycle
        try:
            with switch.rollout():
                record("generate")
                if fail == (rank, cycle, "generate"):
                    raise Boom("generation failed")
            record("outcome", outcome="ok")
        except Boom as exc:
            record("outcome", outcome=f"Boom: {exc}")
        except hm.HybridSwitchError as exc:
            record("outcome", outcome=f"HybridSwitchError: {exc}")
    lines.close()
    leave_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
