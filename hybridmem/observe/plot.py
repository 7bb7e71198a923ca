"""``hybridmem plot``: memory over time from a timeline, phases shaded and annotated.

Needs matplotlib (``pip install 'hybridmem[plot]'``); imported only when plotting.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hybridmem._files import FileProblem, check_writable, describe
from hybridmem.observe.timeline import iter_jsonl

__all__ = ["MAX_TIME_CYCLES", "PlotError", "load_events", "plot_timeline", "view"]

GiB = 2**30
# At most this many phase spans get a text label; beyond, the legend names them.
_MAX_LABELS = 24
# Up to this many cycles per rank, memory is drawn over time; beyond, per cycle.
MAX_TIME_CYCLES = 12
_SERIES = (("allocated", "allocated"), ("reserved", "reserved"), ("used", "device used"))


class PlotError(RuntimeError):
    """The timeline cannot be plotted (missing matplotlib, no events, bad file)."""


_EVENT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "start": (int, float),
    "duration": (int, float),
}


def load_events(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Read events from JSON-lines timeline files (several ranks may be given).

    Raises:
        PlotError: a file cannot be read or is not a hybridmem timeline (the
            message names the file and the first line that is not an event).
    """
    events: list[dict[str, Any]] = []
    for path in paths:
        try:
            for number, event in enumerate(iter_jsonl(path), start=1):
                if not (
                    isinstance(event, dict)
                    and all(isinstance(event.get(k), t) for k, t in _EVENT_FIELDS.items())
                ):
                    raise PlotError(
                        f"{path} is not a hybridmem timeline: line {number} is not an event "
                        "(write one with hm.record(path) or HYBRIDMEM_TIMELINE=path; saved "
                        "bench results go to `hybridmem bench --from-json`)"
                    )
                events.append(event)
        except OSError as exc:
            raise PlotError(f"cannot read timeline {path}: {describe(exc)}") from None
        except ValueError as exc:  # not JSON lines (a PNG, a whole-file JSON, text)
            raise PlotError(
                f"{path} is not a hybridmem timeline (JSON lines of events): {exc}"
            ) from None
    if not events:
        raise PlotError("the timeline has no events (was anything recorded?)")
    return sorted(events, key=lambda e: e["start"])


def _samples(events: list[dict[str, Any]], rank: int) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = {key: [] for key, _ in _SERIES}
    t0 = events[0]["start"]
    for event in events:
        if event.get("rank", 0) != rank:
            continue
        for stamp, memory in (
            (event["start"] - t0, event.get("before") or {}),
            (event["start"] + event["duration"] - t0, event.get("after") or {}),
        ):
            for key, _ in _SERIES:
                if key in memory:
                    series[key].append((stamp, memory[key] / GiB))
    return {k: sorted(v) for k, v in series.items() if v}


def plot_timeline(
    paths: Iterable[str | os.PathLike[str]], output: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """Draw memory over time with phases shaded; one panel per rank; write ``output``.

    Readable for one cycle and for hundreds: up to 12 cycles per rank (see
    :func:`view`), memory is drawn over time with each phase shaded (and labelled
    up to 24 spans); beyond, memory at each phase end is drawn against the cycle
    number, where drift and leaks show as slopes.

    Raises:
        PlotError: matplotlib is missing, the timeline is empty, unreadable or not
            a timeline, or ``output`` cannot be written (checked before drawing).
    """
    try:
        check_writable(output, "the plot")
    except FileProblem as exc:
        raise PlotError(str(exc)) from None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError("hybridmem plot needs matplotlib: pip install 'hybridmem[plot]'") from exc
    events = load_events(paths)
    ranks = sorted({int(e.get("rank", 0)) for e in events})
    t0 = events[0]["start"]
    phases = [e for e in events if e.get("kind") == "phase"]
    names = sorted({p["name"].removeprefix("phase:") for p in phases})
    colours = plt.get_cmap("tab10")
    colour = {name: colours(i % 10) for i, name in enumerate(names)}
    fig, axes = plt.subplots(
        len(ranks), 1, figsize=(14, 3.2 * len(ranks) + 1), sharex=True, squeeze=False
    )
    if view(phases) == "cycles":
        # Many cycles: one point per phase end and cycle shows drift and leaks;
        # a time axis would be a solid band.
        for ax, rank in zip(axes[:, 0], ranks, strict=True):
            _per_cycle(ax, [p for p in phases if p.get("rank", 0) == rank], colour)
            ax.set_ylabel(f"rank {rank}: GiB")
        axes[-1, 0].set_xlabel("cycle")
        cycles = sum(1 for p in phases if p["name"] == "phase:rollout") // len(ranks)
        title = title or f"hybridmem timeline: memory at each phase end, {cycles} cycles"
        return _save(fig, plt, output, title)
    for ax, rank in zip(axes[:, 0], ranks, strict=True):
        spans = [p for p in phases if p.get("rank", 0) == rank]
        labelled = len(spans) <= _MAX_LABELS
        seen: set[str] = set()
        for span in spans:
            name = span["name"].removeprefix("phase:")
            left = span["start"] - t0
            right = left + span["duration"]
            ax.axvspan(
                left,
                right,
                color=colour[name],
                alpha=0.18,
                lw=0,
                label=None if name in seen else name,
            )
            seen.add(name)
            if labelled:
                ax.text(
                    (left + right) / 2,
                    1.0,
                    name,
                    transform=ax.get_xaxis_transform(),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=30,
                )
        samples = _samples(events, rank)
        for key, label in _SERIES:
            points = samples.get(key)
            if points:
                xs, ys = zip(*points, strict=True)
                ax.step(xs, ys, where="post", label=label, lw=1.2)
        ax.set_ylabel(f"rank {rank}: GiB")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    cycles = sum(1 for p in phases if p["name"] == "phase:rollout") // len(ranks)
    return _save(
        fig, plt, output, title or f"hybridmem timeline: {len(events)} events, {cycles} cycles"
    )


def view(phases: list[dict[str, Any]]) -> str:
    """``"time"`` or ``"cycles"``: how :func:`plot_timeline` draws these phase spans.

    The number of cycles is how often the most frequent phase ran on one rank
    (nested phases, e.g. a bench step around a hybridmem phase, count once each).
    """
    counts = Counter((int(p.get("rank", 0)), p["name"]) for p in phases)
    cycles = max(counts.values(), default=0)
    return "cycles" if cycles > MAX_TIME_CYCLES else "time"


def _per_cycle(ax: Any, phases: list[dict[str, Any]], colour: dict[str, Any]) -> None:
    """Memory after each end of each phase, against the cycle number."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in phases:
        by_name.setdefault(span["name"].removeprefix("phase:"), []).append(span)
    for name, spans in by_name.items():
        for key, style, label in (("used", "-", "device used"), ("allocated", "--", "allocated")):
            points = [s["after"][key] / GiB for s in spans if key in (s.get("after") or {})]
            if points:
                ax.plot(
                    range(1, len(points) + 1),
                    points,
                    style,
                    color=colour[name],
                    lw=1.1,
                    label=f"{label} after {name}",
                )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


def _save(fig: Any, plt: Any, output: str | os.PathLike[str], title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(output)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except (OSError, ValueError) as exc:  # ValueError: an extension matplotlib lacks
        raise PlotError(f"cannot write the plot {str(out)!r}: {exc}") from None
    finally:
        plt.close(fig)
    return out
