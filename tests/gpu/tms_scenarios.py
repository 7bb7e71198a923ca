"""What each step of the sglang recipe buys, against the real torch_memory_saver (TMS).

Usage: ``python -m tests.gpu.tms_scenarios NAME MODE`` (MODE ``preload`` or
``torch``); the last line printed is a JSON object of facts. ``preload`` runs need
``LD_PRELOAD`` of TMS's library in the process that allocates regions:
:func:`run` sets it for the child it starts.

- ``same``: one process trains with expandable segments on (``hm.phase("train",
  backend="sglang")``) and then allocates engine regions three ways: still with
  expandable segments on (the control), inside ``hm.phase("wake_up")`` and inside
  ``hm.phase("rollout")`` of the sglang backend. Each region set (a 1 GiB KV cache,
  256 MiB of weights with CPU backup) is paused and resumed: how much device memory
  ``pause()`` gave back, whether ``resume()`` took it again, and whether the weights
  came back intact.
- ``other``: the trainer trains with expandable segments on and keeps its memory
  while an engine process, started by it, runs the same three cases.
- ``packed``: an engine's weights made in a region and packed there into one
  segment by ``hm.compact(into="segment")``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import torch

import hybridmem as hm
from hybridmem import _torch
from tests.gpu.runner import settled_free

MiB = 1 << 20
KV_BYTES = 1 << 30
WEIGHT_BYTES = 256 * MiB


def _saver(mode: str) -> Any:
    from hybridmem.bench.engine_memory import memory_saver

    saver = memory_saver()  # optional: imported by name
    if mode == "torch":
        saver.hook_mode = "torch"
    return saver


def _free() -> int:
    return settled_free()  # no earlier process of this run still exiting on the GPU


def _case(saver: Any, name: str, scope: Any) -> dict[str, Any]:
    """Allocate a KV region and a weights region under ``scope``; pause and resume them."""
    with scope:
        with saver.region(tag=f"kv_{name}"):
            kv = torch.empty(KV_BYTES, dtype=torch.uint8, device="cuda")
            kv.fill_(1)
        with saver.region(tag=f"w_{name}", enable_cpu_backup=True):
            weights = torch.full((WEIGHT_BYTES,), 7, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {
        "kv_legacy_ipc": _torch.is_legacy_ipc_capable(kv),  # False: an expandable segment
        "weights_legacy_ipc": _torch.is_legacy_ipc_capable(weights),
    }
    before = _free()
    saver.pause(f"kv_{name}")
    saver.pause(f"w_{name}")
    paused = _free()
    saver.resume(f"kv_{name}")
    saver.resume(f"w_{name}")
    resumed = _free()
    out["freed_mib"] = (paused - before) / MiB
    out["retaken_mib"] = (paused - resumed) / MiB
    out["weights_intact"] = bool((weights == 7).all())
    kv.fill_(2)  # writable again
    out["kv_writable"] = bool((kv[:4096] == 2).all())
    return out


def _recipe_cases(saver: Any) -> dict[str, Any]:
    """The control and the two recipe steps, in this process."""
    return {
        "control_expandable_on": _case(saver, "control", hm.expandable_segments(True)),
        "wake_up_phase": _case(saver, "wake", hm.phase("wake_up", backend="sglang")),
        "rollout_phase": _case(saver, "rollout", hm.phase("rollout", backend="sglang")),
    }


def engine_cases(mode: str) -> dict[str, Any]:
    """The ways an engine may allocate its regions, in this process."""
    saver = _saver(mode)
    torch.zeros(1, device="cuda")
    return {
        **_recipe_cases(saver),
        "default_settings": _case(saver, "plain", contextlib.nullcontext()),
        "pid": os.getpid(),
    }


def _train(steps: int = 3) -> list[torch.Tensor]:
    """A few training steps with expandable segments on; return what stays allocated."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 4096)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with hm.phase("train", backend="sglang"):
        for _ in range(steps):
            x = torch.randn(512, 4096, device="cuda")
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        kept = [p.detach() for p in model.parameters()]
        states = [t for s in optimizer.state.values() for t in s.values() if t.numel() > 1]
    # The largest state last: small ones may sit in the small pool's classic segments.
    return kept + sorted(states, key=lambda t: t.numel())


def same(mode: str) -> dict[str, Any]:
    """Trainer and engine in one process: the trainer's toggle is the engine's problem."""
    saver = _saver(mode)
    torch.zeros(1, device="cuda")
    kept = _train()
    facts: dict[str, Any] = {
        "mode": mode,
        "trainer_legacy_ipc": _torch.is_legacy_ipc_capable(kept[-1]),  # trained expandable
        "expandable_after_train": hm.allocator_state().expandable_segments,
    }
    facts["cases"] = _recipe_cases(saver)
    return facts


