"""``hybridmem bench --scale --need``'s results as a reader sees them: table, verdicts, plot.

At each trainer-state size and shortfall (the share of the optimizer state the rollout
lacks with the whole state on the device), offload-all (``hybridmem``), planned by need
(``planned``) and a fixed half (``fraction``) side by side: the bytes each switch copied,
its seconds each way and against its own bytes at the pinned copy rate, the KV cache it
got against the one asked for, the hand-back. Pure functions of saved rows (no GPU).
"""

from __future__ import annotations

from typing import Any

from hybridmem.bench.figures import median
from hybridmem.bench.plan import sizes_anatomy_note

__all__ = [
    "HANDBACK_TARGET",
    "KEPT_AT_LEAST_GIB",
    "NEED_TARGET",
    "NEVER_LOSES",
    "PARTIAL_HANDBACK_TARGET",
    "RETURN_TARGET",
    "format_need_table",
    "is_need_run",
    "need_verdicts",
    "plot_need",
]

#: The switch to the rollout within this factor of what every strategy pays in the
#: same cycle: its copied bytes at the pinned rate, the weight sync, the engine's wakes.
NEED_TARGET = 1.1
#: The switch back within this factor of its bytes at the kernels' copy rate measured
#: in the same run (engine calls and releases aside): a reload after the engine's free
#: copies no faster.
RETURN_TARGET = 1.2
#: The planned switch never loses: each way at most this factor of offload-all's seconds.
NEVER_LOSES = 1.05
#: A plan that copied less than the optimizer state by more than this kept part of it.
KEPT_AT_LEAST_GIB = 1 / 1024
#: A full plan's hand-back (the whole optimizer state moved), raw.
HANDBACK_TARGET = 0.9997
#: A partial plan's hand-back, counting the trainer's pages that hold kept state as
#: not reclaimable (the raw figure is said beside it).
PARTIAL_HANDBACK_TARGET = 0.9995

GiB = 2**30
_BACK_KERNEL = "to_trainer_over_kernel_ceiling_engine_and_release_aside"
_BACK_PINNED = "to_trainer_over_ceiling_engine_and_release_aside"


def is_need_run(sizes: list[dict[str, Any]]) -> bool:
    """Whether saved scale results come from ``--need`` (each entry has its share)."""
    return bool(sizes) and all(size.get("need") is not None for size in sizes)


def _rows(size: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: r["summary"] for name, r in size["results"].items()}


def _cell(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, float | int) else "-"


def _deficit_gib(size: dict[str, Any]) -> float | None:
    """What the rollout lacked at this point (the same in every strategy's process, about)."""
    found = [r.get("deficit_gib") for r in _rows(size).values()]
    return median([float(d) for d in found if isinstance(d, float | int)])


