"""``hybridmem bench --scale``: the switch at trainer states of 8, 32 and 64 GiB.

Each size runs every strategy (each in its own process, as ``hybridmem bench`` does)
with :func:`hybridmem.bench.plan.scale_plan`, and reports its to-rollout and
to-trainer seconds against the ceiling measured in the same process (the bytes each
switch copies over the host link, the optimizer state, at the pinned copy rate), the
hand-back and the drift. ``hybridmem bench --from-json`` merges the
files of several scale runs (sizes run apart, a strategy run again).

Scope: starts processes on the current device, one at a time; needs a GPU.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

from hybridmem.bench.outputs import write_scale
from hybridmem.bench.plan import SCALE_GIB, check_rollout_s, scale_plan

__all__ = ["bench_scale"]

GiB = 2**30


def bench_scale(
    *,
    sizes: list[float] | None,
    json_path: str | None,
    plot_path: str | None,
    strategies: list[str] | None,
    cycles: int | None = None,
    model: str = "auto",
    engine: str = "auto",
    rollout_s: float = 0.0,
) -> int:
    """Run the strategies at each trainer-state size; print the table and verdicts; exit code.

    Args:
        sizes: trainer states in GiB (None: ``SCALE_GIB``, 8, 32 and 64).
        json_path: write ``{"scale": [{"state_gib", "plan", "results"}...], "verdicts"}``.
        plot_path: seconds per switch against size, a line per strategy (matplotlib).
        strategies, cycles, model, engine, rollout_s: as for
            :func:`hybridmem.bench.run.bench` (cycles default to 4 per size).

    Returns:
        0, or 2 for misuse (no GPU, a size the device cannot hold, a bad path),
        said in one line before anything runs.

    Example:
        >>> bench_scale(sizes=[8], json_path="scale.json", plot_path=None,
        ...             strategies=None)  # doctest: +SKIP
    """
    from hybridmem.bench.run import child_run, prepare

    setup = prepare(
        json_path=json_path,
        plot_path=plot_path,
        timeline=None,
        engine=engine,
        strategies=strategies,
    )
    if setup is None:
        return 2
    engine_kind, chosen = setup.engine, setup.strategies
    try:
        rollout = check_rollout_s(rollout_s)
        plans = [
            (
                g,
                replace(
                    scale_plan(setup.total, g, cycles=cycles, model=model, engine=engine_kind),
                    rollout_s=rollout,
                ),
            )
            for g in (sizes or list(SCALE_GIB))
        ]
    except ValueError as exc:  # before a run of many minutes, not after
        print(f"hybridmem bench: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    measured: list[dict[str, Any]] = []
    for gib, p in plans:
        print(
            f"bench --scale: {gib:g} GiB of trainer state ({p.params / 1e9:.2f} B parameters, "
            f"d_model {p.d_model} x {p.layers} layers), {p.cycles} cycles, engine {engine_kind}"
            + (f", rollouts of {p.rollout_s:g} s more" if p.rollout_s else "")
        )
        results = {name: child_run(name, p, None) for name in chosen}
        measured.append({"state_gib": gib, "plan": p.as_dict(), "results": results})
    print(f"\nbench --scale took {time.perf_counter() - started:.0f} s")
    write_scale(measured, json_path=json_path, plot_path=plot_path)
    return 0
