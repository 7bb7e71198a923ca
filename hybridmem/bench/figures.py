"""What ``hybridmem bench`` measured: each strategy's figures per cycle, and their summary.

:class:`Figures` holds one strategy's raw readings (every cycle's seconds, bytes,
hand-back, each switch stage's time); :meth:`Figures.summary` turns them into the
medians and ratios the tables and verdicts judge. The first cycle is a warm-up (it
pays one-time allocations and the driver's first mappings) and counts in no figure;
each figure is the median of the other cycles, and the worst of them is kept beside
it (``*_worst``). :func:`resummarise` judges results
saved by an older bench by today's definitions. Pure Python (no GPU).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hybridmem.observe.leakwatch import slope

__all__ = [
    "Figures",
    "counted",
    "handback_ratio",
    "kernel_rate_note",
    "moved_bytes_of",
    "resummarise",
    "stage_medians_ms",
]

GiB = 2**30


def handback_ratio(free: int, total: int, live: int, context: int) -> float:
    """Device free memory over what could be free: ``free / (total - live - context)``."""
    possible = total - live - context
    return free / possible if possible > 0 else 0.0


@dataclass
class Figures:
    """One strategy's results: the figures its verdicts judge."""

    strategy: str
    cycles: int
    kv_target: int
    kv_obtained: list[int]
    handback: list[float]
    to_rollout_s: list[float]
    to_trainer_s: list[float]
    offload_gbps: list[float]
    pinned_gbps: float
    peak_reserved: list[int]
    peak_allocated: list[int]
    free_at_train: list[int]
    overhead_s: list[float]
    errors: list[str]
    #: per cycle, in bytes: caches each process kept when the KV cache woke (what kept
    #: the hand-back below 1), and how much the contexts grew since the start.
    missing: list[dict[str, int]] = field(default_factory=list)
    #: the model the trainer built (e.g. ``"transformers LlamaForCausalLM"``).
    model: str = ""
    #: the engine that ran (``"torch_memory_saver (preload)"``, ``"handmade"``).
    engine: str = ""
    #: with ``BenchPlan.anatomy``: per cycle, the trainer's and the engine's cache
    #: anatomy at the KV wake (``hybridmem.bench.anatomy.cache_anatomy``).
    anatomy: list[dict[str, Any]] = field(default_factory=list)
    #: per cycle, bytes the engine kept cached once asleep (outside paused regions).
    engine_cached_after_sleep: list[int] = field(default_factory=list)
    #: the trainer state on the device at each switch: parameters and optimizer state
    #: (the gradients are dropped before it).
    state_bytes: int = 0
    #: the bytes each switch copies over the host link in each direction, the
    #: ceiling's bytes: the optimizer state, which every strategy offloads and
    #: reloads. The parameters stay on the device (the engine gets them by weight
    #: sync, a device-to-device copy), so they are not in the ceiling: counting
    #: them, as the first scale runs did, made it 1.5x too long (fp32 parameters
    #: beside two fp32 AdamW moments). 0 in results saved before (then see
    #: :func:`moved_bytes_of`).
    moved_bytes: int = 0
    #: per cycle, the seconds of each switch spent in the engine's own memory calls,
    #: timed from the trainer across the pipe: its wake-ups on the way to rollout,
    #: its sleep on the way back. No trainer-side strategy can shorten them, and the
    #: ceiling does not count them. Empty in results saved before.
    engine_wake_s: list[float] = field(default_factory=list)
    engine_sleep_s: list[float] = field(default_factory=list)
    #: per cycle, the seconds of each switch's release of the cache it freed (its
    #: ``release`` stage; 0 for strategies without one): the need target allows them
    #: beside the copies. Empty in results saved before.
    release_to_rollout_s: list[float] = field(default_factory=list)
    release_to_trainer_s: list[float] = field(default_factory=list)
    #: per cycle, the seconds the trainer's GPU took to finish the training step's
    #: queued work once the host had queued it all: waited for before each switch to
    #: rollout is timed, since no strategy can start its copies before that work is
    #: done (inside the to-rollout seconds in results saved before, where this is
    #: empty).
    train_drain_s: list[float] = field(default_factory=list)
    #: what packing the engine's weights into one segment did at their last making
    #: (the ``hybridmem`` strategy: a ``SegmentReport`` of :func:`hybridmem.one_segment`
    #: as text); empty where nothing was packed, and in results saved before.
    engine_packed: str = ""
    #: ``--need`` runs: the need asked for (:attr:`BenchPlan.need`), what the rollout
    #: was short with the whole state on the device
    #: (:func:`~hybridmem.bench.plan.need_kv_target`), and per cycle the bytes each
    #: switch to rollout copied to the host (0 where nothing was short), which are
    #: then the ceiling's bytes. None, 0 and empty otherwise.
    need: float | None = None
    deficit_bytes: int = 0
    copied_bytes: list[int] = field(default_factory=list)
    #: per cycle, the weight sync's seconds (inside the switch to rollout). Empty in
    #: results saved before.
    sync_s: list[float] = field(default_factory=list)
    #: per cycle, each stage's seconds of the switch each way, by stage name (the
    #: ``hybridmem`` strategies: a :class:`~hybridmem.HybridSwitch`'s report): where
    #: a switch's time went beyond its copies. Empty for other strategies and in
    #: results saved before.
    stages_to_rollout_s: list[dict[str, float]] = field(default_factory=list)
    stages_to_trainer_s: list[dict[str, float]] = field(default_factory=list)
    #: host-to-device GB/s of a copy by kernels that read mapped pinned memory,
    #: measured in the same process (:func:`~hybridmem.bench.ceilings.kernel_ceiling`):
    #: the fastest a reload that starts after the engine's sleep copies, since the copy
    #: engines slow down after a large free and kernels do not. None where the memory
    #: could not be mapped, and in results saved before.
    kernel_gbps: float | None = None
    #: per cycle, the hand-back with the trainer's pages that hold live state counted
    #: as not reclaimable (:func:`~hybridmem.bench.anatomy.kept_page_bytes`): a
    #: plan that keeps part of the state keeps the page where kept and moved tensors
    #: meet, which no release can free. Empty in results saved before.
    handback_pages: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Medians over the counted cycles (:func:`counted`), the worst beside, JSON-ready."""

        ratios = counted(
            [r / a for r, a in zip(self.peak_reserved, self.peak_allocated, strict=True) if a]
        )
        to_rollout, to_trainer = counted(self.to_rollout_s), counted(self.to_trainer_s)
        # One direction's bytes at the pinned copy rate measured in the same process:
        # with --need, the bytes this strategy copied (each moves its own share).
        copied_each = [float(b) for b in counted(self.copied_bytes)]
        copied = median(copied_each)  # per switch to rollout
        moved = self.moved_bytes if self.need is None else int(copied or 0)
        pinned = self.pinned_gbps * 1e9 if self.pinned_gbps else None
        ceiling = moved / pinned if moved and pinned else None
        by_kernel = moved / (self.kernel_gbps * 1e9) if moved and self.kernel_gbps else None
        back_each = counted(
            _less(_less(self.to_trainer_s, self.engine_sleep_s), self.release_to_trainer_s)
        )
        back = median(back_each)
        rolled = counted(_less(self.to_rollout_s, self.engine_wake_s))  # engine calls aside
        # What every strategy pays on the way to the rollout, cycle by cycle: its
        # bytes at the pinned rate (with --need, each cycle's own), the weight sync and
        # the engine's wake calls. The switch against that is what the target judges.
        paid = (
            [
                (b if self.need is not None else moved) / pinned + s + w
                for b, s, w in zip(
                    [float(b) for b in self.copied_bytes], self.sync_s, self.engine_wake_s
                )
            ]
            if pinned and len(self.copied_bytes) == len(self.sync_s) == len(self.engine_wake_s)
            else []
        )
        over_paid = counted(_ratios(self.to_rollout_s, paid))
        over_kernel = [t / by_kernel for t in back_each] if by_kernel else []
        steady = self.free_at_train[1:]  # the first cycle pays one-time allocations
        handback, pages = counted(self.handback), counted(self.handback_pages)
        return {
            "strategy": self.strategy,
            "model": self.model,
            "engine": self.engine,
            "cycles": self.cycles,
            "counted_cycles": len(to_rollout),
            "kv_obtained_gib": (median([float(k) for k in counted(self.kv_obtained)]) or 0) / GiB,
            "kv_obtained_gib_worst": min(counted(self.kv_obtained), default=0) / GiB,
            "kv_target_gib": self.kv_target / GiB,
            "handback": median(handback),
            "handback_worst": min(handback, default=None),
            "handback_pages": median(pages),
            "handback_pages_worst": min(pages, default=None),
            "to_rollout_s": median(to_rollout),
            "to_rollout_s_worst": max(to_rollout, default=None),
            "to_trainer_s": median(to_trainer),
            "to_trainer_s_worst": max(to_trainer, default=None),
            "offload_gbps": median(counted(self.offload_gbps)),
            "offload_of_pinned": (median(counted(self.offload_gbps)) or 0) / self.pinned_gbps
            if self.pinned_gbps
            else None,
            "peak_reserved_over_allocated": median(ratios),
            "peak_reserved_over_allocated_max": max(ratios) if ratios else None,
            "drift_mib_per_cycle": -slope([float(f) for f in steady]) / 2**20 + 0.0  # no -0.0
            if len(steady) >= 2
            else None,
            "overhead_s": median(counted(self.overhead_s)),
            "state_gib": self.state_bytes / GiB,
            "moved_gib": self.moved_bytes / GiB,
            "ceiling_s": ceiling,
            "to_rollout_over_ceiling": _over(median(to_rollout), ceiling),
            "to_trainer_over_ceiling": _over(median(to_trainer), ceiling),
            "to_rollout_over_ceiling_worst": _over(max(to_rollout, default=None), ceiling),
            "to_trainer_over_ceiling_worst": _over(max(to_trainer, default=None), ceiling),
            "engine_wake_s": median(counted(self.engine_wake_s)),
            "engine_sleep_s": median(counted(self.engine_sleep_s)),
            "train_drain_s": median(counted(self.train_drain_s)),
            # The switch to rollout over what every strategy pays in the same cycle (its
            # bytes at the pinned rate, the weight sync, the engine's wake calls): the
            # to-rollout target's figure, and its worst cycle.
            "to_rollout_over_paid": median(over_paid),
            "to_rollout_over_paid_worst": max(over_paid, default=None),
            # The switch less the engine's own calls, cycle by cycle: the part a
            # trainer-side strategy decides.
            "to_rollout_over_ceiling_engine_aside": _over(median(rolled), ceiling),
            "to_trainer_over_ceiling_engine_aside": _over(
                median(counted(_less(self.to_trainer_s, self.engine_sleep_s))), ceiling
            ),
            "release_to_rollout_s": median(counted(self.release_to_rollout_s)),
            "release_to_trainer_s": median(counted(self.release_to_trainer_s)),
            "to_rollout_over_ceiling_engine_and_release_aside": _over(
                median(counted(_less(rolled, self.release_to_rollout_s))), ceiling
            ),
            "to_trainer_over_ceiling_engine_and_release_aside": _over(back, ceiling),
            # The same over the bytes at the kernels' rate: the return's target figure
            # (a reload after the engine's free copies no faster than kernels read
            # mapped pinned memory here), and its worst cycle.
            "kernel_of_pinned": self.kernel_gbps / self.pinned_gbps
            if self.kernel_gbps and self.pinned_gbps
            else None,
            "to_trainer_over_kernel_ceiling_engine_and_release_aside": _over(back, by_kernel),
            "to_trainer_over_kernel_ceiling_engine_and_release_aside_worst": max(
                over_kernel, default=None
            ),
            # And the weight sync too (the switch to rollout runs it; it does not shrink
            # with the bytes moved and has a ceiling of its own): what is left is the
            # copies and hybridmem's own work around them.
            "to_rollout_over_ceiling_engine_release_and_sync_aside": _over(
                median(counted(_less(_less(rolled, self.release_to_rollout_s), self.sync_s))),
                ceiling,
            ),
            "trainer_cached_mib": (
                median([float(m["trainer_cached"]) for m in counted(self.missing)]) or 0.0
            )
            / 2**20
            if self.missing
            else None,
            "engine_cached_after_sleep_mib": (
                median([float(v) for v in counted(self.engine_cached_after_sleep)]) or 0.0
            )
            / 2**20
            if self.engine_cached_after_sleep
            else None,
            "missing_mib": {
                key: (median([float(m[key]) for m in counted(self.missing)]) or 0.0) / 2**20
                for key in (self.missing[0] if self.missing else {})
            },
            "deficit_gib": self.deficit_bytes / GiB,
            "copied_gib": None if copied is None else copied / GiB,
            "sync_s": median(counted(self.sync_s)),
            "stages_to_rollout_ms": stage_medians_ms(self.stages_to_rollout_s),
            "stages_to_trainer_ms": stage_medians_ms(self.stages_to_trainer_s),
            "errors": self.errors,
        }


def counted(values: list[Any]) -> list[Any]:
    """The cycles a figure counts: all but the first (a warm-up), where there are others.

    Example:
        >>> counted([9.0, 1.0, 2.0]), counted([9.0])
        ([1.0, 2.0], [9.0])
    """
    return values[1:] if len(values) > 1 else list(values)


def stage_medians_ms(cycles: list[dict[str, float]]) -> dict[str, float]:
    """Each stage's median milliseconds over the cycles after the first, in stage order.

    The first cycle pays one-time allocations (it is left out when there are others);
    a stage missing from a cycle counts 0 there (it did not run).

    Example:
        >>> stage_medians_ms([{"plan": 0.5}, {"plan": 0.001, "offload": 0.004}])
        {'plan': 1.0, 'offload': 4.0}
    """
    steady = counted(cycles)
    names: dict[str, None] = {}
    for cycle in steady:
        names.update(dict.fromkeys(cycle))
    return {
        name: (median([cycle.get(name, 0.0) for cycle in steady]) or 0.0) * 1e3 for name in names
    }


def moved_bytes_of(raw: dict[str, Any], plan: dict[str, Any] | None) -> int:
    """The ceiling's bytes of saved raw figures, also of results saved without them.

    Results saved before :attr:`Figures.moved_bytes` existed (the scale runs of
    2026-12-02) hold ``state_bytes``, parameters and optimizer state; the bench's
    parameters are fp32, so the optimizer state is ``state_bytes - 4 * params``.

    Args:
        raw: a strategy's ``"raw"`` figures as saved.
        plan: the plan saved beside them (its ``params``), or None.

    Returns:
        The bytes, or 0 when they cannot be known.

    Example:
        >>> moved_bytes_of({"state_bytes": 12_000}, {"params": 1_000})
        8000
    """
    moved = int(raw.get("moved_bytes") or 0)
    if moved:
        return moved
    state, params = int(raw.get("state_bytes") or 0), int((plan or {}).get("params") or 0)
    return max(0, state - 4 * params) if state and params else 0


def resummarise(result: dict[str, Any], plan: dict[str, Any] | None) -> dict[str, Any]:
    """A saved strategy result with its summary computed again from its raw figures.

    So that results saved by an older bench are judged by today's definitions (the
    ceiling's bytes above all). A result without (complete) raw figures is returned
    as saved.

    Example:
        >>> resummarise({"summary": {"strategy": "naive"}}, None)["summary"]
        {'strategy': 'naive'}
    """
    raw = result.get("raw")
    every = fields(Figures)
    needed = {f.name for f in every if f.default is MISSING and f.default_factory is MISSING}
    if not (isinstance(raw, dict) and needed <= raw.keys()):
        return result
    figures = Figures(**{f.name: raw[f.name] for f in every if f.name in raw})
    figures.moved_bytes = moved_bytes_of(raw, plan)
    return {**result, "summary": figures.summary()}


def median(values: list[float]) -> float | None:
    """The upper middle of ``values`` (None for none): with four cycles, the third.

    Example:
        >>> median([4.0, 1.0, 3.0, 2.0])
        3.0
    """
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def kernel_rate_note(row: dict[str, Any]) -> str | None:
    """The switch to the trainer against its bytes at the kernels' rate, said; None if unmeasured.

    Said beside the target's figure, which is over the pinned copy rate: a reload
    that starts after the engine's sleep copies no faster than kernels do there
    (:func:`~hybridmem.bench.ceilings.kernel_ceiling`), so this says how much of the
    return's excess over its target that rate leaves to hybridmem.

    Example:
        >>> row = {"to_trainer_over_kernel_ceiling_engine_and_release_aside": 1.04,
        ...        "kernel_of_pinned": 0.81}
        >>> print(kernel_rate_note(row))
        1.04x at the kernels' copy rate (0.81 of the pinned), engine calls and releases aside
        >>> kernel_rate_note({}) is None
        True
    """
    ratio = row.get("to_trainer_over_kernel_ceiling_engine_and_release_aside")
    share = row.get("kernel_of_pinned")
    if not isinstance(ratio, float | int) or not isinstance(share, float | int):
        return None
    return (
        f"{ratio:.2f}x at the kernels' copy rate ({share:.2f} of the pinned), "
        "engine calls and releases aside"
    )


def _less(totals: list[float], parts: list[float]) -> list[float]:
    """``totals`` less ``parts``, cycle by cycle (none where the cycles do not pair up)."""
    return [t - p for t, p in zip(totals, parts, strict=True)] if len(totals) == len(parts) else []


def _ratios(parts: list[float], wholes: list[float]) -> list[float]:
    """``parts`` over ``wholes``, cycle by cycle (none where the cycles do not pair up)."""
    if len(parts) != len(wholes):
        return []
    return [p / w for p, w in zip(parts, wholes, strict=True) if w > 0]


def _over(seconds: float | None, ceiling: float | None) -> float | None:
    return seconds / ceiling if seconds is not None and ceiling else None
