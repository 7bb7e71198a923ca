"""Run the bench: one child process per strategy, a progress bar, a table, JSON and a plot.

``python -m hybridmem.bench.run STRATEGY PLAN_JSON`` is the child: it starts the
engine process, trains and switches for the planned cycles, and prints its figures
as one JSON line (progress goes to stderr as ``progress I N`` lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hybridmem._format import first_line
from hybridmem.bench.ceilings import kernel_ceiling, pinned_ceiling
from hybridmem.bench.communicators import destroy_communicators, make_communicators
from hybridmem.bench.figures import Figures
from hybridmem.bench.outputs import (
    load_results,
    report,
    save_so_far,
)
from hybridmem.bench.peers import run_child
from hybridmem.bench.plan import (
    ALL_STRATEGIES,
    ANATOMY_NOTE,
    COMMUNICATOR_STRATEGIES,
    BenchPlan,
    need_kv_target,
    phase_lengths_said,
    plan,
    with_communicators,
    with_phase_lengths,
)
from hybridmem.bench.report import format_table, plot_results, verdicts
from hybridmem.bench.setup import prepare
from hybridmem.observe import timeline as _timeline
from hybridmem.observe.timeline import record

__all__ = ["bench", "load_results", "report", "run_strategy"]


GiB = 2**30


def _model(p: BenchPlan, device: Any = "cuda") -> tuple[Any, str]:
    """Build the trainer's language model on ``device``; return it and what it is.

    ``p.model == "auto"`` takes a Llama from transformers when it is importable
    (built from a config, no download), else torch's own modules. Both map token ids
    to logits and have about ``p.params`` parameters (12·d² per layer: the Llama's MLP
    is 8/3·d wide so that it matches the 4·d of torch's layer).

    The parameters are made on ``device`` (``torch.device`` as a context), not on
    the host and then moved: at ``bench --scale``'s 64 GiB a 4 B-parameter model's
    random init on the CPU took most of a strategy's minute of device time.

    Raises:
        RuntimeError: ``p.model == "transformers"`` and transformers is missing.
    """
    import importlib
    import importlib.util

    import torch

    use_hf = p.model == "transformers" or (
        p.model == "auto" and importlib.util.find_spec("transformers") is not None
    )
    if use_hf:
        # transformers is optional (the `bench` extra): imported by name so that the
        # package, and mypy --strict over it, never need it installed.
        try:
            transformers: Any = importlib.import_module("transformers")
        except ImportError as exc:
            raise RuntimeError(
                "the bench's --model transformers needs transformers: pip install transformers"
            ) from exc
        LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
        config = LlamaConfig(
            hidden_size=p.d_model,
            num_hidden_layers=p.layers,
            num_attention_heads=p.heads,
            intermediate_size=round(8 * p.d_model / 3),
            vocab_size=p.vocab,
            max_position_embeddings=p.seq_max,
        )
        with torch.device(device):
            inner = LlamaForCausalLM(config)

        class HFLM(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                return self.inner(input_ids=tokens, use_cache=False).logits  # type: ignore[no-any-return]

        return HFLM(), "transformers LlamaForCausalLM"

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(p.vocab, p.d_model)
            layer = torch.nn.TransformerEncoderLayer(
                p.d_model, p.heads, 4 * p.d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            self.body = torch.nn.TransformerEncoder(layer, p.layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(p.d_model, p.vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(tokens)))  # type: ignore[no-any-return]

    with torch.device(device):
        return LM(), "torch TransformerEncoder"


def run_strategy(name: str, p: BenchPlan, timeline: str | None = None) -> dict[str, Any]:
    """Run one strategy in this process (which must have a GPU); return its figures.

    With ``timeline``, the cycles are recorded (:func:`hybridmem.record`) there, each
    bench step a ``bench:...`` phase span, and the engine records its own commands to
    ``TIMELINE.engine``: ``hybridmem plot`` merges both on one time axis.
    """
    import os

    import torch
    import torch.multiprocessing as mp

    from hybridmem.bench.engine import BoundedConn, EngineClient, serve, start_engine
    from hybridmem.bench.engine_memory import kv_unit, resolve
    from hybridmem.bench.strategies import make_strategy, strategy_classes

    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")  # TF32, as trainers run fp32 weights
    if p.anatomy:
        from hybridmem import _torch

        _torch.record_memory_history(True)
    device = torch.cuda.current_device()
    torch.zeros(1, device="cuda")
    total = torch.cuda.mem_get_info()[1]
    model, model_name = _model(p)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    shapes = {
        k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
        for k, v in model.state_dict().items()
    }
    ctx = mp.get_context("spawn")
    # The engine process records to a file of its own, never the trainer's.
    os.environ.pop(_timeline.TIMELINE_ENV, None)
    engine_timeline = f"{timeline}.engine" if timeline else None
    conn, child = ctx.Pipe()
    memory_kind = resolve(p.engine)
    engine_process = start_engine(
        ctx,
        serve,
        (child, device, p.default_kv(total), shapes, memory_kind, p.anatomy, engine_timeline),
        memory_kind,
    )
    bounded = BoundedConn(conn, engine_process.pid)
    _, engine_reserved, engine_name = bounded.recv()
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    context = total - free - torch.cuda.memory_reserved() - engine_reserved
    engine = EngineClient(bounded, context, total, anatomy=p.anatomy)
    make_communicators(p.communicators)  # after the start: what they hold is no context

    def train(state_scope: contextlib.AbstractContextManager[Any] | None = None) -> None:
        for _ in range(p.train_steps):
            length = int(torch.randint(p.seq_min, p.seq_max + 1, ()).item())
            tokens = torch.randint(0, p.vocab, (p.batch, length), device="cuda")
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, p.vocab).float(), tokens[:, 1:].reshape(-1)
            )
            loss.backward()  # type: ignore[no-untyped-call]
            if state_scope is not None:  # the first step makes the optimizer's state
                # In fresh segments: a torch_memory_saver region only holds what the
                # allocator asks the driver for while it is open, not reused cache.
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                with state_scope:
                    optimizer.step()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # the step's temporaries: what stays is the state
                engine.trainer_region = (
                    torch.cuda.memory_allocated() - before[0],
                    torch.cuda.memory_reserved() - before[1],
                )
                state_scope = None
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    # The optimizer state exists before the first offload, made where the strategy
    # keeps it (a torch_memory_saver region for ``tms``).
    train(strategy_classes()[name].state_scope())
    # The warm-up's cached activations would count in the first cycle's peak reserved.
    torch.cuda.empty_cache()
    optimizer_bytes = sum(
        t.nbytes
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    strategy = make_strategy(name, p, model, optimizer, engine)
    kv_target, deficit = p.default_kv(total), 0
    if p.need is not None:  # a KV cache the rollout lacks p.need of the optimizer state for
        from hybridmem.engine.switch_offload import NEED_MARGIN_BYTES

        # Measured once the strategy made its own allocations (its weight bucket),
        # with the whole trainer state on the device and the engine asleep.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        weights = sum(t.nbytes for t in model.state_dict().values())
        free_now = torch.cuda.mem_get_info()[0]
        kv_target, deficit = need_kv_target(
            free_now, weights, optimizer_bytes, p.need, NEED_MARGIN_BYTES, step=kv_unit(shapes)
        )
        engine.call("kv_target", kv_target)
        engine.rollout_need = weights + kv_target  # what the planned strategy is told
    figures = Figures(name, p.cycles, kv_target, [], [], [], [], [], 0.0, [], [], [], [], [])
    figures.need, figures.deficit_bytes = p.need, deficit
    figures.model = model_name
    figures.engine = engine_name
    figures.state_bytes = optimizer_bytes + sum(t.nbytes for t in model.parameters())
    figures.moved_bytes = optimizer_bytes  # what every strategy offloads and reloads
    figures.pinned_gbps = pinned_ceiling(optimizer_bytes)
    figures.kernel_gbps = kernel_ceiling(optimizer_bytes)
    recording = record(timeline, process="trainer") if timeline else contextlib.nullcontext()
    with recording:
        for cycle in range(p.cycles):
            print(f"progress {cycle} {p.cycles}", file=sys.stderr, flush=True)
            _cycle(cycle, p, strategy, engine, train, figures)
    print(f"progress {p.cycles} {p.cycles}", file=sys.stderr, flush=True)
    figures.engine_packed = str(engine.call("pack_report")[1])
    bounded.send(("stop",))
    bounded.recv()
    engine_process.join(timeout=60)
    destroy_communicators(p.communicators)
    return {"summary": figures.summary(), "raw": figures.__dict__}


@contextlib.contextmanager
def _step(name: str) -> Iterator[None]:
    """A ``bench:NAME`` phase span on the timeline (nothing when not recording)."""
    span = _timeline.begin(f"bench:{name}", "phase", backend="bench")
    try:
        yield
    finally:
        _timeline.end(span)


def _cycle(
    cycle: int,
    p: BenchPlan,
    strategy: Any,
    engine: Any,
    train: Callable[[], None],
    figures: Figures,
) -> None:
    """One train -> rollout -> train cycle, measured into ``figures``."""
    import torch

    from hybridmem.bench.engine import EngineOutOfMemory

    try:
        torch.cuda.synchronize()
        figures.free_at_train.append(torch.cuda.mem_get_info()[0])
        torch.cuda.reset_peak_memory_stats()
        with _step("train"), strategy.train_scope():
            train()
            if p.train_s:  # the rest of a real training phase's length, untimed
                time.sleep(p.train_s)
        figures.peak_reserved.append(torch.cuda.max_memory_reserved())
        figures.peak_allocated.append(torch.cuda.max_memory_allocated())
        engine.engine_seconds = engine.memory_seconds = 0.0
        # The step's kernels may still run: the host queues them ahead of the GPU.
        # Every strategy's first copy waits for them, so they are no switch's time,
        # nor in the ceiling it is measured against: waited for here.
        drained = time.perf_counter()
        torch.cuda.synchronize()
        figures.train_drain_s.append(time.perf_counter() - drained)
        started = time.perf_counter()
        with _step("to_rollout"):
            out = strategy.to_rollout()
        to_rollout = time.perf_counter() - started
        wake = engine.memory_seconds
        engine.read_handback()  # untimed: the switch is done
        figures.kv_obtained.append(engine.last_kv)
        figures.handback.append(engine.last_handback)
        if engine.last_handback_pages is not None:
            figures.handback_pages.append(engine.last_handback_pages)
        figures.missing.append(dict(engine.last_missing))
        if engine.last_anatomy:
            figures.anatomy.append(engine.last_anatomy)
        engine_before = engine.engine_seconds
        with _step("generate"):
            try:
                engine.call("generate", p.d_model)
            except EngineOutOfMemory as exc:  # the strategy left the rollout too little
                moved = f"the switch moved {out.copy_bytes / GiB:.2f} GiB"
                if figures.need is not None:
                    moved += f" where the rollout lacked {figures.deficit_bytes / GiB:.2f} GiB"
                figures.errors.append(f"cycle {cycle}: {str(exc).rstrip('.')}; {moved}")
            if p.rollout_s:  # the rest of a real rollout's length, untimed
                time.sleep(p.rollout_s)
        generate = engine.engine_seconds - engine_before
        engine.memory_seconds = 0.0
        started = time.perf_counter()
        with _step("to_trainer"):
            back = strategy.to_trainer()
        to_trainer = time.perf_counter() - started
        figures.to_rollout_s.append(to_rollout)
        figures.to_trainer_s.append(to_trainer)
        figures.engine_wake_s.append(wake)
        figures.engine_sleep_s.append(engine.memory_seconds)
        figures.release_to_rollout_s.append(out.release_s)
        figures.release_to_trainer_s.append(back.release_s)
        figures.copied_bytes.append(out.copy_bytes)
        figures.sync_s.append(out.sync_s)
        if out.stages or back.stages:
            figures.stages_to_rollout_s.append(_with_outside(out.stages, to_rollout))
            figures.stages_to_trainer_s.append(_with_outside(back.stages, to_trainer))
        if out.copy_s > 0 and out.copy_bytes:
            figures.offload_gbps.append(out.copy_bytes / out.copy_s / 1e9)
        work = out.copy_s + back.copy_s + out.sync_s + engine.engine_seconds - generate
        figures.overhead_s.append(max(0.0, to_rollout + to_trainer - work))
        _, asleep_allocated, asleep_reserved = engine.call("stats")  # untimed: asleep now
        figures.engine_cached_after_sleep.append(asleep_reserved - asleep_allocated)
    except torch.OutOfMemoryError as exc:
        figures.errors.append(f"cycle {cycle}: {first_line(exc)}")
        torch.cuda.empty_cache()


#: A switch's seconds in none of its stages: its bookkeeping between them (memory
#: readings, reports) and the strategy's own calls around it.
OUTSIDE_STAGES = "outside stages"


def _with_outside(stages: dict[str, float], seconds: float) -> dict[str, float]:
    """``stages`` and the rest of a switch's ``seconds`` (:data:`OUTSIDE_STAGES`)."""
    return {**stages, OUTSIDE_STAGES: max(0.0, seconds - sum(stages.values()))}


def _bar(name: str, done: int, total: int) -> str:
    width = 30
    filled = width * done // max(total, 1)
    return f"\r{name:<11} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def child_run(name: str, p: BenchPlan, timeline: str | None) -> dict[str, Any]:
    """Run strategy ``name`` with plan ``p`` in a child process; return its figures.

    A progress bar goes to stderr, ending with the child's wall time (its setup
    included: what a run of many strategies and sizes is planned by); a child that
    fails returns a summary holding its last stderr lines as ``errors`` (the bench
    goes on with the next one).
    """
    import os

    from hybridmem.bench.engine_memory import not_preloaded, preloaded

    command = [sys.executable, "-m", "hybridmem.bench.run", name, json.dumps(p.as_dict())]
    if timeline:
        command.append(f"{timeline}.{name}")
    # slime's and AReaL's trainers run with torch_memory_saver's preload library; the
    # others without it, even when the bench itself was started preloaded.
    env = (preloaded if name == "tms" else not_preloaded)(os.environ)
    tail: deque[str] = deque(maxlen=5)  # its last lines: the error, where it fails

    def on_line(line: str) -> None:
        if line.startswith("progress "):
            _, done, total = line.split()
            sys.stderr.write(_bar(name, int(done), int(total)))
            sys.stderr.flush()
        else:
            tail.append(line + "\n")

    # Both pipes read at once, and a child silent for CHILD_SILENCE_S killed: the
    # bench never hangs on one strategy (a child stuck in a driver call, say).
    started = time.perf_counter()
    child = run_child(command, env=env, on_line=on_line)
    sys.stderr.write(f"  {time.perf_counter() - started:.0f} s\n")
    if child.silent_s is not None:
        stuck = f"no output for {child.silent_s:.0f} s: killed (stuck?)"
        return {"summary": {"strategy": name, "errors": [stuck, "".join(tail).strip()]}}
    if child.returncode != 0:
        return {"summary": {"strategy": name, "errors": ["".join(tail).strip()]}}
    printed = child.stdout.strip().splitlines()
    if not printed:
        return {"summary": {"strategy": name, "errors": ["exited 0 but printed no figures"]}}
    result: dict[str, Any] = json.loads(printed[-1])
    return result


def bench(
    *,
    quick: bool,
    json_path: str | None,
    plot_path: str | None,
    strategies: list[str] | None,
    timeline: str | None = None,
    cycles: int | None = None,
    model: str = "auto",
    engine: str = "auto",
    anatomy: bool = False,
    rollout_s: float = 0.0,
    train_s: float = 0.0,
    communicators: int = 0,
) -> int:
    """``hybridmem bench``: run the strategies, print the table and verdicts; exit code.

    Args:
        quick: the small plan (about 2.5 minutes for the four strategies on an H200).
        json_path: write the plan, every figure of every cycle and the verdicts here.
        plot_path: draw the summary figures (needs matplotlib).
        strategies: which of ``STRATEGIES`` to run, in order; None: all of them,
            ``tms`` only where torch_memory_saver is installed.
        timeline: record each strategy's cycles to ``TIMELINE.<strategy>.jsonl``
            (and ``.trace.json``) and its engine's to
            ``TIMELINE.<strategy>.engine.jsonl``, for ``hybridmem plot``.
        cycles: override the plan's number of cycles.
        model: the trainer's model (``MODELS``).
        engine: the rollout engine's memory (``ENGINES``; ``auto``: torch_memory_saver
            where installed).
        anatomy: record what each process's cache is made of at every KV wake.
        rollout_s: seconds each rollout lasts beyond the bench's generation.
        train_s: seconds each cycle's training lasts beyond the bench's own steps.
        communicators: NCCL groups the trainer holds; no ``strategies``: held, suspended.
    """
    setup = prepare(
        json_path=json_path,
        plot_path=plot_path,
        timeline=timeline,
        engine=engine,
        strategies=strategies or (list(COMMUNICATOR_STRATEGIES) if communicators else None),
    )
    if setup is None:
        return 2
    total, engine_kind, strategies = setup.total, setup.engine, setup.strategies
    p = plan(int(total), quick=quick, cycles=cycles, model=model, engine=engine_kind)
    p = dataclasses.replace(p, anatomy=anatomy)
    p = with_phase_lengths(p, rollout_s=rollout_s, train_s=train_s)
    p = with_communicators(p, communicators)
    print(
        f"bench plan: {p.params / 1e6:.0f} M parameters "
        f"({p.state_bytes / GiB:.1f} GiB of trainer state), "
        f"KV cache {p.kv_fraction:.0%} of the device, {p.cycles} cycles x {p.train_steps} steps, "
        f"model {p.model}, engine {engine_kind}" + phase_lengths_said(p)
    )
    if p.anatomy:
        print(ANATOMY_NOTE)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for name in strategies:
        results[name] = child_run(name, p, timeline)
        save_so_far(json_path, {"plan": p.as_dict(), "results": results})
    rows = {name: r["summary"] for name, r in results.items()}
    print("\n" + "\n".join(format_table(rows)))
    judged = verdicts(rows, {name: r.get("raw") for name, r in results.items()})
    print("\n" + "\n".join(judged))
    print(f"\nbench took {time.perf_counter() - started:.0f} s")
    if json_path:
        Path(json_path).write_text(
            json.dumps({"plan": p.as_dict(), "results": results, "verdicts": judged}, indent=2)
        )
    if plot_path:
        plot_results(rows, plot_path)
    return 0


def child_main(argv: list[str]) -> str:
    """The child process :func:`child_run` starts: run one strategy, return its figures.

    Args:
        argv: ``[strategy, plan as JSON, timeline prefix (optional)]``, as
            :func:`child_run` passes them; the strategy is one of ``ALL_STRATEGIES``.

    Returns:
        The figures as one line of JSON (the parent reads the child's last line).

    Raises:
        SystemExit: an unknown strategy (before anything runs).
    """
    name = argv[0]
    if name not in ALL_STRATEGIES:
        raise SystemExit(f"unknown strategy {name!r}; strategies are {', '.join(ALL_STRATEGIES)}")
    fields = {k: v for k, v in json.loads(argv[1]).items() if k not in ("params", "state_bytes")}
    timeline_path = argv[2] if len(argv) > 2 else None
    return json.dumps(run_strategy(name, BenchPlan(**fields), timeline_path), default=str)


if __name__ == "__main__":
    print(child_main(sys.argv[1:]))
