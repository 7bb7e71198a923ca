"""What ``hybridmem bench`` runs: sizes chosen from device memory, and the figures it reports."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from hybridmem._checks import check_number
from hybridmem.observe.leakwatch import slope

__all__ = [
    "ALL_STRATEGIES",
    "ENGINES",
    "FIXED_FRACTION",
    "MODELS",
    "NEED_STRATEGIES",
    "STRATEGIES",
    "BenchPlan",
    "Figures",
    "check_need",
    "choose_strategies",
    "handback_ratio",
    "moved_bytes_of",
    "need_kv_target",
    "plan",
    "resummarise",
    "scale_plan",
]

#: ``hybridmem bench --scale``'s trainer states (GiB of model + grads + AdamW).
SCALE_GIB = (8, 32, 64)

#: The ways of switching that the bench compares (``tms`` needs torch_memory_saver).
STRATEGIES = ("naive", "handrolled", "tms", "hybridmem")
#: What ``--need`` compares at each shortfall: hybridmem offloading everything (today's
#: default), planned by the rollout's need, and a fixed share of the optimizer state
#: (NeMo-RL's fractional optimizer offload).
NEED_STRATEGIES = ("hybridmem", "planned", "fraction")
#: Every strategy a bench process runs (the child process checks its name against this).
ALL_STRATEGIES = tuple(dict.fromkeys(STRATEGIES + NEED_STRATEGIES))
#: The share of the optimizer state the ``fraction`` strategy offloads, whatever is short.
FIXED_FRACTION = 0.5
#: Which trainer model to build (see :class:`BenchPlan`).
MODELS = ("auto", "torch", "transformers")
#: Where the rollout engine keeps its memory (``hybridmem.bench.engine_memory``).
ENGINES = ("auto", "tms", "tms-torch", "handmade")
GiB = 2**30
# fp32 parameters, gradients and two AdamW moments: 16 bytes per parameter.
_STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class BenchPlan:
    """The synthetic hybrid engine: trainer model, batches, cycles, rollout KV cache."""

    d_model: int
    layers: int
    heads: int
    vocab: int
    batch: int
    seq_min: int
    seq_max: int
    train_steps: int
    cycles: int
    kv_fraction: float
    bucket_bytes: int
    #: ``"auto"`` (transformers' Llama when importable, else torch's modules),
    #: ``"torch"`` or ``"transformers"``.
    model: str = "auto"
    #: the rollout engine's memory (``ENGINE_MEMORIES``): ``"auto"`` is
    #: torch_memory_saver in preload mode where it is installed, else hand-made.
    engine: str = "auto"
    #: record where allocations were made, and at each KV wake what each process's
    #: cache is made of (``raw["anatomy"]``); slows the run (diagnostics).
    anatomy: bool = False
    #: seconds the rollout lasts beyond the bench's own generation (about 18 ms): a
    #: real rollout generates for seconds, and the switch back starts that much later
    #: after the KV cache's wake and the offload's frees (``--rollout-s``).
    rollout_s: float = 0.0
    #: ``--need``: what the rollout lacks with the whole trainer state on the device,
    #: as a share of the optimizer state (0 to 1): the KV cache is sized to it at
    #: start (:func:`need_kv_target`). None: the KV cache is ``kv_fraction`` of the
    #: device, whatever it takes.
    need: float | None = None

    @property
    def params(self) -> int:
        """Approximate parameter count (transformer layers plus embedding and head)."""
        per_layer = 12 * self.d_model**2 + 13 * self.d_model
        return self.layers * per_layer + 2 * self.vocab * self.d_model

    @property
    def state_bytes(self) -> int:
        """Trainer state: parameters, gradients and AdamW moments, fp32."""
        return self.params * _STATE_BYTES_PER_PARAM

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params": self.params, "state_bytes": self.state_bytes}


#: The longest rollout ``--rollout-s`` takes, in seconds (a cycle waits that long).
MAX_ROLLOUT_S = 600.0


def check_rollout_s(seconds: object) -> float:
    """``seconds`` if it is a rollout length the bench takes (0 to 600 s).

    Raises:
        TypeError, ValueError: not a number of seconds in that range.

    Example:
        >>> check_rollout_s(1)
        1.0
    """
    return float(
        check_number(
            "rollout_s",
            seconds,
            minimum=0,
            maximum=MAX_ROLLOUT_S,
            expected=f"seconds from 0 to {MAX_ROLLOUT_S:g}",
        )
    )


def plan(
    total_bytes: int,
    *,
    quick: bool,
    cycles: int | None = None,
    model: str = "auto",
    engine: str = "auto",
) -> BenchPlan:
    """Size the engine from the device's memory.

    The trainer state takes about 8% of the device (4% with ``quick``), the rollout
    engine's KV cache half of it, activations of variable-length batches the rest,
    so that a switch that hands memory back badly shows as a smaller KV cache.

    Args:
        total_bytes: the device's memory.
        quick: the small plan (6 cycles) instead of the full one (100 cycles, the
            window over which drift is judged).
        cycles: override the number of cycles (at least 2: drift needs two points).
        model: the trainer's model: ``"auto"``, ``"torch"`` or ``"transformers"``.
        engine: the rollout engine's memory: ``"auto"``, ``"tms"`` (torch_memory_saver,
            preload mode), ``"tms-torch"`` (its torch mode) or ``"handmade"``.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    check_number("total_bytes", total_bytes, above=0)
    if cycles is not None:
        check_number("cycles", cycles, integer=True, expected="an int or None")
    if cycles is not None and cycles < 2:
        raise ValueError(
            f"cycles must be >= 2 (drift needs two cycles after the first), got {cycles}"
        )
    share = 0.04 if quick else 0.08
    params = int(total_bytes * share / _STATE_BYTES_PER_PARAM)
    d_model = 1024 if params < 400e6 else 2048
    vocab = 32768
    layers = max(2, min(48, (params - 2 * vocab * d_model) // (12 * d_model**2)))
    return BenchPlan(
        d_model=d_model,
        layers=int(layers),
        heads=d_model // 128,
        vocab=vocab,
        batch=8,
        seq_min=128,
        seq_max=1024 if quick else 2048,
        train_steps=3 if quick else 2,
        cycles=cycles if cycles is not None else (6 if quick else 100),
        kv_fraction=0.5,
        bucket_bytes=256 << 20,
        model=model,
        engine=engine,
    )


def scale_plan(
    total_bytes: int,
    state_gib: float,
    *,
    cycles: int | None = None,
    model: str = "auto",
    engine: str = "auto",
) -> BenchPlan:
    """A plan whose trainer state is ``state_gib`` GiB: the switch at model scale.

    The model is widened with the state (``d_model`` 1024 below 400 M parameters,
    2048 below 2.5 B, 4096 above) and its batches kept short (2 x 128-512 tokens, one
    step per cycle), so that the activations stay small beside the state and what is
    timed is the hand-over of the state. The rollout engine's KV cache takes half of
    the device, as in :func:`plan`.

    Args:
        total_bytes: the device's memory.
        state_gib: the trainer state's size in GiB (fp32 parameters, gradients and
            two AdamW moments: 16 bytes per parameter); with the engine's weights (a
            quarter of it) it must fit in 75% of the device (the KV cache wakes only
            once the state is handed over).
        cycles: cycles per strategy (default 4; at least 2).
        model, engine: as for :func:`plan`.

    Raises:
        ValueError: a size the device cannot hold beside the KV cache.

    Example:
        >>> scale_plan(141 << 30, 8).state_bytes / 2**30  # doctest: +ELLIPSIS
        7.9...
    """
    check_number("total_bytes", total_bytes, above=0)
    check_number("state_gib", state_gib, above=0)
    base = plan(total_bytes, quick=True, cycles=cycles, model=model, engine=engine)
    state = int(state_gib * GiB)
    # Training holds the state and the engine's fp32 weights (a quarter of it): with
    # activations and contexts, three quarters of the device at most.
    if state * 1.25 > total_bytes * 0.75:
        raise ValueError(
            f"a trainer state of {state_gib:g} GiB and the engine's weights (a quarter of "
            f"it) do not fit in 75% of a {total_bytes / GiB:.0f} GiB device; the largest "
            f"is {total_bytes * 0.6 / GiB:.0f} GiB: pass smaller sizes to --scale"
        )
    params = state // _STATE_BYTES_PER_PARAM
    d_model = 1024 if params < 400e6 else 2048 if params < 2.5e9 else 4096
    vocab = base.vocab
    layers = max(2, (params - 2 * vocab * d_model) // (12 * d_model**2))
    return BenchPlan(
        d_model=d_model,
        layers=int(layers),
        heads=d_model // 128,
        vocab=vocab,
        batch=2,
        seq_min=128,
        seq_max=512,
        train_steps=1,
        cycles=cycles if cycles is not None else 4,
        kv_fraction=base.kv_fraction,
        bucket_bytes=base.bucket_bytes,
        model=model,
        engine=engine,
    )


def choose_strategies(requested: list[str] | None, *, tms: bool) -> tuple[list[str], str]:
    """The strategies to run (as asked, once each) and what was left out (or ``""``).

    Args:
        requested: the names asked for; None for all that can run here.
        tms: whether torch_memory_saver (and its preload library) is installed.

    Raises:
        ValueError: an unknown name, or ``tms`` asked for where it cannot run.
    """
    if requested is None:
        chosen = [s for s in STRATEGIES if s != "tms" or tms]
        skipped = (
            ""
            if tms
            else (
                "strategy tms skipped: torch_memory_saver is not installed "
                "(pip install torch-memory-saver)"
            )
        )
        return chosen, skipped
    unknown = [s for s in requested if s not in ALL_STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown strategy {unknown[0]!r}; strategies are {', '.join(ALL_STRATEGIES)}"
        )
    if "tms" in requested and not tms:
        raise ValueError(
            "strategy tms needs torch_memory_saver and its preload library: pip install "
            "torch-memory-saver (or leave tms out of --strategies)"
        )
    return list(dict.fromkeys(requested)), ""


def check_need(need: object) -> float:
    """``need`` if it is a shortfall ``--need`` takes: a share of the optimizer state, 0 to 1.

    Raises:
        TypeError, ValueError: not a number from 0 to 1.

    Example:
        >>> check_need(0.25)
        0.25
    """
    return float(check_number("need", need, minimum=0, maximum=1, expected="a share from 0 to 1"))


def need_kv_target(
    free: int, weights: int, optimizer: int, need: float, margin: int
) -> tuple[int, int]:
    """The KV cache that leaves a rollout ``need`` x ``optimizer`` bytes short: (KV, deficit).

    With the trainer's state on the device, ``free`` bytes are free; the rollout wakes
    ``weights`` and then its KV cache, and a planned switch keeps ``margin`` beyond
    them. The KV cache is cut to whole GiB (as the bench's engine allocates it), so the
    deficit is what that cache really lacks: ``weights + KV + margin - free``, at least 0.

    Raises:
        ValueError: the device cannot hold that cache even with the whole optimizer
            state offloaded (a smaller ``--need`` or ``--scale`` size is needed).

    Example:
        >>> [n // GiB for n in need_kv_target(100 * GiB, 10 * GiB, 40 * GiB, 0.5, 0)]
        [110, 20]
    """
    check_need(need)
    kv = (free - weights - margin + int(need * optimizer)) // GiB * GiB
    if kv <= 0 or weights + kv + margin > free + optimizer:
        raise ValueError(
            f"no KV cache fits a need of {need:.0%} of the optimizer state: "
            f"{free / GiB:.1f} GiB free, {weights / GiB:.1f} GiB of weights, "
            f"{optimizer / GiB:.1f} GiB of optimizer state"
        )
    return kv, max(0, weights + kv + margin - free)


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
    #: rollout is timed, since no strategy can start its copies before that work
    #:. Before, that wait was inside the to-rollout seconds. Empty in
    #: results saved before.
    train_drain_s: list[float] = field(default_factory=list)
    #: what packing the engine's weights into one segment did at their last making
    #: (the ``hybridmem`` strategy: a ``SegmentReport`` of :func:`hybridmem.one_segment`
    #: as text); empty where nothing was packed, and in results saved before.
    engine_packed: str = ""
    #: ``--need`` runs: the need asked for (:attr:`BenchPlan.need`), what the rollout
    #: was short with the whole state on the device (:func:`need_kv_target`), and per
    #: cycle the bytes each switch to rollout copied to the host (0 where nothing was
    #: short), which are then the ceiling's bytes. None, 0 and empty otherwise.
    need: float | None = None
    deficit_bytes: int = 0
    copied_bytes: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Medians and the drift slope, JSON-ready."""

        def median(values: list[float]) -> float | None:
            ordered = sorted(values)
            return ordered[len(ordered) // 2] if ordered else None

        ratios = [r / a for r, a in zip(self.peak_reserved, self.peak_allocated, strict=True) if a]
        # One direction's bytes at the pinned copy rate measured in the same process:
        # with --need, the bytes this strategy copied (each moves its own share).
        copied = median([float(b) for b in self.copied_bytes])  # per switch to rollout
        moved = self.moved_bytes if self.need is None else int(copied or 0)
        ceiling = moved / (self.pinned_gbps * 1e9) if moved and self.pinned_gbps else None
        ratio = median(ratios)
        steady = self.free_at_train[1:]  # the first cycle pays one-time allocations
        return {
            "strategy": self.strategy,
            "model": self.model,
            "engine": self.engine,
            "cycles": self.cycles,
            "kv_obtained_gib": (median([float(k) for k in self.kv_obtained]) or 0) / GiB,
            "kv_target_gib": self.kv_target / GiB,
            "handback": median(self.handback),
            "to_rollout_s": median(self.to_rollout_s),
            "to_trainer_s": median(self.to_trainer_s),
            "offload_gbps": median(self.offload_gbps),
            "offload_of_pinned": (median(self.offload_gbps) or 0) / self.pinned_gbps
            if self.pinned_gbps
            else None,
            "peak_reserved_over_allocated": ratio,
            "peak_reserved_over_allocated_max": max(ratios) if ratios else None,
            "drift_mib_per_cycle": -slope([float(f) for f in steady]) / 2**20 + 0.0  # no -0.0
            if len(steady) >= 2
            else None,
            "overhead_s": median(self.overhead_s),
            "state_gib": self.state_bytes / GiB,
            "moved_gib": self.moved_bytes / GiB,
            "ceiling_s": ceiling,
            "to_rollout_over_ceiling": _over(median(self.to_rollout_s), ceiling),
            "to_trainer_over_ceiling": _over(median(self.to_trainer_s), ceiling),
            "engine_wake_s": median(self.engine_wake_s),
            "engine_sleep_s": median(self.engine_sleep_s),
            "train_drain_s": median(self.train_drain_s),
            # The cycles after the first (which pays one-time allocations), shown beside
            # the figure the target is judged by: with four cycles that figure, the
            # upper middle, is the slowest of the steady three.
            "to_rollout_over_ceiling_steady": _over(median(self.to_rollout_s[1:]), ceiling),
            "to_trainer_over_ceiling_steady": _over(median(self.to_trainer_s[1:]), ceiling),
            # The switch less the engine's own calls, cycle by cycle: the part a
            # trainer-side strategy decides.
            "to_rollout_over_ceiling_engine_aside": _over(
                median(_less(self.to_rollout_s, self.engine_wake_s)), ceiling
            ),
            "to_trainer_over_ceiling_engine_aside": _over(
                median(_less(self.to_trainer_s, self.engine_sleep_s)), ceiling
            ),
            "release_to_rollout_s": median(self.release_to_rollout_s),
            "release_to_trainer_s": median(self.release_to_trainer_s),
            # The same less the switch's release too, cycle by cycle: what the need
            # target judges (its copies within 1.1x of the ceiling, plus the release).
            "to_rollout_over_ceiling_engine_and_release_aside": _over(
                median(
                    _less(_less(self.to_rollout_s, self.engine_wake_s), self.release_to_rollout_s)
                ),
                ceiling,
            ),
            "to_trainer_over_ceiling_engine_and_release_aside": _over(
                median(
                    _less(_less(self.to_trainer_s, self.engine_sleep_s), self.release_to_trainer_s)
                ),
                ceiling,
            ),
            "trainer_cached_mib": (
                median([float(m["trainer_cached"]) for m in self.missing]) or 0.0
            )
            / 2**20
            if self.missing
            else None,
            "engine_cached_after_sleep_mib": (
                median([float(v) for v in self.engine_cached_after_sleep]) or 0.0
            )
            / 2**20
            if self.engine_cached_after_sleep
            else None,
            "missing_mib": {
                key: (median([float(m[key]) for m in self.missing]) or 0.0) / 2**20
                for key in (self.missing[0] if self.missing else {})
            },
            "deficit_gib": self.deficit_bytes / GiB,
            "copied_gib": None if copied is None else copied / GiB,
            "errors": self.errors,
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


def _less(totals: list[float], parts: list[float]) -> list[float]:
    """``totals`` less ``parts``, cycle by cycle (none where the cycles do not pair up)."""
    return [t - p for t, p in zip(totals, parts, strict=True)] if len(totals) == len(parts) else []


def _over(seconds: float | None, ceiling: float | None) -> float | None:
    return seconds / ceiling if seconds is not None and ceiling else None
