"""What ``hybridmem bench`` runs: sizes chosen from device memory, strategies, needs.

What a run measured is :mod:`hybridmem.bench.figures`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from hybridmem._checks import check_number

__all__ = [
    "ALL_STRATEGIES",
    "ANATOMY_NOTE",
    "COMMUNICATOR_STRATEGIES",
    "ENGINES",
    "FIXED_FRACTION",
    "MAX_COMMUNICATORS",
    "MIN_CYCLES",
    "MODELS",
    "NEED_SPARE_BYTES",
    "NEED_STRATEGIES",
    "STRATEGIES",
    "BenchPlan",
    "anatomy_note",
    "check_need",
    "choose_strategies",
    "need_kv_target",
    "plan",
    "scale_plan",
    "sizes_anatomy_note",
    "with_communicators",
]

#: ``hybridmem bench --scale``'s trainer states (GiB of model + grads + AdamW).
SCALE_GIB = (8, 32, 64)

#: The ways of switching that the bench compares (``tms`` needs torch_memory_saver).
STRATEGIES = ("naive", "handrolled", "tms", "hybridmem")
#: What ``--need`` compares at each shortfall: hybridmem offloading everything (today's
#: default), planned by the rollout's need, and a fixed share of the optimizer state
#: (NeMo-RL's fractional optimizer offload).
NEED_STRATEGIES = ("hybridmem", "planned", "fraction")
#: What ``--communicators N`` compares: hybridmem with the trainer's communicators held
#: through the rollout, and with them suspended (``hm.suspend_communicators``).
COMMUNICATOR_STRATEGIES = ("hybridmem", "suspended")
#: The most process groups ``--communicators`` makes (a Megatron rank has five to ten).
MAX_COMMUNICATORS = 64
#: Every strategy a bench process runs (the child process checks its name against this).
ALL_STRATEGIES = tuple(dict.fromkeys(STRATEGIES + NEED_STRATEGIES + COMMUNICATOR_STRATEGIES))
#: The share of the optimizer state the ``fraction`` strategy offloads, whatever is short.
FIXED_FRACTION = 0.5
#: The room ``--need`` leaves at its two ends for the processes' contexts, which grow
#: between the sizing and a switch (lazily loaded kernels: 144-176 MiB over a run on
#: an H100): at 0 the rollout lacks nothing with this much to spare (else the growth
#: makes the planned switch move a storage), at 1 it lacks all of the optimizer state
#: but this (else the planned switch fails: a need the whole state cannot cover).
NEED_SPARE_BYTES = 256 << 20
#: Which trainer model to build (see :class:`BenchPlan`).
MODELS = ("auto", "torch", "transformers")
#: Where the rollout engine keeps its memory (``hybridmem.bench.engine_memory``).
ENGINES = ("auto", "tms", "tms-torch", "vllm", "vllm-l1", "handmade")
GiB = 2**30
#: The fewest cycles a bench point runs: the first is a warm-up (one-time allocations,
#: the driver's first mappings) and is not counted; each figure is the median of the
#: other five or more, the worst printed beside it.
MIN_CYCLES = 6
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
    #: seconds each cycle's training lasts beyond the bench's own steps: a real step
    #: computes for seconds, and the switch to the rollout starts that much later
    #: after the engine's sleep freed its KV cache (``--train-s``). An allocation
    #: soon after a free waits on the driver: on an H100, 70 GiB of ``cudaMalloc``
    #: took 138-162 ms right after its free, 19-31 ms 300 ms later, 3 ms the first
    #: time (``benchmarks/alloc_scatter.py``); with milliseconds of training the KV
    #: wake, an engine call, pays it inside the switch to the rollout.
    train_s: float = 0.0
    #: ``--need``: what the rollout lacks with the whole trainer state on the device,
    #: as a share of the optimizer state (0 to 1): the KV cache is sized to it at
    #: start (:func:`need_kv_target`). None: the KV cache is ``kv_fraction`` of the
    #: device, whatever it takes.
    need: float | None = None
    #: ``--communicators N``: NCCL process groups of one rank the trainer makes once the
    #: engine has started (the default group and N - 1 subgroups, as a Megatron rank
    #: holds its TP/PP/DP/EP groups), each with its communicator made by a first
    #: all-reduce; they hold device memory through the rollout unless suspended.
    communicators: int = 0

    @property
    def params(self) -> int:
        """Approximate parameter count (transformer layers plus embedding and head)."""
        per_layer = 12 * self.d_model**2 + 13 * self.d_model
        return self.layers * per_layer + 2 * self.vocab * self.d_model

    @property
    def state_bytes(self) -> int:
        """Trainer state: parameters, gradients and AdamW moments, fp32."""
        return self.params * _STATE_BYTES_PER_PARAM

    def default_kv(self, total: int) -> int:
        """The KV cache without ``--need``: ``kv_fraction`` of ``total`` bytes, whole GiB.

        Example:
            >>> plan(141 * GiB, quick=False).default_kv(141 * GiB) // GiB
            70
        """
        return int(total * self.kv_fraction) // GiB * GiB

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params": self.params, "state_bytes": self.state_bytes}


#: Printed before a run with ``--anatomy`` and first among its verdicts
#: (:func:`anatomy_note`): its seconds are no figures.
ANATOMY_NOTE = (
    "--anatomy: every allocation's stack is recorded, so this run's seconds diagnose; "
    "they are not figures"
)


def anatomy_note(raws: Iterable[Any]) -> list[str]:
    """``[ANATOMY_NOTE]`` where any of these saved runs recorded the anatomy, else ``[]``.

    Verdicts start with it, so that results read back with ``--from-json`` say it too.

    Example:
        >>> anatomy_note([{"anatomy": []}, None]), len(anatomy_note([{"anatomy": [{}]}]))
        ([], 1)
    """
    return [ANATOMY_NOTE] if any(isinstance(r, dict) and r.get("anatomy") for r in raws) else []


def sizes_anatomy_note(sizes: Iterable[dict[str, Any]]) -> list[str]:
    """:func:`anatomy_note` over every strategy's raw run of ``--scale`` entries.

    Example:
        >>> sizes_anatomy_note([{"results": {"planned": {"raw": {"anatomy": [{}]}}}}])[0][:10]
        '--anatomy:'
    """
    return anatomy_note(r.get("raw") for size in sizes for r in size["results"].values())


#: The longest ``--rollout-s`` or ``--train-s`` the bench takes, in seconds (a cycle
#: waits that long).
MAX_PHASE_S = 600.0


def check_extra_seconds(name: str, seconds: object) -> float:
    """``seconds`` if it is a phase length the bench takes (0 to 600 s), as a float.

    Args:
        name: what the seconds are, for the error (``"rollout_s"``, ``"train_s"``).
        seconds: the value given.

    Raises:
        TypeError, ValueError: not a number of seconds in that range (the error
        names ``name``).

    Example:
        >>> check_extra_seconds("train_s", 1)
        1.0
    """
    return float(
        check_number(
            name,
            seconds,
            minimum=0,
            maximum=MAX_PHASE_S,
            expected=f"seconds from 0 to {MAX_PHASE_S:g}",
        )
    )


def with_communicators(p: BenchPlan, communicators: object) -> BenchPlan:
    """``p`` whose trainer makes ``communicators`` NCCL process groups (checked).

    Raises:
        TypeError: not an int.
        ValueError: below 0 or above :data:`MAX_COMMUNICATORS`.

    Example:
        >>> with_communicators(plan(141 * GiB, quick=True), 5).communicators
        5
    """
    if isinstance(communicators, bool) or not isinstance(communicators, int):
        raise TypeError(f"communicators must be an int, got {communicators!r}")
    if not 0 <= communicators <= MAX_COMMUNICATORS:
        raise ValueError(
            f"communicators must be 0 to {MAX_COMMUNICATORS} process groups, got {communicators}"
        )
    return replace(p, communicators=communicators)


def with_phase_lengths(p: BenchPlan, *, rollout_s: object, train_s: object) -> BenchPlan:
    """``p`` with ``--rollout-s`` and ``--train-s``, each checked (0 to 600 s).

    Raises:
        TypeError, ValueError: either is not seconds from 0 to 600 (the error names it).

    Example:
        >>> p = plan(141 * GiB, quick=True)
        >>> with_phase_lengths(p, rollout_s=2, train_s=1).train_s
        1.0
    """
    return replace(
        p,
        rollout_s=check_extra_seconds("rollout_s", rollout_s),
        train_s=check_extra_seconds("train_s", train_s),
    )


def phase_lengths_said(p: BenchPlan) -> str:
    """What a run's header says of ``--rollout-s``, ``--train-s`` and ``--communicators``.

    "" when none is given.

    Example:
        >>> p = with_phase_lengths(plan(141 * GiB, quick=True), rollout_s=2, train_s=1)
        >>> phase_lengths_said(p)
        ', rollouts of 2 s more, training 1 s longer'
    """
    return (
        (f", rollouts of {p.rollout_s:g} s more" if p.rollout_s else "")
        + (f", training {p.train_s:g} s longer" if p.train_s else "")
        + (f", {p.communicators} NCCL process groups in the trainer" if p.communicators else "")
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
        cycles: override the number of cycles (at least :data:`MIN_CYCLES`: the first
            is a warm-up, every figure is the median of the rest).
        model: the trainer's model: ``"auto"``, ``"torch"`` or ``"transformers"``.
        engine: the rollout engine's memory: ``"auto"``, ``"tms"`` (torch_memory_saver,
            preload mode), ``"tms-torch"`` (its torch mode), ``"vllm"`` / ``"vllm-l1"``
            (vLLM's sleep-mode pool, slept at level 2 / 1) or ``"handmade"``.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    check_number("total_bytes", total_bytes, above=0)
    if cycles is not None:
        check_number("cycles", cycles, integer=True, expected="an int or None")
    if cycles is not None and cycles < MIN_CYCLES:
        raise ValueError(
            f"cycles must be >= {MIN_CYCLES} (the first is a warm-up, the figures are "
            f"medians of the rest), got {cycles}"
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
        cycles: cycles per strategy (default and least :data:`MIN_CYCLES`).
        model, engine: as for :func:`plan`.

    Raises:
        ValueError: a size the device cannot hold beside the KV cache.

    Example:
        >>> round(scale_plan(141 << 30, 8).state_bytes / 2**30, 1)
        8.0
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
        cycles=cycles if cycles is not None else MIN_CYCLES,
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
    free: int,
    weights: int,
    optimizer: int,
    need: float,
    margin: int,
    step: int = GiB,
    spare: int = NEED_SPARE_BYTES,
) -> tuple[int, int]:
    """The KV cache that leaves a rollout ``need`` x ``optimizer`` bytes short: (KV, deficit).

    With the trainer's state on the device, ``free`` bytes are free; the rollout wakes
    ``weights`` and then its KV cache, and a planned switch keeps ``margin`` beyond
    them. The KV cache is cut to a whole number of ``step`` bytes (the unit the
    bench's engine allocates it in, :func:`hybridmem.bench.engine_memory.kv_unit`), so
    the deficit is what that cache really lacks, ``weights + KV + margin - free`` (at
    least 0): the share asked for, less under one ``step``; at a share of 0 nothing,
    with ``spare`` bytes free besides; never more than the optimizer state less
    ``spare`` (:data:`NEED_SPARE_BYTES`). A coarse step distorts small states: cut to
    whole GiB, a quarter of a 4 GiB optimizer state comes out 0 to 1 GiB short.

    Args:
        free, weights, optimizer: bytes free, of the engine's weights, of the optimizer
            state.
        need: the share of ``optimizer`` the rollout lacks (:func:`check_need`).
        margin: what a planned switch keeps free beyond the need.
        step: the unit the KV cache is cut to (whole GiB by default).
        spare: the room left for the contexts' growth at a share of 0 and of 1.

    Returns:
        ``(KV cache bytes, deficit bytes)``.

    Raises:
        ValueError: the device cannot hold that cache even with the whole optimizer
            state offloaded (a smaller ``--need`` or ``--scale`` size is needed).

    Example:
        >>> [n // GiB for n in need_kv_target(100 * GiB, 10 * GiB, 40 * GiB, 0.5, 0)]
        [110, 20]
        >>> kv, short = need_kv_target(
        ...     70 * GiB + (13 << 20), 2 * GiB, 4 * GiB, 0.25, 256 << 20, step=32 << 20)
        >>> (short >> 20, kv % (32 << 20))  # a quarter of 4 GiB, less 13 MiB; whole steps
        (1011, 0)
    """
    check_need(need)
    check_number("step", step, integer=True, minimum=1, expected="an int >= 1 (bytes)")
    check_number("spare", spare, integer=True, minimum=0, expected="an int >= 0 (bytes)")
    short = min(int(need * optimizer), optimizer - spare) if need else -spare
    kv = (free - weights - margin + short) // step * step
    if kv <= 0 or weights + kv + margin > free + optimizer:
        raise ValueError(
            f"no KV cache fits a need of {need:.0%} of the optimizer state: "
            f"{free / GiB:.1f} GiB free, {weights / GiB:.1f} GiB of weights, "
            f"{optimizer / GiB:.1f} GiB of optimizer state"
        )
    return kv, max(0, weights + kv + margin - free)