def format_need_table(sizes: list[dict[str, Any]]) -> list[str]:
    """Per size and shortfall, each strategy's bytes copied and seconds.

    Args:
        sizes: what ``hybridmem bench --scale --need --json`` saves under ``"scale"``:
            ``[{"state_gib", "need", "results": {strategy: {"summary": ...}}}, ...]``.

    Example:
        >>> format_need_table([])
        []
    """
    lines: list[str] = []
    for size in sizes:
        deficit = _deficit_gib(size)
        lines.append(
            f"== {size['state_gib']:g} GiB of trainer state, the rollout "
            f"{float(size['need']):.0%} of the optimizer state short "
            f"({_cell(deficit, '.2f')} GiB with everything on the device)"
        )
        lines.append(
            f"{'strategy':<10} {'copied GiB':>11} {'to rollout s':>13} {'worst':>7} "
            f"{'x paid':>7} {'x own':>7} {'to trainer s':>13} {'worst':>7} {'x kern':>7} "
            f"{'x -rel':>7} {'KV GiB':>13} {'hand-back':>10} {'pages':>9}"
        )
        for name, row in _rows(size).items():
            errors = row.get("errors") or []
            got, asked = row.get("kv_obtained_gib"), row.get("kv_target_gib")
            kv = f"{_cell(got, '.1f')}/{_cell(asked, '.1f')}"
            lines.append(
                f"{name:<10} {_cell(row.get('copied_gib'), '11.2f')} "
                f"{_cell(row.get('to_rollout_s'), '13.3f')} "
                f"{_cell(row.get('to_rollout_s_worst'), '7.3f')} "
                f"{_cell(row.get('to_rollout_over_paid'), '7.2f')} "
                f"{_cell(row.get('to_rollout_over_ceiling'), '7.2f')} "
                f"{_cell(row.get('to_trainer_s'), '13.3f')} "
                f"{_cell(row.get('to_trainer_s_worst'), '7.3f')} "
                f"{_cell(row.get(_BACK_KERNEL), '7.2f')} {_cell(row.get(_BACK_PINNED), '7.2f')} "
                f"{kv:>13} {_cell(row.get('handback'), '10.6f')} "
                f"{_cell(row.get('handback_pages'), '9.6f')}"
                + (f"  errors: {errors[0]}" if errors else "")
            )
    if lines:
        lines.append(
            "medians of the cycles after the first (a warm-up), the worst beside; x paid: the "
            "switch to rollout over what every strategy pays in the same cycle (its bytes at "
            "the pinned rate, the weight sync, the engine's wakes); x own: over its bytes at "
            "the pinned rate alone; x kern: the switch back, engine calls and releases aside, "
            "over its bytes at the kernels' copy rate; x -rel: the same at the pinned rate; "
            "pages: the hand-back with the trainer's pages that hold kept state not reclaimable"
        )
    return lines


def need_verdicts(sizes: list[dict[str, Any]]) -> list[str]:
    """Offload-all and the planned switch at each point against their targets.

    Each way: to the rollout within :data:`NEED_TARGET` of what every strategy pays in
    the same cycle, back within :data:`RETURN_TARGET` of its bytes at the kernels'
    copy rate (the pinned ratio beside); the planned switch at most
    :data:`NEVER_LOSES` x offload-all's seconds each way, and where nothing is short
    it copies nothing. The KV cache as asked; the hand-back of a full plan (the whole
    optimizer state moved) at least :data:`HANDBACK_TARGET` raw, of a partial plan at
    least :data:`PARTIAL_HANDBACK_TARGET` with the pages that hold kept state counted
    as not reclaimable. Every figure is the median of the counted cycles, its worst
    beside.

    Example:
        >>> need_verdicts([])
        []
    """
    judged = sizes_anatomy_note(sizes)
    for size in sizes:
        rows = _rows(size)
        where = f"{size['state_gib']:g} GiB, need {float(size['need']):.0%}"
        offload_all = rows.get("hybridmem")
        for name, label in (("hybridmem", "offload-all"), ("planned", "planned")):
            row = rows.get(name)
            if row is None:
                continue
            at = f"{where}, {label}"
            if row.get("errors"):
                judged.append(f"{at}: NOT met: {row['errors'][0]}")
                continue
            copied, deficit = row.get("copied_gib"), row.get("deficit_gib")
            if name == "planned" and isinstance(deficit, float | int) and deficit == 0:
                judged.append(
                    f"{at}: nothing short, {_cell(copied, '.2f')} GiB copied: "
                    + ("met" if copied == 0 else "NOT met")
                )
            judged.append(f"{at} to rollout: {_to_rollout(row)}")
            judged.append(f"{at} to trainer: {_to_trainer(row)}")
            if name == "planned" and offload_all is not None:
                judged.extend(f"{at} {line}" for line in _never_loses(row, offload_all))
            judged.append(f"{at}: {_kv_verdict(row, offload_all, full_plan=name == 'hybridmem')}")
    return judged


def _worst(row: dict[str, Any], key: str, fmt: str) -> str:
    """``", worst X"`` for ``key``'s worst counted cycle, where it differs from the median."""
    value, median_value = row.get(f"{key}_worst"), row.get(key)
    if not isinstance(value, float | int):
        return ""
    if isinstance(median_value, float | int) and format(median_value, fmt) == format(value, fmt):
        return ""
    return f", worst {format(value, fmt)}"


