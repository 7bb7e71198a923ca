"""``hybridmem bench --scale``: the switch at trainer states of 8, 32 and 64 GiB.

Each size runs every strategy (each in its own process, as ``hybridmem bench`` does)
with :func:`hybridmem.bench.plan.scale_plan`, and reports its to-rollout and
to-trainer seconds against the ceiling measured in the same process (the bytes each
switch copies over the host link, the optimizer state, at the pinned copy rate), the
hand-back and the drift. ``hybridmem bench --from-json`` merges the
files of several scale runs (sizes run apart, a strategy run again).

With ``--need``, each size runs once per shortfall: the rollout's KV cache is sized so
that it lacks that share of the optimizer state with the whole trainer state on the
device, and offload-all, planned-by-need and a fixed half are compared by the bytes each
copies and its seconds against its own bytes at the pinned rate.

Scope: starts processes on the current device, one at a time; needs a GPU.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

from hybridmem.bench.outputs import save_so_far, write_scale
from hybridmem.bench.plan import (
    ANATOMY_NOTE,
    NEED_STRATEGIES,
    SCALE_GIB,
    check_need,
    phase_lengths_said,
    scale_plan,
    with_phase_lengths,
)

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
    train_s: float = 0.0,
    needs: list[float] | None = None,
    anatomy: bool = False,
) -> int:
    """Run the strategies at each trainer-state size; print the table and verdicts; exit code.

    Args:
        sizes: trainer states in GiB (None: ``SCALE_GIB``, 8, 32 and 64).
        json_path: write ``{"scale": [{"state_gib", "plan", "results"}...], "verdicts"}``.
        plot_path: seconds per switch against size, a line per strategy (matplotlib).
        strategies, cycles, model, engine, rollout_s, train_s: as for
            :func:`hybridmem.bench.run.bench` (cycles default to 4 per size).
        needs: ``--need``: at each size, each of these shortfalls (shares of the
            optimizer state, :attr:`~hybridmem.bench.plan.BenchPlan.need`) with the
            ``NEED_STRATEGIES`` (or ``strategies``); None: one run per size.
        anatomy: record what each process's cache is made of at every KV wake (into
            ``--json``; slower: a diagnosis, not a timing).

    Returns:
        0, or 2 for misuse (no GPU, a size the device cannot hold, a bad path),
        said in one line before anything runs.

    Example:
        >>> bench_scale(sizes=[8], json_path="scale.json", plot_path=None,
        ...             strategies=None)  # doctest: +SKIP
    """
    from hybridmem.bench.run import child_run
    from hybridmem.bench.setup import prepare

    if needs is not None and strategies is None:
        strategies = list(NEED_STRATEGIES)
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
        shares: list[float | None] = [check_need(n) for n in needs] if needs else [None]
        plans = [
            (
                g,
                with_phase_lengths(
                    replace(
                        scale_plan(setup.total, g, cycles=cycles, model=model, engine=engine_kind),
                        need=share,
                        anatomy=anatomy,
                    ),
                    rollout_s=rollout_s,
                    train_s=train_s,
                ),
            )
            for g in (sizes or list(SCALE_GIB))
            for share in shares
        ]
    except ValueError as exc:  # before a run of many minutes, not after
        print(f"hybridmem bench: {exc}", file=sys.stderr)
        return 2
    if anatomy:
        print(ANATOMY_NOTE)
    started = time.perf_counter()
    measured: list[dict[str, Any]] = []
    for gib, p in plans:
        print(
            f"bench --scale: {gib:g} GiB of trainer state ({p.params / 1e9:.2f} B parameters, "
            f"d_model {p.d_model} x {p.layers} layers), {p.cycles} cycles, engine {engine_kind}"
            + phase_lengths_said(p)
            + (f", the rollout {p.need:.0%} of the optimizer state short" if p.need else "")
        )
        results: dict[str, Any] = {}
        entry: dict[str, Any] = {"state_gib": gib, "plan": p.as_dict(), "results": results}
        if p.need is not None:
            entry["need"] = p.need
        measured.append(entry)
        for name in chosen:
            results[name] = child_run(name, p, None)
            save_so_far(json_path, {"scale": measured})
    print(f"\nbench --scale took {time.perf_counter() - started:.0f} s")
    write_scale(measured, json_path=json_path, plot_path=plot_path)
    return 0
