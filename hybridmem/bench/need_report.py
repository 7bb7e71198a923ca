"""``hybridmem bench --scale --need``'s results as a reader sees them: table, verdicts, plot.

At each trainer-state size and shortfall (the share of the optimizer state the rollout
lacks with the whole state on the device), offload-all (``hybridmem``), planned by need
(``planned``) and a fixed half (``fraction``) side by side: the bytes each switch copied,
its seconds each way and against its own bytes at the pinned copy rate, the KV cache it
got against the one asked for, the hand-back. Pure functions of saved rows (no GPU).
"""

from __future__ import annotations

from typing import Any

from hybridmem.bench.figures import kernel_rate_note, median
from hybridmem.bench.plan import sizes_anatomy_note

__all__ = [
    "HANDBACK_TARGET",
    "NEED_TARGET",
    "format_need_table",
    "is_need_run",
    "need_verdicts",
    "plot_need",
]

#: A planned switch each way within this factor of its own bytes at the pinned copy
#: rate, plus its releases of the trainer's cache, the engine's own calls aside.
NEED_TARGET = 1.1
#: The share of possible free memory the KV wake finds free.
HANDBACK_TARGET = 0.9995

GiB = 2**30


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
            f"{'strategy':<10} {'copied GiB':>11} {'to rollout s':>13} {'x own':>7} "
            f"{'x aside':>8} {'x -rel':>7} {'to trainer s':>13} {'x own':>7} {'x aside':>8} "
            f"{'x -rel':>7} {'KV GiB':>13} {'hand-back':>10}"
        )
        for name, row in _rows(size).items():
            errors = row.get("errors") or []
            got, asked = row.get("kv_obtained_gib"), row.get("kv_target_gib")
            kv = f"{_cell(got, '.1f')}/{_cell(asked, '.1f')}"
            lines.append(
                f"{name:<10} {_cell(row.get('copied_gib'), '11.2f')} "
                f"{_cell(row.get('to_rollout_s'), '13.3f')} "
                f"{_cell(row.get('to_rollout_over_ceiling'), '7.2f')} "
                f"{_cell(row.get('to_rollout_over_ceiling_engine_aside'), '8.2f')} "
                f"{_cell(row.get('to_rollout_over_ceiling_engine_and_release_aside'), '7.2f')} "
                f"{_cell(row.get('to_trainer_s'), '13.3f')} "
                f"{_cell(row.get('to_trainer_over_ceiling'), '7.2f')} "
                f"{_cell(row.get('to_trainer_over_ceiling_engine_aside'), '8.2f')} "
                f"{_cell(row.get('to_trainer_over_ceiling_engine_and_release_aside'), '7.2f')} "
                f"{kv:>13} {_cell(row.get('handback'), '10.4f')}"
                + (f"  errors: {errors[0]}" if errors else "")
            )
    if lines:
        lines.append(
            "x own: seconds over the strategy's own copied bytes at the pinned copy rate; "
            "x aside: the same with the engine's own wake/sleep calls left out; "
            "x -rel: and the trainer's cache releases too (what the 1.1x target judges)"
        )
    return lines


def need_verdicts(sizes: list[dict[str, Any]]) -> list[str]:
    """The planned switch at each point against its targets.

    Where nothing is short it must copy nothing; else each way within
    :data:`NEED_TARGET` of its own bytes at the pinned rate plus its releases of the
    trainer's cache (engine calls aside; results saved before releases were timed are
    judged without that allowance, and say so). At every point the KV cache it got is
    the one asked for and the hand-back at least :data:`HANDBACK_TARGET`.

    Example:
        >>> need_verdicts([])
        []
    """
    judged = sizes_anatomy_note(sizes)
    for size in sizes:
        row = _rows(size).get("planned")
        if row is None:
            continue
        where = f"{size['state_gib']:g} GiB, need {float(size['need']):.0%}"
        copied = row.get("copied_gib")
        deficit = row.get("deficit_gib")
        if isinstance(deficit, float | int) and deficit == 0:
            ok = copied == 0
            judged.append(
                f"{where}: nothing short, {_cell(copied, '.2f')} GiB copied: "
                + ("met" if ok else "NOT met")
            )
        else:
            for key, what in (("to_rollout", "to rollout"), ("to_trainer", "to trainer")):
                aside = row.get(f"{key}_over_ceiling_engine_aside")
                judged_by = row.get(f"{key}_over_ceiling_engine_and_release_aside")
                raw = row.get(f"{key}_over_ceiling")
                if not isinstance(aside, float | int):
                    judged.append(f"{where} {what}: not measured")
                    continue
                if isinstance(judged_by, float | int):
                    left_out = "engine calls and the releases aside"
                    beside = f"{aside:.2f}x with the releases, {_cell(raw, '.2f')}x raw"
                    bare = row.get(f"{key}_over_ceiling_engine_release_and_sync_aside")
                    if isinstance(bare, float | int):  # the way the weight sync runs in
                        beside += (
                            f"; {bare:.2f}x with the weight sync aside too "
                            f"({_cell((row.get('sync_s') or 0) * 1e3, '.1f')} ms)"
                        )
                else:
                    judged_by, left_out = aside, "engine calls aside, releases not timed"
                    beside = f"{_cell(raw, '.2f')}x raw"
                by_kernel = kernel_rate_note(row) if key == "to_trainer" else None
                if by_kernel:  # the fastest a reload after the engine's sleep copies
                    beside += f"; {by_kernel}"
                met = judged_by <= NEED_TARGET
                judged.append(
                    f"{where} {what}: {judged_by:.2f}x its {_cell(copied, '.2f')} GiB at the "
                    f"pinned rate, {left_out} (target <= {NEED_TARGET}x; {beside}): "
                    + ("met" if met else "NOT met" + _where_it_went(row, key))
                )
        judged.append(f"{where}: {_kv_verdict(row, _rows(size).get('hybridmem'))}")
    return judged


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


def _kv_verdict(row: dict[str, Any], offload_all: dict[str, Any] | None) -> str:
    """The KV cache and hand-back part of a planned point's verdict, saying what failed.

    A KV cache short by as much under offload-all (which frees the most) is the
    device's limit, not the plan's: said so. A hand-back under the target by less than
    four decimals show is printed with more.
    """
    kv, target = row.get("kv_obtained_gib"), row.get("kv_target_gib")
    handback = row.get("handback")
    kv_ok = isinstance(kv, float | int) and isinstance(target, float | int) and kv >= target
    back_ok = isinstance(handback, float | int) and handback >= HANDBACK_TARGET
    digits = ".4f" if back_ok or _cell(handback, ".4f") != f"{HANDBACK_TARGET:.4f}" else ".6f"
    text = (
        f"KV cache {_cell(kv, '.1f')} of {_cell(target, '.1f')} GiB, hand-back "
        f"{_cell(handback, digits)} (target >= {HANDBACK_TARGET}): "
    )
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