def _to_rollout(row: dict[str, Any]) -> str:
    """The switch to the rollout against what every strategy pays in the same cycle."""
    ratio = row.get("to_rollout_over_paid")
    if not isinstance(ratio, float | int):
        return "not measured (results saved before the weight sync was timed)"
    beside = (
        f"{_cell(row.get('to_rollout_s'), '.3f')} s{_worst(row, 'to_rollout_s', '.3f')}; "
        f"{_cell(row.get('copied_gib'), '.2f')} GiB copied, weight sync "
        f"{_cell((row.get('sync_s') or 0) * 1e3, '.1f')} ms, engine wakes "
        f"{_cell((row.get('engine_wake_s') or 0) * 1e3, '.1f')} ms"
    )
    met = ratio <= NEED_TARGET
    return (
        f"{ratio:.2f}x what every strategy pays{_worst(row, 'to_rollout_over_paid', '.2f')} "
        f"(target <= {NEED_TARGET}x; {beside}): "
        + ("met" if met else "NOT met" + _where_it_went(row, "to_rollout"))
    )


def _to_trainer(row: dict[str, Any]) -> str:
    """The switch back against its bytes at the kernels' copy rate, the pinned ratio beside."""
    if row.get("copied_gib") == 0:
        return f"nothing to reload, {_cell(row.get('to_trainer_s'), '.3f')} s: met"
    ratio = row.get(_BACK_KERNEL)
    if not isinstance(ratio, float | int):
        return "not measured (no kernels' copy rate in these results)"
    beside = (
        f"{_cell(row.get(_BACK_PINNED), '.2f')}x at the "
        f"pinned rate, kernels at {_cell(row.get('kernel_of_pinned'), '.2f')} of it; "
        f"{_cell(row.get('to_trainer_s'), '.3f')} s{_worst(row, 'to_trainer_s', '.3f')}"
    )
    met = ratio <= RETURN_TARGET
    return (
        f"{ratio:.2f}x its bytes at the kernels' copy rate, engine calls and releases aside"
        f"{_worst(row, _BACK_KERNEL, '.2f')} (target <= "
        f"{RETURN_TARGET}x; {beside}): "
        + ("met" if met else "NOT met" + _where_it_went(row, "to_trainer"))
    )


def _never_loses(row: dict[str, Any], offload_all: dict[str, Any]) -> list[str]:
    """The planned switch's seconds each way against offload-all's in the same run."""
    lines = []
    for key, what in (("to_rollout_s", "to rollout"), ("to_trainer_s", "to trainer")):
        mine, theirs = row.get(key), offload_all.get(key)
        if not isinstance(mine, float | int) or not isinstance(theirs, float | int) or not theirs:
            lines.append(f"{what} against offload-all: not measured")
            continue
        ratio = mine / theirs
        lines.append(
            f"{what} against offload-all: {mine:.3f} s vs {theirs:.3f} s, {ratio:.2f}x "
            f"(target <= {NEVER_LOSES}x): " + ("met" if ratio <= NEVER_LOSES else "NOT met")
        )
    return lines


def _where_it_went(row: dict[str, Any], key: str, top: int = 5) -> str:
    """The switch's longest stages that way, in ms (empty where stages were not saved).

    Each stage's time includes any engine call or release made in it: this says where
    the seconds went, the verdict's figure says which of them count.
    """
    stages = row.get(f"stages_{key}_ms") or {}
    if not stages:
        return ""
    longest = sorted(stages.items(), key=lambda item: -item[1])[:top]
    said = ", ".join(f"{name} {ms:.2f}" for name, ms in longest)
    return f"; longest stages (ms, median): {said}"


