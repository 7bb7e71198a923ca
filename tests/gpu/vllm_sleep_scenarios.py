"""GPU scenarios with vLLM's own sleep-mode allocator (``CuMemAllocator``), one per interpreter.

Usage: ``HYBRIDMEM_VLLM_FILES=<wheel or folder> python -m tests.gpu.vllm_sleep_scenarios
NAME``; the last line printed is a JSON object of facts. vLLM's files are loaded by
:func:`hybridmem.integrations.vllm.sleep_files.load_cumem`. What torch runs with is
read from ``torch.cuda.memory._snapshot()["allocator_settings"]``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import hybridmem as hm
from hybridmem import _torch
from hybridmem.integrations.vllm.sleep_files import load_cumem
from hybridmem.integrations.vllm.sleep_state import (
    EngineAsleepError,
    asleep_bytes,
    asleep_tags,
    refuse_while_asleep,
)

MiB, GiB = 1 << 20, 1 << 30
USER_ENV = "expandable_segments:True,max_split_size_mb:256,garbage_collection_threshold:0.6"
FILES_ENV = "HYBRIDMEM_VLLM_FILES"


def _allocator() -> Any:
    return load_cumem(os.environ[FILES_ENV]).CuMemAllocator.get_instance()


def _torch_runs() -> dict[str, Any]:
    snap = _torch.snapshot_allocator_settings() or {}
    return {
        "expandable_segments": bool(snap.get("expandable_segments")),
        "max_split_size_mb": int(snap.get("max_split_size", -1)) // MiB,
        "garbage_collection_threshold": round(
            float(snap.get("garbage_collection_threshold", 0)), 3
        ),
    }


def _hm_says() -> dict[str, Any]:
    state = hm.allocator_state()
    return {
        "expandable_segments": state.expandable_segments,
        "source": state.source("expandable_segments"),
        "max_split_size_mb": state["max_split_size_mb"],
        "pending": sorted(state.pending),
    }


def _same_split(torch_mb: int, hm_says: object) -> bool:
    """torch's max_split_size (-1 when unset: no limit) against hybridmem's value."""
    return hm_says == ("unlimited" if torch_mb == -1 else str(torch_mb))


def _row(label: str, rows: list[dict[str, Any]]) -> None:
    runs, says = _torch_runs(), _hm_says()
    rows.append(
        {
            "at": label,
            "torch": runs,
            "hm": says,
            "agree": runs["expandable_segments"] == says["expandable_segments"]
            and _same_split(runs["max_split_size_mb"], says["max_split_size_mb"]),
        }
    )


def _both_ways() -> tuple[Any, list[dict[str, Any]], torch.Tensor, torch.Tensor]:
    """hybridmem's scopes and the pool nested both ways, each tag's pool entered once.

    Returns the allocator, the rows, and the weights (filled with 7) and KV cache made in
    the pool.
    """
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == USER_ENV, "run with the user's env"
    torch.zeros(1, device="cuda")
    alloc = _allocator()
    rows: list[dict[str, Any]] = []
    _row("start", rows)
    # hybridmem outside, vLLM's pool inside, a hybridmem scope inside the pool
    with hm.expandable_segments(True):
        with alloc.use_memory_pool(tag="weights"):
            weights = torch.full((64 * MiB,), 7, dtype=torch.uint8, device="cuda")
            _row("pool inside scope", rows)
            with hm.expandable_segments(False):
                _row("scope inside pool", rows)
            _row("scope left inside pool", rows)
        _row("pool left", rows)
    _row("scope left", rows)
    # the pool outside, hybridmem's scope inside it
    with alloc.use_memory_pool(tag="kv_cache"):
        kv = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda")
        _row("pool", rows)
        with hm.expandable_segments(True):
            _row("scope inside pool (on)", rows)
        _row("scope left inside pool (on)", rows)
    _row("pool left (2)", rows)
    return alloc, rows, weights, kv


def composition() -> dict[str, Any]:
    """hybridmem's scopes and vLLM's ``use_memory_pool``: both orders, errors, a thread."""
    alloc, rows, weights, kv = _both_ways()
    # an exception inside each
    try:
        with alloc.use_memory_pool(tag="weights"), hm.allocator_settings(max_split_size_mb=64):
            raise KeyError("inside the scope")
    except KeyError:
        pass
    _row("error in scope in pool", rows)
    try:
        with hm.expandable_segments(False), alloc.use_memory_pool(tag="weights"):
            raise KeyError("inside the pool")
    except KeyError:
        pass
    _row("error in pool in scope", rows)
    # the pool in another thread while a scope exits in this one
    entered, leave = threading.Event(), threading.Event()

    def engine() -> None:
        with alloc.use_memory_pool(tag="weights"):
            entered.set()
            leave.wait(timeout=60)

    with hm.allocator_settings(max_split_size_mb=128):
        thread = threading.Thread(target=engine)
        thread.start()
        entered.wait(timeout=60)
    _row("scope left under a pool of another thread", rows)
    leave.set()
    thread.join(timeout=60)
    _row("thread's pool left", rows)
    with hm.expandable_segments(True):
        pass
    _row("end", rows)
    alloc.sleep(offload_tags=("weights",))
    asleep = sorted(asleep_tags())
    try:
        refuse_while_asleep("weights", "a weight update")
        refused = ""
    except EngineAsleepError as exc:
        refused = str(exc)
    alloc.wake_up(["weights"])
    asleep_after_weights = sorted(asleep_tags())
    alloc.wake_up(["kv_cache"])
    intact = bool((weights == 7).all())
    del kv
    return {
        "torch": torch.__version__,
        "rows": rows,
        "weights_intact_after_sleep": intact,
        "asleep": asleep,
        "refused": refused,
        "asleep_after_weights": asleep_after_weights,
        "asleep_at_end": sorted(asleep_tags()),
        "watched": _torch.settings_writes_watched(),
        "read_cost": _read_cost(),
    }


def _read_cost() -> list[dict[str, float]]:
    """What hybridmem's read of the last settings string costs, beside one snapshot."""
    out = []
    for count in (100, 10_000):
        keep = [torch.empty(4096 * (1 + i % 7), device="cuda") for i in range(count)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(1000):
            _torch.last_allocator_settings()
        read_us = (time.perf_counter() - start) / 1000 * 1e6
        start = time.perf_counter()
        for _ in range(5):
            torch.cuda.memory._snapshot()
        snapshot_us = (time.perf_counter() - start) / 5 * 1e6
        out.append({"blocks": count, "read_us": read_us, "snapshot_us": snapshot_us})
        del keep
    return out


def each_tag_once() -> dict[str, Any]:
    """hybridmem's scopes and the pool as vLLM uses it: each tag's pool entered once.

    vLLM up to 0.31 keeps one pool per tag and replaces it when the tag's pool is
    entered again: the replaced pool is freed while the new one is in use, which torch
    2.11 refuses (``captures_underway.empty()`` asserts, the process ends). vLLM
    itself enters ``weights`` once (the load) and ``kv_cache`` once (its init).
    """
    alloc, rows, weights, kv = _both_ways()
    with hm.expandable_segments(True):
        pass
    _row("end", rows)
    alloc.sleep(offload_tags=("weights",))
    asleep = sorted(asleep_tags())
    kv_asleep = asleep_bytes("kv_cache")
    alloc.wake_up(["weights"])
    alloc.wake_up(["kv_cache"])
    intact = bool((weights == 7).all())
    del kv
    return {
        "torch": torch.__version__,
        "rows": rows,
        "weights_intact_after_sleep": intact,
        "asleep": asleep,
        "kv_asleep_bytes": kv_asleep,
        "asleep_at_end": sorted(asleep_tags()),
        "watched": _torch.settings_writes_watched(),
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "composition": composition,
    "each_tag_once": each_tag_once,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()))
