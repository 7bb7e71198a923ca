"""GPU scenarios for torch's allocator-settings rules (issue #11), each in a fresh interpreter.

Usage: ``python -m tests.gpu.settings_scenarios NAME``; the last line printed is
a JSON object of facts. What torch decides is read back from
``torch.cuda.memory._snapshot()["allocator_settings"]`` (the effective settings)
and from the segment a new tensor lands in.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

import hybridmem as hm
from hybridmem import _torch
from hybridmem.allocator.rules import TorchRules, default_state
from tests.torch_parser.corpus import corpus

MiB = 1 << 20


def _settings() -> dict[str, Any]:
    return _torch.snapshot_allocator_settings() or {}


def _expandable_segment(tensor: torch.Tensor) -> bool | None:
    ptr = tensor.untyped_storage().data_ptr()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return bool(seg.get("is_expandable", False))
    return None


def parser() -> dict[str, Any]:
    """torch's own CUDA parser against the model, string after string, in one process."""
    torch.zeros(1, device="cuda")
    setter = torch._C._accelerator_setAllocatorSettings
    rules = TorchRules(_torch.torch_version(), True, _torch.runtime_allocator_backend())
    state = default_state(rules.version)
    strings = [
        t for case in corpus() for t in case["sets"] if "per_process_memory_fraction" not in t
    ]
    rows = []
    for text in strings:
        try:
            setter(text)
            took, error = True, None
        except (ValueError, RuntimeError, IndexError) as exc:
            took, error = False, str(exc).splitlines()[0][:120]
        outcome = rules.run(text, state)
        rows.append(
            {
                "text": text,
                "torch": took,
                "torch_error": error,
                "model": outcome.accepted,
                "model_error": outcome.error,
                "snapshot": _settings(),
                "state": dict(outcome.state),
            }
        )
        state = outcome.state
    return {"torch": torch.__version__, "rows": rows}


def env_both() -> dict[str, Any]:
    """Both variables set (the issue's H200 case); the caller sets them."""
    torch.zeros(1, device="cuda")
    out: dict[str, Any] = {"torch_at_start": _settings()}
    with hm.expandable_segments(False):
        out["inside_false"] = _settings()
    out["after_false"] = _settings()
    with hm.expandable_segments(True):
        out["inside_true"] = _settings()
        out["tensor_inside_true"] = _expandable_segment(torch.empty(64 * MiB, device="cuda"))
    out["after_true"] = _settings()
    out["tensor_after"] = _expandable_segment(torch.empty(64 * MiB, device="cuda"))
    cfg = hm.allocator_state()
    out["variable"] = cfg.env_variable
    out["ignored"] = list(cfg.ignored_env)
    return out


def unrestorable() -> dict[str, Any]:
    """A default torch refuses to take back is never needed; later toggles still work."""
    torch.zeros(1, device="cuda")
    out: dict[str, Any] = {}
    try:
        with hm.allocator_settings(pinned_reserve_segment_size_mb=64):
            out["entered"] = True
    except hm.AllocatorSettingsError as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = _settings()
    with hm.expandable_segments(True):
        out["inside_true"] = _settings()["expandable_segments"]
    out["after_true"] = _settings()["expandable_segments"]
    try:  # the raw call that broke every later toggle: torch refuses its own default
        _torch.set_allocator_settings("pinned_reserve_segment_size_mb:0")
        out["torch_takes_zero"] = True
    except hm.AllocatorSettingsError:
        out["torch_takes_zero"] = False
    hm.set_allocator_defaults(pinned_reserve_segment_size_mb=64)
    with hm.allocator_settings(pinned_reserve_segment_size_mb=128):
        out["scoped_over_default"] = True
    with hm.expandable_segments(True):
        out["toggle_after_defaults"] = _settings()["expandable_segments"]
    return out


BAD = "garbage_collection_threshold:0.5,expandable_segments:True,max_split_size_mb:5"


def rollback() -> dict[str, Any]:
    """torch refuses a string after applying part of it: hybridmem puts the rest back.

    The model refuses this string, so to reach torch at all it is made to pass it
    (a stand-in for a torch whose rules the model does not know yet).
    """
    from hybridmem.allocator import state as allocator_state

    torch.zeros(1, device="cuda")
    out: dict[str, Any] = {"start": _settings()}
    real_run = TorchRules.run

    def lenient(self: TorchRules, text: str, state: Any = None) -> Any:
        outcome = real_run(self, text, state)
        if text == BAD:
            return type(outcome)(outcome.state, None, outcome.items, outcome.notes)
        return outcome

    real_string = allocator_state.SettingsEngine._settings_string
    TorchRules.run = lenient  # type: ignore[method-assign]
    allocator_state.SettingsEngine._settings_string = lambda self, target, current: (  # type: ignore[method-assign]
        BAD
        if "expandable_segments" in target and current is not target
        else real_string(self, target, current)
    )
    try:
        with hm.expandable_segments(True):
            out["entered"] = True
    except hm.AllocatorSettingsError as exc:
        out["error"] = str(exc)
    finally:
        TorchRules.run = real_run  # type: ignore[method-assign]
        allocator_state.SettingsEngine._settings_string = real_string  # type: ignore[method-assign]
    out["after"] = _settings()
    with hm.expandable_segments(True):
        out["next_inside"] = _settings()
    out["next_after"] = _settings()
    return out


def malformed() -> dict[str, Any]:
    """A malformed env value: one clear error, never torch's raw one."""
    out: dict[str, Any] = {}
    try:
        hm.allocator_state()
    except hm.AllocatorSettingsError as exc:
        out["error"] = str(exc)
    try:
        with hm.expandable_segments(True):
            pass
    except hm.AllocatorSettingsError as exc:
        out["scope_error"] = str(exc)
    return out


def watch_starts() -> dict[str, Any]:
    """After the first scope once CUDA is up: is the write watch in place; 1,000 scopes."""
    import time

    torch.zeros(1, device="cuda")
    with hm.expandable_segments(False):
        pass
    watch = _torch.settings._WATCH
    start = time.perf_counter()
    for _ in range(1000):
        with hm.expandable_segments(False):
            pass
    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "watched": _torch.settings_writes_watched(),
        "captured": list(getattr(watch, "captured", ())),
        "scope_us": (time.perf_counter() - start) * 1e3,
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "parser": parser,
    "env_both": env_both,
    "unrestorable": unrestorable,
    "rollback": rollback,
    "malformed": malformed,
    "watch_starts": watch_starts,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