def other(mode: str) -> dict[str, Any]:
    """The trainer trains and keeps its memory; its engine process allocates regions."""
    torch.zeros(1, device="cuda")
    kept = _train()
    facts: dict[str, Any] = {
        "mode": mode,
        "trainer_legacy_ipc": _torch.is_legacy_ipc_capable(kept[-1]),
        "trainer_allocated_mib": torch.cuda.memory_allocated() / MiB,
    }
    with hm.expandable_segments(True):  # the trainer is still in its training mode
        child = run("engine_cases", mode, preload=mode == "preload")
    facts["engine"] = child
    facts["trainer_pid"] = os.getpid()
    return facts


def run(name: str, mode: str, *, preload: bool) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh process, with TMS's LD_PRELOAD if ``preload``."""
    from hybridmem.bench.engine_memory import preloaded

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env = preloaded(env)
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.tms_scenarios", name, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    try:
        facts: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except ValueError:
        facts = {}
    if not facts:
        raise RuntimeError(f"{name} {mode} failed ({done.returncode}): {done.stderr[-3000:]}")
    # The facts were printed; how the process then tore down is recorded, not asserted
    # (torch_memory_saver's pools are destroyed at interpreter exit).
    facts["exit_code"] = done.returncode
    if done.returncode != 0:
        facts["stderr_tail"] = done.stderr[-1500:]
    return facts


def _engine_weights(device: str = "cuda") -> dict[str, torch.Tensor]:
    """An engine's weights of the bench's kinds: 10.7 MiB matrices, an embedding, norms."""
    torch.manual_seed(0)
    made = {"embed": torch.empty(32000, 1024, dtype=torch.bfloat16, device=device)}
    for i in range(16):
        made[f"up{i}"] = torch.empty(2731, 1024, device=device)
        made[f"down{i}"] = torch.empty(1024, 2731, device=device)
        made[f"norm{i}"] = torch.empty(1024, device=device)
    if device != "meta":
        for tensor in made.values():
            tensor.normal_()
    return made


def _cached() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def _pause_resume(saver: Any, tag: str, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Pause and resume ``tag``: what it freed and took back, and the weights after."""
    copies = {k: v.cpu() for k, v in weights.items()}
    before = _free()
    saver.pause(tag)
    paused = _free()
    saver.resume(tag)
    resumed = _free()
    return {
        "freed_mib": (paused - before) / MiB,
        "retaken_mib": (paused - resumed) / MiB,
        "intact_after_resume": all(torch.equal(copies[k], v.cpu()) for k, v in weights.items()),
    }


def _compacted(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``hm.compact(into="segment")`` of ``weights``: what moved, the cache before and after."""
    cached_before = _cached()
    copies = {k: v.cpu() for k, v in weights.items()}
    report = hm.compact(weights, into="segment")
    return {
        "report": str(report),
        "storages": len(weights),
        "large": sum(w.untyped_storage().nbytes() > MiB for w in weights.values()),
        "moved": report.moved,
        "kept": report.kept,
        "stuck": report.stuck,
        "cached_before_mib": cached_before / MiB,
        "cached_after_mib": _cached() / MiB,
        "bits_equal": all(torch.equal(copies[k], v.cpu()) for k, v in weights.items()),
    }


def packed(mode: str) -> dict[str, Any]:
    """An engine's weights packed into one segment, three ways.

    - ``plain``: made in the default pool (no region), then
      ``hm.compact(into="segment")``: the old segments go back to the driver.
    - ``region_compact``: made in a region, then ``hm.compact(into="segment")``
      there: the region is a private pool, so nothing may move.
    - ``region_one_segment``: made in a region inside ``hm.one_segment``: the
      rounding is paid once, and the region is still paused and resumed whole.
    """
    saver = _saver(mode)
    torch.zeros(1, device="cuda")
    facts: dict[str, Any] = {"mode": mode}
    plain = _engine_weights()
    facts["plain"] = _compacted(plain)
    del plain
    torch.cuda.empty_cache()
    with saver.region(tag="compacted", enable_cpu_backup=True):
        compacted = _engine_weights()
        facts["region_compact"] = _compacted(compacted)
    facts["region_compact"].update(_pause_resume(saver, "compacted", compacted))
    torch.cuda.synchronize()
    reserved_outside = torch.cuda.memory_reserved()
    cached_outside = _cached()
    with (
        saver.region(tag="packed", enable_cpu_backup=True),
        hm.one_segment(_engine_weights("meta")) as packing,
    ):
        weights = _engine_weights()
    torch.cuda.synchronize()
    facts["region_one_segment"] = {
        "report": str(packing.report),
        "cached_mib": (_cached() - cached_outside) / MiB,
        "region_mib": (torch.cuda.memory_reserved() - reserved_outside) / MiB,
        "weights_mib": sum(w.nbytes for w in weights.values()) / MiB,
        **_pause_resume(saver, "packed", weights),
    }
    return facts


SCENARIOS = {"same": same, "other": other, "engine_cases": engine_cases, "packed": packed}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](sys.argv[2]), default=str))
