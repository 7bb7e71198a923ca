"""The bench's results as a reader sees them: the table, the verdicts against targets, the plot.

Pure functions of the result rows (no GPU, no processes), so they are tested on
the CPU and re-run on saved JSON (``hybridmem bench --from-json``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridmem.bench.figures import kernel_rate_note, median
from hybridmem.bench.plan import anatomy_note, sizes_anatomy_note

__all__ = [
    "BASELINES",
    "SCALE_TARGET",
    "TABLE_KEYS",
    "TARGETS",
    "format_scale_table",
    "format_table",
    "noise",
    "plot_results",
    "plot_scale",
    "scale_verdicts",
    "verdicts",
]

GiB = 2**30

# A difference smaller than this is noise even when the cycles agree closely:
# (absolute, relative) per figure. Above it, the cycles' own spread is the noise.
_NOISE_FLOOR: dict[str, tuple[float, float]] = {
    "kv_obtained_gib": (0.05, 0.0),
    "handback": (0.0005, 0.0),
    "to_rollout_s": (0.005, 0.05),
    "to_trainer_s": (0.005, 0.05),
    "offload_gbps": (0.0, 0.02),
    "peak_reserved_over_allocated": (0.002, 0.0),
    "drift_mib_per_cycle": (0.5, 0.0),
    "trainer_cached_mib": (8.0, 0.05),
    "engine_cached_after_sleep_mib": (2.0, 0.05),
}
# The per-cycle values behind a figure, where the results carry them (raw).
_PER_CYCLE: dict[str, Callable[[dict[str, Any]], list[float]]] = {
    "kv_obtained_gib": lambda raw: [k / GiB for k in raw.get("kv_obtained", [])],
    "handback": lambda raw: list(raw.get("handback", [])),
    "to_rollout_s": lambda raw: list(raw.get("to_rollout_s", [])),
    "to_trainer_s": lambda raw: list(raw.get("to_trainer_s", [])),
    "offload_gbps": lambda raw: list(raw.get("offload_gbps", [])),
    "peak_reserved_over_allocated": lambda raw: [
        r / a for r, a in zip(raw.get("peak_reserved", []), raw.get("peak_allocated", [])) if a
    ],
}

#: The targets hybridmem's switch is held to (docs/benchmarks.md).
TARGETS = {
    "handback": (">=", 0.998),
    "trainer_cached_mib": ("<=", 64.0),
    "engine_cached_after_sleep_mib": ("<=", 16.0),
    "peak_reserved_over_allocated": ("<=", 1.03),
    "offload_of_pinned": (">=", 0.90),
    "drift_mib_per_cycle": ("<=", 2.0),
}


#: What hybridmem is compared with: what users would otherwise run.
BASELINES = ("naive", "handrolled", "tms")

#: Figures whose ideal is 0: compared by their distance from it.
_BEST_AT_ZERO = {"drift_mib_per_cycle"}

_BETTER_HIGHER = {"kv_obtained_gib", "handback", "offload_gbps", "offload_of_pinned"}


#: The table's rows, in order (each a key of ``Figures.summary()``).
TABLE_KEYS = (
    "kv_obtained_gib",
    "handback",
    "to_rollout_s",
    "to_trainer_s",
    "offload_gbps",
    "offload_of_pinned",
    "peak_reserved_over_allocated",
    "peak_reserved_over_allocated_max",
    "drift_mib_per_cycle",
    "overhead_s",
    "sync_s",
    "trainer_cached_mib",
    "engine_cached_after_sleep_mib",
    "engine_wake_s",
    "engine_sleep_s",
    "train_drain_s",
)


_MISSING = ("trainer_cached", "engine_cached", "communicators", "context_growth")


def format_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The figures of each strategy side by side, then what kept the hand-back below 1."""
    lines = [f"{'figure':<34}" + "".join(f"{n:>14}" for n in rows)]
    engines = {row.get("engine") for row in rows.values()} - {None, ""}
    if engines:  # which rollout engine ran: torch_memory_saver's regions or the fallback
        lines.append(f"{'engine':<34}" + ", ".join(sorted(str(e) for e in engines)))
    for key in TABLE_KEYS:
        cells = []
        for row in rows.values():
            value = row.get(key)
            cells.append(f"{value:>14.4g}" if isinstance(value, float | int) else f"{'-':>14}")
        lines.append(f"{key:<34}" + "".join(cells))
    lines.append("hand-back shortfall, MiB (median):")
    for part in _MISSING:
        parts = [(row.get("missing_mib") or {}).get(part) for row in rows.values()]
        cells = [f"{v:>14.1f}" if isinstance(v, float | int) else f"{'-':>14}" for v in parts]
        lines.append(f"{'  ' + part:<34}" + "".join(cells))
    for name, row in rows.items():
        lines.extend(f"{name}: {error}" for error in row.get("errors") or [])
    return lines


