"""vLLM's lifecycle out of order, through hybridmem, against vLLM's own sleep-mode pool.

The engine is a stand-in worker process: its weights and KV cache live in vLLM 0.33's
``CuMemAllocator`` pool (its own files, :func:`load_cumem`), it sleeps and wakes the
pool as vLLM's worker does (level 2: ``sleep(offload_tags=())``; level 1: the weights
kept), and it receives syncs with the code hybridmem's vLLM backend runs in a worker:
``refuse_while_asleep`` before anything, then :class:`EngineLink`. The trainer side (this
process) drives it through ``hm.VLLMEngine`` and a :class:`TrainerLink`; a second
trainer process dies between the wake and the sync.

Usage: ``HYBRIDMEM_VLLM_FILES=<wheel or folder> python -m tests.gpu.vllm_lifecycle_scenarios
lifecycle``; the last line printed is a JSON object of facts.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

import hybridmem as hm
from hybridmem.integrations.vllm.sleep_files import load_cumem

FILES_ENV = "HYBRIDMEM_VLLM_FILES"
SHAPES = {f"layers.{i}.w": (1024, 1024) for i in range(8)}
ANSWER_S = 60.0  # the longest the driver waits for one answer of a process


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {
        name: torch.full(shape, float(seed + i), device="cuda")
        for i, (name, shape) in enumerate(SHAPES.items())
    }


def _checksum(weights: dict[str, torch.Tensor]) -> float:
    return float(sum(w.double().sum().item() for w in weights.values()))


def _engine(conn: Connection, files: str) -> None:
    """The stand-in worker: vLLM's pool, the backend's engine-side steps, one command a time."""
    from hybridmem.integrations.vllm.engine import EngineLink
    from hybridmem.integrations.vllm.sleep_state import asleep_tags, refuse_while_asleep

    os.environ[FILES_ENV] = files
    torch.cuda.set_device(0)
    alloc = load_cumem(files).CuMemAllocator.get_instance()
    with alloc.use_memory_pool(tag="weights"):
        weights = {name: torch.zeros(shape, device="cuda") for name, shape in SHAPES.items()}
    with alloc.use_memory_pool(tag="kv_cache"):
        kv = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    link: EngineLink | None = None
    counts = {"sleep": 0, "wake_up": 0, "generate": 0}

    def apply(received: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in received:
            weights[name].copy_(tensor)
        torch.cuda.synchronize()

    conn.send(("ready", os.getpid()))
    while True:
        command, *args = conn.recv()
        try:
            reply: Any = None
            if command == "stop":
                conn.send(("ok", None))
                return
            if command == "sleep":
                counts["sleep"] += 1
                alloc.sleep(offload_tags=("weights",) if args[0] == 1 else ())
            elif command == "wake_up":
                counts["wake_up"] += 1
                alloc.wake_up(args[0])
            elif command == "init":
                if link is not None:
                    link.close()
                link = EngineLink(args[0], torch.device("cuda", 0), SHAPES)
            elif command == "start":  # the backend's start_weight_update
                refuse_while_asleep("weights", "a weight update")
                if link is None or link.closed:
                    raise RuntimeError("no live link: init first")
            elif command == "update":  # the backend's receive_weights
                refuse_while_asleep("weights", "a weight update")
                assert link is not None
                reply = link.update(apply, args[0]["sync"], args[0]["link"])
            elif command == "generate":
                refuse_while_asleep("weights", "generation")
                refuse_while_asleep("kv_cache", "generation")
                counts["generate"] += 1
                kv[:1024].fill_(1)
                reply = _checksum(weights)
            elif command == "state":
                reply = {
                    "asleep": sorted(asleep_tags()),
                    "link_closed": None if link is None else link.closed,
                    **counts,
                }
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", reply))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Worker:
    """The trainer's handle on the stand-in: vLLM's ``LLM`` methods as the adapter calls them."""

    def __init__(self, conn: Connection, pid: int | None) -> None:
        self.conn, self.pid = conn, pid

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        if not self.conn.poll(ANSWER_S):
            raise TimeoutError(f"the engine did not answer {command[0]!r} in {ANSWER_S:g} s")
        status, reply = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"the engine refused {command[0]!r}: {reply}")
        return reply

    def sleep(self, level: int = 1) -> None:
        self.ask("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.ask("wake_up", tags)

    def generate(self) -> float:
        return float(self.ask("generate"))


def _dying_trainer(conn: Connection) -> None:
    """A trainer that links to the engine, then exits without a sync when told to."""
    from hybridmem.integrations.vllm.trainer import TrainerLink

    torch.cuda.set_device(0)
    link = TrainerLink(32 << 20, timeout=20.0)

    def init(info: dict[str, Any]) -> None:
        conn.send(("init", info))
        if not conn.poll(ANSWER_S):
            raise TimeoutError("the driver did not forward the init")
        conn.recv()

    link.connect(init)
    conn.send(("linked", os.getpid()))
    if conn.poll(ANSWER_S):
        conn.recv()
    os._exit(3)  # dies with the link open, between the engine's wake and the sync


def _refusal(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def lifecycle() -> dict[str, Any]:
    """verl's step in order, then each out-of-order step; facts for the test to judge."""
    from hybridmem.integrations.vllm.trainer import TrainerLink

    files = os.environ[FILES_ENV]
    level = int(os.environ.get("SLEEP_LEVEL", "2"))
    torch.zeros(1, device="cuda")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    process = ctx.Process(target=_engine, args=(there, files), daemon=True)
    process.start()
    if not here.poll(120):
        raise TimeoutError("the stand-in engine did not start")
    here.recv()
    worker = _Worker(here, process.pid)
    adapter = hm.VLLMEngine(worker, level=level)
    facts: dict[str, Any] = {"level": level}
    weights = _weights(1)
    link = TrainerLink(32 << 20, timeout=20.0)
    link.connect(lambda info: worker.ask("init", info))

    def sync(named: dict[str, torch.Tensor], through: TrainerLink) -> None:
        through.sync(
            named, lambda info: worker.ask("update", info), start=lambda: worker.ask("start")
        )

    # verl's step, in order: sleep, wake weights, sync, wake the KV cache, generate
    adapter.sleep()
    adapter.wake_up(["weights"])
    sync(weights, link)
    adapter.wake_up(["kv_cache"])
    facts["in_order"] = adapter.generate() == _checksum(weights)
    # sleep twice: the second never reaches vLLM
    adapter.sleep()
    before = worker.ask("state")
    facts["second_sleep"] = adapter.sleep() is None and worker.ask("state") == before
    facts["asleep"] = before["asleep"]
    # weights sent while they sleep: refused before anything is sent or received
    facts["sync_asleep"] = _refusal(lambda: sync(_weights(5), link))
    # generate while asleep: the adapter refuses; a call past it, the worker refuses
    facts["generate_asleep_adapter"] = _refusal(adapter.generate)
    facts["generate_asleep_worker"] = _refusal(worker.generate)
    # wake twice: the second never reaches vLLM
    adapter.wake_up(["weights"])
    woken = worker.ask("state")["wake_up"]
    adapter.wake_up(["weights"])
    facts["second_wake"] = worker.ask("state")["wake_up"] == woken
    facts["generate_half_awake"] = _refusal(adapter.generate)
    weights = _weights(2)
    sync(weights, link)
    adapter.wake_up(["kv_cache"])
    facts["after_refusals"] = adapter.generate() == _checksum(weights)
    link.close()
    # a trainer that dies between the wake and the sync
    up, down = ctx.Pipe()
    dying = ctx.Process(target=_dying_trainer, args=(down,), daemon=True)
    dying.start()
    if not up.poll(120):
        raise TimeoutError("the dying trainer did not start")
    _, info = up.recv()
    worker.ask("init", info)
    up.send("ok")
    up.recv()  # linked
    adapter.sleep()
    adapter.wake_up(["weights"])
    up.send("die")
    dying.join(timeout=ANSWER_S)
    facts["dying_exit"] = dying.exitcode
    started = time.monotonic()
    while not worker.ask("state")["link_closed"] and time.monotonic() - started < 30:
        time.sleep(0.1)
    facts["link_closed_s"] = round(time.monotonic() - started, 2)
    facts["engine_after_death"] = worker.ask("state")
    facts["update_after_death"] = _refusal(
        lambda: worker.ask("update", {"sync": 1, "link": info["address"]})
    )
    # a new trainer links and syncs: the engine serves it
    weights = _weights(3)
    fresh = TrainerLink(32 << 20, timeout=20.0)
    fresh.connect(lambda info: worker.ask("init", info))
    sync(weights, fresh)
    adapter.wake_up(["kv_cache"])
    facts["after_death"] = adapter.generate() == _checksum(weights)
    fresh.close()
    facts["engine_alive"] = process.is_alive()
    worker.ask("stop")
    process.join(timeout=ANSWER_S)
    return facts


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {"lifecycle": lifecycle}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()))
