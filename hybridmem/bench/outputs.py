"""What a bench run writes and reads: its output paths checked first, its saved results.

Apart from the run itself: ``hybridmem bench --from-json`` (:func:`report`) needs no
GPU and no run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hybridmem._files import FileProblem, check_writable, describe
from hybridmem.bench.figures import resummarise
from hybridmem.bench.need_report import format_need_table, is_need_run, need_verdicts, plot_need
from hybridmem.bench.plan import ALL_STRATEGIES
from hybridmem.bench.report import (
    format_scale_table,
    format_table,
    plot_results,
    plot_scale,
    scale_verdicts,
    verdicts,
)

__all__ = [
    "NO_MATPLOTLIB",
    "has_matplotlib",
    "load_results",
    "merge_scale",
    "outputs_problem",
    "report",
    "save_so_far",
    "write_scale",
]


def _read(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise FileProblem(f"cannot read results from {path}: {describe(exc)}") from None
    except ValueError as exc:  # not JSON (a PNG, a JSON-lines timeline, ...)
        raise FileProblem(
            f"{path} is not saved bench results (hybridmem bench --json writes them): {exc}"
        ) from None


def _is_scale(saved: Any) -> bool:
    return isinstance(saved, dict) and "scale" in saved


def load_results(path: str) -> dict[str, Any]:
    """Read results saved with ``hybridmem bench --json``.

    Raises:
        FileProblem: the file cannot be read, is not JSON, or is not bench results
            (the message names the file and what is missing).
    """
    return _checked_results(path, _read(path))


def _checked_scale(path: str, saved: Any) -> list[dict[str, Any]]:
    """The sizes of results saved with ``hybridmem bench --scale --json``, read from ``path``.

    Raises:
        FileProblem: ``saved`` is not scale results (the message names ``path``).
    """
    sizes = saved.get("scale") if isinstance(saved, dict) else None
    if not (
        isinstance(sizes, list)
        and sizes
        and all(isinstance(size, dict) and "state_gib" in size for size in sizes)
    ):
        raise FileProblem(
            f"{path} is not saved scale results: it has no 'scale' list of sizes "
            "(hybridmem bench --scale --json writes them)"
        )
    for size in sizes:
        _checked_results(f"{path} ({size['state_gib']:g} GiB)", size)
        need = size.get("need")
        if need is not None and not (
            isinstance(need, float | int) and not isinstance(need, bool) and 0 <= need <= 1
        ):
            raise FileProblem(f"{path}: a saved --need share must be from 0 to 1, got {need!r}")
    if len({size.get("need") is None for size in sizes}) > 1:
        raise FileProblem(f"{path} mixes --need runs with plain --scale runs")
    return list(sizes)


def _checked_results(path: str, saved: Any) -> dict[str, Any]:
    found = saved.get("results") if isinstance(saved, dict) else None
    if not (
        isinstance(found, dict)
        and found
        and all(isinstance(r, dict) and isinstance(r.get("summary"), dict) for r in found.values())
    ):
        raise FileProblem(
            f"{path} is not saved bench results: it has no 'results' with a 'summary' per "
            "strategy (hybridmem bench --json writes them; a timeline goes to hybridmem plot)"
        )
    result: dict[str, Any] = saved
    return result


def outputs_problem(json_path: str | None, plot_path: str | None, timeline: str | None) -> str:
    """What is wrong with the output paths, checked before any work ('' if nothing)."""
    try:
        if json_path:
            check_writable(json_path, "--json")
        if plot_path:
            check_writable(plot_path, "--plot")
        if timeline:
            check_writable(f"{timeline}.hybridmem.jsonl", "--timeline")
    except FileProblem as exc:
        return str(exc)
    return ""


NO_MATPLOTLIB = (
    "--plot needs matplotlib: pip install matplotlib (or save --json here and "
    "draw it elsewhere with `hybridmem bench --from-json FILE --plot out.png`)"
)


def has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def report(paths: list[str], *, json_path: str | None, plot_path: str | None) -> int:
    """``hybridmem bench --from-json``: the table, verdicts and plot of saved results.

    Several files merge (a strategy in a later file replaces an earlier one), so
    strategies run separately, e.g. with different ``--cycles``, compare in one table.
    No GPU needed.
    """
    if plot_path and not has_matplotlib():
        print(NO_MATPLOTLIB, file=sys.stderr)
        return 2
    problem = outputs_problem(json_path, plot_path, None)
    if problem:
        print(f"hybridmem bench: {problem}", file=sys.stderr)
        return 2
    try:
        read = [_read(path) for path in paths]  # each file once
    except FileProblem as exc:
        print(f"hybridmem bench: {exc}", file=sys.stderr)
        return 2
    scale = [_is_scale(saved) for saved in read]
    if any(scale):
        if not all(scale):
            mixed = ", ".join(p for p, s in zip(paths, scale, strict=True) if not s)
            print(
                f"hybridmem bench: {mixed}: not scale results, and the others are "
                "(bench --scale's and bench's results make different tables: pass "
                "one kind at a time)",
                file=sys.stderr,
            )
            return 2
        return _report_scale(paths, read, json_path=json_path, plot_path=plot_path)
    results: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    for path, raw in zip(paths, read, strict=True):
        try:
            saved = _checked_results(path, raw)
        except FileProblem as exc:
            print(f"hybridmem bench: {exc}", file=sys.stderr)
            return 2
        for name, result in saved["results"].items():
            results[name] = result
            plans[name] = saved.get("plan")
    rows = {name: results[name]["summary"] for name in ALL_STRATEGIES if name in results}
    for name, row in rows.items():
        p = plans.get(name) or {}
        model = f", {row['model']}" if row.get("model") else ""
        engine = f", engine {row['engine']}" if row.get("engine") else ""
        print(
            f"{name}: {row.get('cycles')} cycles, {p.get('params', 0) / 1e6:.0f} M parameters"
            + model
            + engine
        )
    judged = verdicts(rows, {name: results[name].get("raw") for name in rows})
    print("\n" + "\n".join(format_table(rows)))
    print("\n" + "\n".join(judged))
    if json_path:
        Path(json_path).write_text(
            json.dumps({"plans": plans, "results": results, "verdicts": judged}, indent=2)
        )
    if plot_path:
        plot_results(rows, plot_path)
        print(f"wrote {plot_path}")
    return 0


def merge_scale(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Sizes from several scale runs as one list, by size; each summary computed again.

    A strategy at a size (and ``--need`` share) in a later run replaces the earlier
    one's (so one strategy run again, at one size, replaces only itself). Each summary
    is computed again from its raw figures (:func:`~hybridmem.bench.figures.resummarise`),
    so results saved by an older bench are judged by today's ceiling.

    Example:
        >>> merge_scale([[{"state_gib": 8, "plan": {}, "results": {}}]])
        [{'state_gib': 8, 'plan': {}, 'results': {}}]
    """
    merged: dict[tuple[float, float], dict[str, Any]] = {}
    for sizes in runs:
        for size in sizes:
            need = size.get("need")  # --need runs: one entry per size and shortfall
            start: dict[str, Any] = {
                "state_gib": size["state_gib"],
                "plan": size.get("plan"),
                "results": {},
            }
            if need is not None:
                start["need"] = need
            key = (float(size["state_gib"]), -1.0 if need is None else float(need))
            into = merged.setdefault(key, start)
            for name, result in size["results"].items():
                into["results"][name] = resummarise(result, size.get("plan"))
    return [merged[key] for key in sorted(merged)]


