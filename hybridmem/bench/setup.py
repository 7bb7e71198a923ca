"""What a bench run starts from (device, engine, strategies), checked before it starts."""

from __future__ import annotations

import dataclasses
import sys

from hybridmem.bench.outputs import NO_MATPLOTLIB, has_matplotlib, outputs_problem
from hybridmem.bench.plan import choose_strategies

__all__ = ["Setup", "prepare"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a bench run starts from: the device's size, the engine, the strategies."""

    total: int
    engine: str
    strategies: list[str]


def prepare(
    *,
    json_path: str | None,
    plot_path: str | None,
    timeline: str | None,
    engine: str,
    strategies: list[str] | None,
) -> Setup | None:
    """Check everything a bench run needs before it starts (``bench`` and ``bench --scale``).

    Returns:
        The :class:`Setup`, or None once one line on stderr said what is missing (no
        matplotlib for ``--plot``, an unwritable path, no GPU, an engine or strategy
        that cannot run here): the caller exits 2, before a run of minutes.
    """
    from hybridmem import _torch

    if plot_path and not has_matplotlib():
        print(NO_MATPLOTLIB, file=sys.stderr)
        return None
    problem = outputs_problem(json_path, plot_path, timeline)
    if problem:
        print(f"hybridmem bench: {problem}", file=sys.stderr)
        return None
    if not _torch.cuda_available():
        print("hybridmem bench needs a CUDA GPU (none is visible here)", file=sys.stderr)
        return None
    import torch

    from hybridmem._devices import device_index
    from hybridmem.bench.engine_memory import available, preload_library, resolve

    # The device's size without creating a context here (the children do the work).
    total = torch.cuda.get_device_properties(device_index(None)).total_memory
    try:
        engine_kind = resolve(engine)
        chosen, skipped = choose_strategies(
            strategies, tms=available() and preload_library() is not None
        )
    except (RuntimeError, ValueError) as exc:
        print(f"hybridmem bench: {exc}", file=sys.stderr)
        return None
    if skipped:
        print(f"bench: {skipped}", file=sys.stderr)
    return Setup(int(total), engine_kind, chosen)