def _kv_verdict(
    row: dict[str, Any], offload_all: dict[str, Any] | None, *, full_plan: bool = False
) -> str:
    """The KV cache and hand-back part of a point's verdict, saying what failed.

    Offload-all (``full_plan``), and a plan that moved the whole optimizer state, are
    judged on the raw hand-back; a plan that kept part of it (more than
    :data:`KEPT_AT_LEAST_GIB`: the byte counts of what was copied and of the state
    differ by a few hundred bytes of rounding) on the hand-back counting the pages that
    hold kept state as not reclaimable, the raw figure beside; where saved results
    have no page count, the hand-back is said, not judged. A KV cache short by as much under
    offload-all (which frees the most) is the device's limit, not the plan's: said so.
    """
    kv, target = row.get("kv_obtained_gib"), row.get("kv_target_gib")
    kv_ok = isinstance(kv, float | int) and isinstance(target, float | int) and kv >= target
    copied, moved = row.get("copied_gib"), row.get("moved_gib")
    partial = (
        not full_plan
        and isinstance(copied, float | int)
        and isinstance(moved, float | int)
        and copied < moved - KEPT_AT_LEAST_GIB
    )
    raw = row.get("handback")
    if partial and row.get("handback_pages") is None:  # results saved before pages counted
        return (
            f"KV cache {_cell(kv, '.1f')} of {_cell(target, '.1f')} GiB, hand-back "
            f"{_cell(raw, '.6f')} raw (target >= {PARTIAL_HANDBACK_TARGET} with the pages that "
            "hold kept state not reclaimable: not judged, these results have no page count): "
            + ("met for the KV cache" if kv_ok else "NOT met: the KV cache is short")
        )
    if partial:
        handback, goal = row.get("handback_pages"), PARTIAL_HANDBACK_TARGET
        said = (
            f"hand-back {_cell(handback, '.6f')} with the pages that hold kept state "
            f"not reclaimable{_worst(row, 'handback_pages', '.6f')} (target >= {goal}; "
            f"{_cell(raw, '.6f')} raw)"
        )
    else:
        handback, goal = raw, HANDBACK_TARGET
        said = (
            f"hand-back {_cell(raw, '.6f')} raw{_worst(row, 'handback', '.6f')} (target >= {goal})"
        )
    back_ok = isinstance(handback, float | int) and handback >= goal
    text = f"KV cache {_cell(kv, '.1f')} of {_cell(target, '.1f')} GiB, {said}: "
    if kv_ok and back_ok:
        return text + "met"
    why = []
    if not kv_ok:
        why.append("the KV cache is short")
        other = (offload_all or {}).get("kv_obtained_gib")
        if isinstance(kv, float | int) and isinstance(other, float | int) and other <= kv:
            why[-1] += f" (offload-all got {other:.2f} GiB: the device's limit, not the plan's)"
    if not back_ok:
        why.append("the hand-back is under its target")
    return text + "NOT met: " + "; ".join(why)


def plot_need(sizes: list[dict[str, Any]], path: str) -> None:
    """Seconds and bytes copied against the rollout's deficit: a line per strategy and size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        (axes[0], "copied_gib", "GiB copied to the host"),
        (axes[1], "to_rollout_s", "to rollout, seconds"),
        (axes[2], "to_trainer_s", "to trainer, seconds"),
    )
    names = list(dict.fromkeys(n for size in sizes for n in size["results"]))
    markers = {"hybridmem": "o", "planned": "s", "fraction": "^"}
    states = sorted({float(size["state_gib"]) for size in sizes})
    for ax, key, title in panels:
        for name in names:
            for state in states:
                points = sorted(
                    (deficit, _rows(size)[name].get(key))
                    for size in sizes
                    if float(size["state_gib"]) == state
                    and name in size["results"]
                    and (deficit := _deficit_gib(size)) is not None
                )
                xs = [x for x, y in points if isinstance(y, float | int)]
                ys = [y for _, y in points if isinstance(y, float | int)]
                if xs:
                    ax.plot(xs, ys, marker=markers.get(name, "x"), label=f"{name} {state:g} GiB")
        ax.set_xlabel("the rollout's deficit with the state on the device, GiB")
        ax.set_title(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.suptitle("hybridmem bench --scale --need: what moves follows what is short")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