def _spread(values: list[float]) -> float:
    """Half the interquartile range: how far a typical cycle is from the median."""
    if len(values) < 4:
        return 0.0
    ordered = sorted(values)
    return (ordered[(3 * len(ordered)) // 4] - ordered[len(ordered) // 4]) / 2


def noise(key: str, mine: float, other: float, raws: tuple[Any, Any] = (None, None)) -> float:
    """How big a difference between two strategies' ``key`` must be to mean anything."""
    absolute, relative = _NOISE_FLOOR.get(key, (0.0, 0.02))
    floor = max(absolute, relative * max(abs(mine), abs(other)))
    per_cycle = _PER_CYCLE.get(key)
    spread = 0.0
    if per_cycle is not None:
        spread = sum(_spread(per_cycle(raw)) for raw in raws if isinstance(raw, dict))
    return max(floor, spread)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float | int) else "-"


def verdicts(rows: dict[str, dict[str, Any]], raws: dict[str, Any] | None = None) -> list[str]:
    """hybridmem's figures against its targets and against each baseline.

    Figures are rounded to 4 significant digits; hybridmem is called worse than a
    baseline only when the difference exceeds the noise (:func:`noise`: the
    cycles' spread, at least a floor per figure); a smaller one is "within noise".
    """
    if "hybridmem" not in rows:
        return ["no verdicts: hybridmem was not run (combine saved runs with --from-json)"]
    raws = raws or {}
    ours = rows["hybridmem"]
    lines = anatomy_note(raws.values())
    for key, (op, target) in TARGETS.items():
        value = ours.get(key)
        if value is None:  # results saved before this figure existed
            lines.append(f"{key}: not measured (target {op} {target})")
            continue
        met = value >= target if op == ">=" else value <= target
        lines.append(f"{key}: {_fmt(value)} (target {op} {target}): {'met' if met else 'NOT met'}")
    for key in (
        "kv_obtained_gib",
        "handback",
        "to_rollout_s",
        "to_trainer_s",
        "offload_gbps",
        "peak_reserved_over_allocated",
        "drift_mib_per_cycle",
    ):
        mine = ours.get(key)
        others = {s: rows[s].get(key) for s in BASELINES if s in rows}
        if mine is None or not others or any(o is None for o in others.values()):
            continue
        higher = key in _BETTER_HIGHER
        worse: list[str] = []
        within: list[str] = []
        for name, other in others.items():
            assert other is not None  # checked above
            if key in _BEST_AT_ZERO:  # drifting either way is a drift
                behind = abs(mine) - abs(other)
            else:
                behind = (other - mine) if higher else (mine - other)
            if behind <= 0:
                continue
            margin = noise(key, mine, other, (raws.get("hybridmem"), raws.get(name)))
            (worse if behind > margin else within).append(f"{name} {_fmt(other)}")
        values = f"hybridmem {_fmt(mine)}"
        if worse:
            lines.append(f"{key}: {values}, worse than {' and '.join(worse)} (beyond noise)")
        elif within:
            lines.append(f"{key}: {values}, within noise of {' and '.join(within)}")
        else:
            listed = ", ".join(f"{n} {_fmt(o)}" for n, o in others.items())
            lines.append(f"{key}: {values}, at least as good as {listed}")
    return lines


_COLOURS = {
    "naive": "#bbbbbb",
    "handrolled": "#e08060",
    "tms": "#80b060",
    "hybridmem": "#4080c0",
}


def plot_results(rows: dict[str, dict[str, Any]], path: str) -> None:
    """One bar chart per figure, each bar labelled, targets drawn as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        "kv_obtained_gib",
        "handback",
        "to_rollout_s",
        "to_trainer_s",
        "offload_of_pinned",
        "peak_reserved_over_allocated",
        "drift_mib_per_cycle",
        "overhead_s",
    ]
    # Figures near 1 are drawn from just below the smallest value: from 0 their
    # differences (tenths of a percent) would not show.
    near_one = {"handback", "peak_reserved_over_allocated"}
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, key in zip(axes.flat, keys, strict=True):
        names = list(rows)
        values = [float(rows[n].get(key) or 0.0) for n in names]
        bars = ax.bar(names, values, color=[_COLOURS.get(n, "#888888") for n in names])
        ax.bar_label(bars, labels=[f"{v:.4g}" for v in values], fontsize=8, padding=2)
        if key in TARGETS:
            op, target = TARGETS[key]
            ax.axhline(target, color="#333333", ls="--", lw=0.8, label=f"target {op} {target}")
            ax.legend(fontsize=7, loc="lower right")
        if key in near_one and values:
            low = min([*values, TARGETS[key][1]])
            high = max([*values, TARGETS[key][1]])
            margin = max(high - low, 0.001)
            ax.set_ylim(low - margin, high + margin * 0.6)
        elif key == "drift_mib_per_cycle":  # around its 2 MiB target, or wider
            ax.set_ylim(min([-1.0, *values]) * 1.15, max([3.0, *values]) * 1.15)
        else:
            ax.set_ylim(0, max([*values, 1e-9]) * 1.15)
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(
        "hybridmem bench: " + ", ".join(f"{n} {rows[n].get('cycles')} cycles" for n in rows)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: ``hybridmem bench --scale``: each switch within this factor of its ceiling.
SCALE_TARGET = 1.1


def _scale_rows(size: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: r["summary"] for name, r in size["results"].items()}


def _size_ceiling(size: dict[str, Any]) -> float | None:
    """The median of the strategies' ceilings at one size (each measured its own)."""
    return median([r["ceiling_s"] for r in _scale_rows(size).values() if r.get("ceiling_s")])


def format_scale_table(sizes: list[dict[str, Any]]) -> list[str]:
    """Per trainer-state size, each strategy's switch times against the ceiling.

    Args:
        sizes: ``[{"state_gib": 8, "results": {strategy: {"summary": ...}}}, ...]``,
            what ``hybridmem bench --scale --json`` saves under ``"scale"``.
    """

    def cell(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, float | int) else "-"

    lines: list[str] = []
    for size in sizes:
        rows = _scale_rows(size)
        ceiling = _size_ceiling(size)
        moved = max((r.get("moved_gib") or 0.0 for r in rows.values()), default=0.0)
        what = f"its {moved:.1f} GiB of optimizer state" if moved else "the bytes it moves"
        lines.append(
            f"== {size['state_gib']:g} GiB of trainer state; ceiling "
            f"{cell(ceiling, '.3f')} s each way ({what} at the pinned copy rate)"
        )
        lines.append(
            f"{'strategy':<12} {'to rollout s':>13} {'x ceiling':>10} {'to trainer s':>13} "
            f"{'x ceiling':>10} {'hand-back':>10} {'drift MiB/c':>12} {'engine wake s':>14} "
            f"{'engine sleep s':>15}"
        )
        for name, row in rows.items():
            errors = row.get("errors") or []
            lines.append(
                f"{name:<12} {cell(row.get('to_rollout_s'), '13.3f')} "
                f"{cell(row.get('to_rollout_over_ceiling'), '10.2f')} "
                f"{cell(row.get('to_trainer_s'), '13.3f')} "
                f"{cell(row.get('to_trainer_over_ceiling'), '10.2f')} "
                f"{cell(row.get('handback'), '10.4f')} "
                f"{cell(row.get('drift_mib_per_cycle'), '12.1f')} "
                f"{cell(row.get('engine_wake_s'), '14.3f')} "
                f"{cell(row.get('engine_sleep_s'), '15.3f')}"
                + (f"  errors: {errors[0]}" if errors else "")
            )
    return lines


def scale_verdicts(sizes: list[dict[str, Any]]) -> list[str]:
    """hybridmem's switch against :data:`SCALE_TARGET` x its ceiling, at every size.

    The figure is the median of the cycles after the first (a warm-up); the worst of
    them is said beside it.
    """
    judged = sizes_anatomy_note(sizes)
    for size in sizes:
        row = _scale_rows(size).get("hybridmem")
        if row is None:
            continue
        for key, what in (
            ("to_rollout_over_ceiling", "to rollout"),
            ("to_trainer_over_ceiling", "to trainer"),
        ):
            ratio = row.get(key)
            if not isinstance(ratio, float | int):
                judged.append(f"{size['state_gib']:g} GiB {what}: not measured")
                continue
            verdict = "met" if ratio <= SCALE_TARGET else "NOT met"
            worst = row.get(f"{key}_worst")
            if isinstance(worst, float | int) and f"{worst:.2f}" == f"{ratio:.2f}":
                worst = None  # the same figure: said once
            notes = [
                f"{value:.2f}x {label}"
                for value, label in (
                    (worst, "the worst counted cycle"),
                    (row.get(f"{key}_engine_aside"), "with the engine's own calls aside"),
                )
                if isinstance(value, float | int)
            ]
            by_kernel = kernel_rate_note(row) if what == "to trainer" else None
            if by_kernel:  # the fastest a reload after the engine's sleep copies
                notes.append(by_kernel)
            judged.append(
                f"{size['state_gib']:g} GiB {what}: {ratio:.2f}x the ceiling "
                f"(target <= {SCALE_TARGET}x): {verdict}"
                + (f" ({'; '.join(notes)})" if notes else "")
            )
    return judged


def plot_scale(sizes: list[dict[str, Any]], path: str) -> None:
    """Seconds per switch against the state's size: a line per strategy, the ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = [float(size["state_gib"]) for size in sizes]
    names = list(dict.fromkeys(n for size in sizes for n in size["results"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in (
        (axes[0], "to_rollout_s", "to rollout (trainer state out)"),
        (axes[1], "to_trainer_s", "to trainer (trainer state back)"),
    ):
        for name in names:
            points = [
                (g, _scale_rows(size)[name].get(key))
                for g, size in zip(gib, sizes, strict=True)
                if name in size["results"]
            ]
            xs = [x for x, y in points if isinstance(y, float | int)]
            ys = [y for _, y in points if isinstance(y, float | int)]
            ax.plot(xs, ys, marker="o", label=name, color=_COLOURS.get(name, "#888888"))
        ceilings = [
            (g, ceiling)
            for g, size in zip(gib, sizes, strict=True)
            if (ceiling := _size_ceiling(size)) is not None
        ]
        if ceilings:
            ax.plot(
                [c[0] for c in ceilings],
                [c[1] for c in ceilings],
                ls="--",
                color="#333333",
                label="ceiling (optimizer state / pinned rate)",
            )
        ax.set_xlabel("trainer state, GiB (model + grads + AdamW)")
        ax.set_ylabel("seconds (log)")
        ax.set_yscale("log")  # the baselines are 10-50x the ceiling, hybridmem 1-3x
        ax.set_title(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()  # one legend, below: none on data
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle("hybridmem bench --scale")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
