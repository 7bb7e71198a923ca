"""``hybridmem plot``: memory over time from timelines, phases shaded and annotated.

Several files merge on one time axis (their start times are wall clock), one panel
per process: a trainer and its engine, or several ranks, side by side, each panel on
its own scale (a trainer's few GiB are not flattened under an engine's 75 GiB); the
device's memory in use, which every process shares, on a second axis. A phase has
one colour in every plot. ``--trace`` writes the merged Chrome trace.

Needs matplotlib (``pip install matplotlib``; the ``plot`` extra); imported only when plotting.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hybridmem._files import FileProblem, check_writable, describe
from hybridmem._phase_names import PHASES
from hybridmem.observe.timeline import chrome_trace, iter_jsonl, process_label

__all__ = [
    "MAX_TIME_CYCLES",
    "PlotError",
    "load_events",
    "phase_colour",
    "plot_timeline",
    "processes",
    "view",
    "write_merged_trace",
]

GiB = 2**30
# At most this many phase spans get a text label; beyond, the legend names them.
_MAX_LABELS = 24
# Up to this many cycles per rank, memory is drawn over time; beyond, per cycle.
MAX_TIME_CYCLES = 12
_SERIES = (("allocated", "allocated"), ("reserved", "reserved"), ("used", "device used"))
# matplotlib's tab20, as RGB: the canonical phases keep their colour in every plot,
# other names (bench steps, engine commands) get one from their name's hash.
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
    "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
)  # fmt: skip
_FIXED = {name: _PALETTE[i] for i, name in enumerate(PHASES)}
_NO_MEMORY = "no memory data in this process's events\n(recorded where it had no CUDA context)"


def phase_colour(name: str) -> str:
    """The colour of a phase (``"train"``, ``"bench:generate"``...): the same in every plot."""
    name = name.removeprefix("phase:")
    fixed = _FIXED.get(name)
    if fixed is not None:
        return fixed
    digest = int(hashlib.sha256(name.encode()).hexdigest(), 16)
    return _PALETTE[len(_FIXED) + digest % (len(_PALETTE) - len(_FIXED))]


def processes(events: list[dict[str, Any]]) -> list[tuple[tuple[int, int], str]]:
    """The processes in ``events``, in order of their first event: ``((rank, pid), label)``."""
    seen: dict[tuple[int, int], str] = {}
    for event in events:
        key = (int(event.get("rank", 0)), int(event.get("pid", 0)))
        if key not in seen:
            seen[key] = process_label(event)
    return list(seen.items())


def _of(events: list[dict[str, Any]], key: tuple[int, int]) -> list[dict[str, Any]]:
    return [e for e in events if (int(e.get("rank", 0)), int(e.get("pid", 0))) == key]


def write_merged_trace(
    paths: Iterable[str | os.PathLike[str]], output: str | os.PathLike[str]
) -> Path:
    """Merge timeline files into one Chrome trace: one row per process, one time axis.

    Raises:
        PlotError: a file is not a timeline, or ``output`` cannot be written.
    """
    try:
        check_writable(output, "the trace")
    except FileProblem as exc:
        raise PlotError(str(exc)) from None
    out = Path(output)
    try:
        out.write_text(json.dumps(chrome_trace(load_events(paths))))
    except OSError as exc:
        raise PlotError(f"cannot write the trace {str(out)!r}: {describe(exc)}") from None
    return out


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


def _samples(events: list[dict[str, Any]], t0: float) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = {key: [] for key, _ in _SERIES}
    for event in events:
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
    """Draw memory over time with phases shaded; one panel per process; write ``output``.

    Files of several processes (a trainer and its engine, several ranks) merge on
    one time axis. Readable for one cycle and for hundreds: up to 12 cycles per
    process (see :func:`view`), memory is drawn over time (reserved as an area,
    allocated as a line over it, the device's memory in use on a second axis) with
    each phase shaded in its colour (:func:`phase_colour`) and labelled up to 24
    spans; beyond, memory at each phase end is drawn against the cycle number, where
    drift and leaks show as slopes. A process whose events carry no memory reading
    says so in its panel.

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
        raise PlotError("drawing needs matplotlib: pip install matplotlib") from exc
    events = load_events(paths)
    rows = processes(events)
    t0 = events[0]["start"]
    phases = [e for e in events if e.get("kind") == "phase"]
    cycles = _cycles(phases)
    fig, axes = plt.subplots(
        len(rows), 1, figsize=(14, 3.2 * len(rows) + 1), sharex=True, squeeze=False
    )
    if cycles > MAX_TIME_CYCLES:  # what view(phases) decides
        # Many cycles: one point per phase end and cycle shows drift and leaks;
        # a time axis would be a solid band.
        for ax, (key, label) in zip(axes[:, 0], rows, strict=True):
            _per_cycle(ax, _of(phases, key))
            ax.set_ylabel(f"{label}\nGiB", fontsize=8)
        axes[-1, 0].set_xlabel("cycle")
        title = title or f"hybridmem timeline: memory at each phase end, {cycles} cycles"
        return _save(fig, plt, output, title)
    for ax, (key, label) in zip(axes[:, 0], rows, strict=True):
        mine = _of(events, key)
        _shade(ax, [p for p in mine if p.get("kind") == "phase"], t0)
        _draw_memory(ax, _samples(mine, t0))
        ax.set_ylabel(f"{label}\nGiB", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    return _save(
        fig, plt, output, title or f"hybridmem timeline: {len(events)} events, {cycles} cycles"
    )


def _draw_memory(ax: Any, samples: dict[str, list[tuple[float, float]]]) -> None:
    """This process's reserved (an area) and allocated (a line over it); the device's use."""
    if not samples:
        ax.text(0.5, 0.5, _NO_MEMORY, transform=ax.transAxes, ha="center", va="center")
    styles = (
        ("reserved", "#737373", "reserved (this process)"),
        ("allocated", "#000000", "allocated (this process)"),
    )
    for key, colour, label in styles:
        points = samples.get(key)
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        if key == "reserved":
            ax.fill_between(xs, ys, step="post", color=colour, alpha=0.32, lw=0, label=label)
        else:
            ax.step(xs, ys, where="post", color=colour, lw=1.6, zorder=3, label=label)
    used = samples.get("used")
    if used:  # the whole device, every process: its own scale
        twin = ax.twinx()
        xs, ys = zip(*used, strict=True)
        twin.step(
            xs, ys, where="post", color="#525252", lw=1.4, ls=":",
            label="device in use (all processes)",
        )  # fmt: skip
        twin.set_ylabel("device GiB", fontsize=8)
        twin.legend(loc="lower left", bbox_to_anchor=(1.06, 0.0), fontsize=7)


def _shade(ax: Any, spans: list[dict[str, Any]], t0: float) -> None:
    """Each phase span in its colour, labelled while there are few."""
    labelled = len(spans) <= _MAX_LABELS
    seen: set[str] = set()
    for span in spans:
        name = span["name"].removeprefix("phase:")
        left = span["start"] - t0
        right = left + span["duration"]
        ax.axvspan(
            left,
            right,
            color=phase_colour(name),
            alpha=0.22,
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


def view(phases: list[dict[str, Any]]) -> str:
    """``"time"`` or ``"cycles"``: how :func:`plot_timeline` draws these phase spans.

    The number of cycles is how often the most frequent phase ran in one process
    (nested phases, e.g. a bench step around a hybridmem phase, count once each).
    """
    return "cycles" if _cycles(phases) > MAX_TIME_CYCLES else "time"


def _cycles(phases: list[dict[str, Any]]) -> int:
    """How often the most frequent phase ran in one process (rank and pid)."""
    counts = Counter((int(p.get("rank", 0)), p.get("pid"), p["name"]) for p in phases)
    return max(counts.values(), default=0)


def _per_cycle(ax: Any, phases: list[dict[str, Any]]) -> None:
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
                    color=phase_colour(name),
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