def write_scale(
    sizes: list[dict[str, Any]], *, json_path: str | None, plot_path: str | None
) -> None:
    """Print the scale table and verdicts; save them (``--json``) and draw them (``--plot``)."""
    need = is_need_run(sizes)
    judged = need_verdicts(sizes) if need else scale_verdicts(sizes)
    print("\n" + "\n".join(format_need_table(sizes) if need else format_scale_table(sizes)))
    print("\n" + "\n".join(judged))
    if json_path:
        Path(json_path).write_text(
            json.dumps({"scale": sizes, "verdicts": judged}, indent=2, default=str)
        )
    if plot_path:
        (plot_need if need else plot_scale)(sizes, plot_path)
        print(f"wrote {plot_path}")


def save_so_far(json_path: str | None, saved: dict[str, Any]) -> None:
    """Write what a run has measured so far to ``--json``, marked unfinished.

    A bench run of many minutes saves after every strategy, so a run cut short (a time
    limit, a crash in a later strategy, Ctrl-C) keeps every strategy that finished:
    ``hybridmem bench --from-json`` prints them, and the finished run's own write
    replaces the file.

    Args:
        json_path: the ``--json`` path, or None (nothing written).
        saved: what the finished run would write, without its verdicts.
    """
    if json_path:
        unfinished = {**saved, "verdicts": [], "unfinished": True}
        Path(json_path).write_text(json.dumps(unfinished, indent=2, default=str))


def _report_scale(
    paths: list[str], read: list[Any], *, json_path: str | None, plot_path: str | None
) -> int:
    try:
        runs = [_checked_scale(path, saved) for path, saved in zip(paths, read, strict=True)]
    except FileProblem as exc:
        print(f"hybridmem bench: {exc}", file=sys.stderr)
        return 2
    write_scale(merge_scale(runs), json_path=json_path, plot_path=plot_path)
    return 0
