"""HybridSwitch: the staged trainer -> rollout -> trainer switch, checked and reported.

Order (vLLM RFC #15254, verl #302; SGLang's multi-stage wake-up lowered peak memory
192 -> 131.8 GB for Qwen-32B): offload trainer state -> release -> [barrier] -> wake
weights -> weight sync -> free staging -> [barrier] -> wake KV cache -> rollout ->
(reload early, where there is room) -> sleep -> confirm the memory came back ->
release -> [barrier] -> reload. Never old weights + new weights + KV cache at once;
with many ranks no rank wakes its KV cache until every GPU has room for it (its
offload landed, or room beside the copies still running: ``switch_offload``).

Why this module is long: one class holds one state machine (what is offloaded, what
is awake, which phases are entered); its parts live in modules of their own: the
stages as data and the state (``switch_stages``), the calls its drivers run
(``switch_calls``), how it runs a phase (``switch_phase``), the rank protocol
(``switch_ranks``), the recovery (``switch_recovery``), the offload under the
engine's wake (``switch_offload``) and the reload (``switch_reload``), mixed into
:class:`HybridSwitch`. Here: the stage operations, the
sans-IO direction (:meth:`HybridSwitch._direction`, a generator of calls) and the two
thin drivers that run it (sync, and async with blocking calls in worker threads).

Three operations still ask which driver runs them (``_exit_phase``, ``_release``,
``_confirm``): a phase is entered and left on the event loop's thread, because
scopes pair each entry with its exit per thread and task, so under the async driver
a phase's waits (SGLang's ``await_free``) are awaited on the loop instead of being
moved to a worker thread as the offload and reload are.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from functools import partial
from typing import Any, Literal, cast

from hybridmem import _torch
from hybridmem._checks import check_seconds
from hybridmem._devices import DeviceArg, device_index
from hybridmem._log import logger
from hybridmem._names import suggests_keywords
from hybridmem.engine.ranks import (
    Barrier,
    DistRanks,
    PlainBarrier,
    RankStatus,
    RankSync,
)
from hybridmem.engine.reports import StageReport, SwitchReport
from hybridmem.engine.switch_calls import BLOCKING, Call, in_thread, then_run
from hybridmem.engine.switch_offload import Offloading, RolloutNeed
from hybridmem.engine.switch_phase import SwitchPhase
from hybridmem.engine.switch_ranks import RankProtocol
from hybridmem.engine.switch_recovery import Recovery
from hybridmem.engine.switch_reload import Reloading
from hybridmem.engine.switch_settle import EngineReturn
from hybridmem.engine.switch_stages import (
    PLAN_STAGES,
    STAGE_PHASES,
    STAGES,
    Failure,
    Stage,
    SwitchState,
)
from hybridmem.memory.offload import Offloader
from hybridmem.observe import timeline as _timeline
from hybridmem.observe.memory import MemoryInfo, memory_info
from hybridmem.scopes import phases
from hybridmem.scopes.engines import EngineAdapter, call_sync
from hybridmem.scopes.garbage import GarbageMode, GarbagePolicy
from hybridmem.scopes.phases import Phase
from hybridmem.scopes.profiles import BackendProfile
from hybridmem.scopes.registry import get_backend

__all__ = ["HybridSwitch"]


@suggests_keywords
class HybridSwitch(RankProtocol, Recovery, Reloading, Offloading):
    """Run the staged trainer -> rollout -> trainer switch around generation.

    Args:
        engine: the rollout engine: an :class:`EngineAdapter`, or a raw vLLM ``LLM`` /
            SGLang ``Engine`` when ``backend`` is ``"vllm"`` / ``"sglang"``.
        backend: backend name or profile (None: ``HYBRIDMEM_BACKEND`` / ``"default"``);
            its recipes run in the ``wake_up``, ``weight_sync``, ``rollout`` and
            ``sleep`` phases.
        offloader: an :class:`Offloader` for the trainer state (None: nothing moves).
        sync_weights: called with the adapter inside the ``weight_sync`` phase, after
            the engine's weights woke (sync or ``async def``).
        barrier: how ranks meet before the engine wakes, before the KV cache wakes
            and before the trainer reloads, so that no rank takes memory back while
            another on the node still holds it. ``"auto"`` (default): through
            ``torch.distributed`` when a default group exists (else no ranks),
            carrying each rank's status, so that when one rank fails every rank's
            switch for that cycle fails at the next point and recovers with it (the
            error names the rank and stage). An :class:`RankSync` does the same its
            own way. A plain callable only makes ranks wait (it cannot tell them of a
            failure). None: a single rank.
        confirm_timeout_s: how long to wait after the engine sleeps for device free
            memory to settle (SGLang can return before its memory is free) and to
            have room for the trainer state; past it the switch fails at
            ``confirm`` saying how much is free and needed, and the trainer state
            stays offloaded (intact, retrievable) rather than reloading into memory
            that cannot hold it. Where the backend's ``sleep`` recipe waits for free
            memory to settle itself (``sglang``: an ``await_free`` step, bounded by
            its own ``timeout_s``), that wait is the settling, and this bounds the
            wait for room only. After a first cycle, free memory as high as the last
            sleep took it ends either wait.
        collect_garbage: when releases run a ``gc.collect()`` pass:
            ``"adaptive"`` (default): the switch's own release of each direction
            (after the offload; after the engine sleeps) collects the young
            generations, and a full pass only when more device memory stayed
            allocated than after the last release at that point
            (:class:`~hybridmem.scopes.garbage.GarbageGate`): a planted reference
            cycle holding device memory is still freed, an idle release costs
            milliseconds; ``"once"``: a full pass in the first release of each
            direction; ``True`` in every release (five per cycle, the switch's own
            and its recipes'); ``False`` never. A full pass costs tens to hundreds
            of milliseconds in a trainer process; a release without one, well
            under a millisecond plus the driver's frees.
        device: the device to measure and release (None: the current device at each
            stage); an index, ``"cuda:N"`` or a ``torch.device``.
        reload_early, reload_by: when and how the trainer state comes back
            (:mod:`~hybridmem.engine.switch_reload`): before the engine sleeps
            where the device has room already, most of it by copy engine while the
            engine still holds its memory, the rest during the sleep (False: after
            the sleep, always); a reload after the sleep copied by ``"kernel"`` or
            ``"copy_engine"`` (``Offloader.reload``).
        weights_under_offload: wake and sync the engine's weights while the
            offload's copies run, where the device has room for them beside the
            trainer state (what they took in the last cycle, plus 256 MiB;
            :mod:`~hybridmem.engine.switch_offload`). False: after the
            offload, always.
        kv_under_offload: wake the KV cache under those copies too, where the device
            has room for what its last wake took (after landed copies) plus 512 MiB.
            False: after the copies land, always.
        rollout_need: what the rollout needs on the device, in bytes (its weights,
            KV cache and activations), a callable that returns it each cycle (None
            from it: offload everything this cycle), or ``"engine"``: what the engine's
            own memory setting says it takes awake (vLLM's ``gpu_memory_utilization``,
            SGLang's ``mem_fraction_static``, times the device's memory;
            :meth:`EngineAdapter.awake_bytes`). The switch then offloads only the
            deficit against device free memory once its cache is released, optimizer
            state first and parameters last, and nothing when nothing is short
            (``switch.plan``, the report's ``plan``, a ``switch:plan`` timeline span;
            :mod:`~hybridmem.engine.switch_offload`). None (default): everything.

    Scope: one switch at a time per instance. Reports name their rank
    (``torch.distributed`` rank, else ``RANK``, else 0).

    Example:
        >>> engine = hm.VLLMEngine(llm)                                        # doctest: +SKIP
        >>> switch = hm.HybridSwitch(engine, "vllm", offloader, sync_weights=push)  # doctest: +SKIP
        >>> with switch.rollout():                   # doctest: +SKIP
        ...     outputs = llm.generate(prompts)
    """

    def __init__(
        self,
        engine: object,
        backend: str | BackendProfile | None = None,
        offloader: Offloader | None = None,
        *,
        sync_weights: Callable[[EngineAdapter], object] | None = None,
        barrier: Barrier | RankSync | Literal["auto"] | None = "auto",
        confirm_timeout_s: float = 5.0,
        device: DeviceArg = None,
        collect_garbage: GarbageMode = "adaptive",
        reload_early: bool = True,
        reload_by: Literal["kernel", "copy_engine"] = "kernel",
        weights_under_offload: bool = True,
        kv_under_offload: bool = True,
        rollout_need: RolloutNeed = None,
    ) -> None:
        self.profile = backend if isinstance(backend, BackendProfile) else get_backend(backend)
        # Built once, entered every cycle (a phase re-enters; the garbage policy of a
        # stage is passed when it is entered): nothing is re-checked per stage.
        self._phases = {name: Phase(name, self.profile, {}) for name in STAGE_PHASES}
        # Whether leaving ``sleep`` waits for free memory to settle (the recipe's
        # ``await_free``, SGLang's): then ``confirm`` only waits for room.
        self._settles_on_sleep = any(
            s.action == "await_free" and s.when == "exit" for s in self._phases["sleep"].steps
        )
        self.engine = self.profile.adapt(engine)
        if offloader is not None and not isinstance(offloader, Offloader):
            raise TypeError(f"offloader must be an hm.Offloader or None, got {offloader!r}")
        if sync_weights is not None and not callable(sync_weights):
            raise TypeError(f"sync_weights must be callable or None, got {sync_weights!r}")
        # barrier: what meets the ranks (given, or torch.distributed's); _ranks: how.
        self.barrier: Barrier | RankSync | None
        self._ranks: RankSync | None
        if barrier == "auto":
            self._ranks = DistRanks() if _torch.dist_initialized() else None
            self.barrier = self._ranks
        elif barrier is None:
            self.barrier, self._ranks = None, None
        elif isinstance(barrier, RankSync):
            self.barrier, self._ranks = barrier, barrier
        elif callable(barrier):
            self.barrier, self._ranks = barrier, PlainBarrier(barrier)
        else:
            raise TypeError(
                "barrier must be 'auto', None, a callable or a RankSync "
                f"(hybridmem.engine.ranks), got {barrier!r}"
            )
        check_seconds("confirm_timeout_s", confirm_timeout_s, zero=True)
        self._init_reload(reload_early, reload_by)
        self._init_offloading(weights_under_offload, kv_under_offload, rollout_need)
        self.offloader = offloader
        self.sync_weights = sync_weights
        self.confirm_timeout_s = float(confirm_timeout_s)
        self.garbage = GarbagePolicy(collect_garbage)  # when each release collects
        self.device = None if device is None else device_index(device)
        self.rank = _torch.process_rank()
        self.reports: list[SwitchReport] = []
        self._state = SwitchState()
        self._active = False
        self._async_mode = False
        self._cycle = 0
        self._out_of_step = False
        self._returns = EngineReturn()  # what the engine's sleeps gave back (confirm)
        self._enough: int | None = None  # free bytes that end this cycle's confirm wait

    def __repr__(self) -> str:
        return f"HybridSwitch({self.engine!r}, backend={self.profile.name!r}, rank={self.rank})"

    def _memory(self) -> MemoryInfo:
        """One reading for a stage boundary: the report and the timeline share it."""
        return memory_info(self.device)

    # ------------------------------------------------------------------ #
    # The stages, as (name, operation) pairs; an operation may return an awaitable
    # ------------------------------------------------------------------ #
    def _enter_phase(
        self, name: str, enough_free: int | None = None, *, enter_releases: bool = True
    ) -> None:
        phase = self._phases[name]
        steps = [s for s in phase.steps if enter_releases or s.when != "enter"]
        # The recipes' releases collect as the garbage policy says, and nothing while
        # the offload's copies run ("once" goes to the release after they land).
        releases = any(s.action == "release_cache" for s in steps)
        collect = None if not releases else False if self._copying else self.garbage.for_recipe()
        entered = SwitchPhase(phase, collect, enough_free, enter_releases=enter_releases)
        entered.__enter__()
        self._state.phases.append(entered)

    def _exit_phase(
        self, exc: BaseException | None = None, *, releases: bool = True
    ) -> Awaitable[None] | None:
        """Leave the innermost phase (``releases`` False: without its recipe's releases)."""
        entered = self._state.phases.pop()
        if not releases:
            entered.exit_releases = False
        info = (type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        if self._async_mode:
            return entered.__aexit__(*info)
        entered.__exit__(*info)
        return None

    def _wake(self, tag: str) -> Awaitable[Any] | None:
        # Counted as awake before the call: a failed wake may have taken memory.
        if tag == "weights":
            self._state.weights = True
        else:
            self._state.kv = True
        result = self.engine.wake_up([tag])
        # vLLM answers whether it is fully awake: the stages know that already.
        return result if inspect.isawaitable(result) else None

    def _sleep(self) -> Awaitable[Any] | None:
        result = self.engine.sleep()
        if not inspect.isawaitable(result):
            self._state.weights = self._state.kv = False
            return None

        async def asleep() -> None:
            await result
            self._state.weights = self._state.kv = False

        return asleep()

    def _release(self, point: str = "release") -> Awaitable[Any] | None:
        if self._async_mode:  # a gc pass takes tens of milliseconds: off the loop
            return asyncio.to_thread(self.garbage.release, self.device, point)
        self.garbage.release(self.device, point)
        return None

    def _sync(self) -> object:
        self._enter_phase("weight_sync")
        return None if self.sync_weights is None else self.sync_weights(self.engine)

    def _start_rollout(self) -> object:
        return then_run(self._exit_phase(), lambda: self._enter_phase("rollout"))  # wake_up

    def _put_to_sleep(self) -> Awaitable[Any] | None:
        # ``_enough`` was read at this stage's start; ``reload_early`` left rollout
        self._enter_phase("sleep", self._enough)
        return self._sleep()

    def _confirm(self) -> object:
        # The sleep recipe's own wait (SGLang's) has just watched free memory settle; a
        # second found it settled, 20 ms for nothing. The room check stays.
        settled, enough = self._settles_on_sleep, self._enough

        def settle() -> object:
            if self._async_mode:

                async def settle_async() -> None:
                    if not settled:
                        await phases.await_free_async(self.device, self.confirm_timeout_s, enough)
                    await self._await_room_async()

                return settle_async()
            if not settled:
                phases.await_free(self.device, timeout_s=self.confirm_timeout_s, enough=enough)
            self._await_room()
            return None

        return then_run(self._exit_phase(), settle)  # sleep: releases (SGLang: waits)

    def _wake_kv(self) -> Awaitable[Any] | None:
        return self._wake("kv_cache")

    # ------------------------------------------------------------------ #
    # One direction, as calls for a sync or an async driver to run
    # ------------------------------------------------------------------ #
    def _direction(
        self,
        direction: Literal["to_rollout", "to_trainer"],
        failure: Failure | None = None,
    ) -> Generator[Call, object, SwitchReport]:
        """The stages of one direction; after a failure, only the sync points.

        Yields each operation as a :class:`Call`; the driver sends back its result
        or throws its exception in. Ends with an ``end`` point where every rank
        learns whether any rank failed; then every rank recovers together.
        """
        report = SwitchReport(direction, self.rank)
        last: MemoryInfo | None = None  # the stage just closed: its reading opens the next
        for name, operation in self._stages(direction):
            if failure is not None and operation is not None:
                continue  # a failed rank does no more work, but still meets every point
            stage = self._start_stage(name, last)
            last = None
            try:
                if operation is None:  # a sync point
                    statuses = yield Call(partial(self._exchange, name, failure), True, name)
                    failure = failure or self._remote(cast("list[RankStatus]", statuses))
                    if name == "barrier_plan" and failure is None:
                        self._agree_plan(cast("list[RankStatus]", statuses))
                else:
                    yield Call(operation, name in BLOCKING, name)
            except BaseException as exc:
                _timeline.end(stage.span, error=repr(exc))
                failure = failure or Failure(name, exc)
                continue
            last = self._finish_stage(report, stage)
        try:
            statuses = yield Call(partial(self._exchange, f"{direction}:end", failure), True, "end")
            failure = failure or self._remote(cast("list[RankStatus]", statuses))
        except BaseException as exc:
            failure = failure or Failure("end", exc)
        if failure is None:
            return self._finish(report)
        yield from self._recover(failure)
        raise AssertionError("unreachable: recovery raises")  # pragma: no cover

    # ------------------------------------------------------------------ #
    # Drivers
    # ------------------------------------------------------------------ #
    def _stages(
        self, direction: Literal["to_rollout", "to_trainer"]
    ) -> list[tuple[str, Callable[[], object] | None]]:
        self.garbage.begin(direction)  # "once": a pass per direction; "adaptive": like with like
        planned = self.rollout_need is not None and self.offloader is not None
        if direction == "to_rollout":
            self.plan = None  # the plan stage makes this cycle's (planned by need only)
        return [
            (name, None if op is None else getattr(self, op))
            for name, op in STAGES[direction]
            if planned or name not in PLAN_STAGES
        ]

    def _start_stage(self, name: str, before: MemoryInfo | None = None) -> Stage:
        # The last stage's closing reading, taken just now: nothing ran since.
        info = self._memory() if before is None else before
        if name == "sleep":  # free memory as high as the last sleep took it ends its wait
            self._enough = self._returns.mark(info, shared=self._shared_device)
        span = _timeline.begin(
            f"stage:{name}",
            "stage",
            backend=self.profile.name,
            device=self.device,
            memory=info,
            rank=self.rank,
        )
        return Stage(name, info, time.perf_counter(), time.time(), span)

    def _finish_stage(self, report: SwitchReport, stage: Stage) -> MemoryInfo:
        """Close ``stage`` into ``report``; return its closing reading (the next one's opening)."""
        info = self._memory()
        if stage.name == "confirm":  # what this sleep gave back, for the next
            self._returns.learn(info)
        _timeline.end(stage.span, memory=info)
        seconds = time.perf_counter() - stage.clock
        report.stages.append(StageReport(stage.name, seconds, stage.before, info, stage.wall))
        return info

    def _finish(self, report: SwitchReport) -> SwitchReport:
        if report.direction == "to_rollout":  # every rank's KV wake has returned
            self._learn_kv_need(report)
            report.plan = self.plan
        self.reports.append(report)
        logger.info("%s", report)
        return report

    def _drive(self, steps: Generator[Call, object, SwitchReport]) -> SwitchReport:
        """Run a direction's calls in this thread."""
        self._async_mode = False
        try:
            call = next(steps)
            while True:
                try:
                    result = call.fn()
                    call_sync(result, f"stage {call.name!r}")
                except BaseException as exc:
                    call = steps.throw(exc)
                else:
                    call = steps.send(result)
        except StopIteration as stop:
            return cast(SwitchReport, stop.value)

    async def _adrive(self, steps: Generator[Call, object, SwitchReport]) -> SwitchReport:
        """Run a direction's calls on the event loop; blocking ones in a worker thread.

        A cancelled task still waits for a worker thread to finish (an offload
        cannot be stopped midway) before recovery touches the same state; the
        cancellation is raised once every rank has recovered.
        """
        self._async_mode = True
        try:
            call = next(steps)
            while True:
                try:
                    if call.blocking:
                        result = await in_thread(call.fn)
                    else:
                        result = call.fn()
                    if inspect.isawaitable(result):
                        result = await result
                except BaseException as exc:
                    call = steps.throw(exc)
                else:
                    call = steps.send(result)
        except StopIteration as stop:
            return cast(SwitchReport, stop.value)
        finally:
            self._async_mode = False

    def _begin(self) -> None:
        if self._active:
            raise RuntimeError(f"{self!r} is already in a rollout; switches do not nest")
        self._active = True
        self._cycle += 1
        self._state = SwitchState()

    def to_rollout(self) -> SwitchReport:
        """Trainer -> rollout: offload, release, wake weights, sync, wake KV cache.

        Raises:
            HybridSwitchError: another rank failed this cycle (every rank recovered),
                or recovery could not restore everything (the message says what).
            Exception: this rank's own failure, after recovery put it back in the
                trainer phase.
        """
        if self.engine.is_async:
            raise TypeError(
                f"{self.engine!r} is async: use the async API (`async with switch.rollout():`)"
            )
        self._begin()
        return self._drive(self._direction("to_rollout"))

    def to_trainer(self) -> SwitchReport:
        """Rollout -> trainer: reload early (room permitting), sleep, confirm, release, reload."""
        try:
            return self._drive(self._direction("to_trainer"))
        finally:
            self._active = False

    @contextlib.contextmanager
    def _sync_rollout(self) -> Iterator[HybridSwitch]:
        self.to_rollout()
        try:
            yield self
        except BaseException as exc:
            # Back to the trainer with every rank: the other ranks meet this one at
            # the points of their way back, where they learn of the failure.
            try:
                self._drive(self._direction("to_trainer", Failure("rollout", exc)))
            finally:
                self._active = False
            raise  # pragma: no cover - recovery raises
        self.to_trainer()

    @contextlib.asynccontextmanager
    async def _async_rollout(self) -> AsyncIterator[HybridSwitch]:
        self._begin()
        await self._adrive(self._direction("to_rollout"))
        try:
            yield self
        except BaseException as exc:
            try:
                await self._adrive(self._direction("to_trainer", Failure("rollout", exc)))
            finally:
                self._active = False
            raise  # pragma: no cover - recovery raises
        try:
            await self._adrive(self._direction("to_trainer"))
        finally:
            self._active = False

    def rollout(self) -> _RolloutScope:
        """``with switch.rollout():`` (or ``async with``): generate between the two switches.

        On an error in the block the engine is put to sleep and the trainer state
        reloaded before the error propagates; other ranks learn of it at their next
        sync point and recover too.
        """
        return _RolloutScope(self)


class _RolloutScope:
    """Both ``with`` and ``async with`` for :meth:`HybridSwitch.rollout`."""

    def __init__(self, switch: HybridSwitch) -> None:
        self._switch = switch
        self._sync: contextlib.AbstractContextManager[HybridSwitch] | None = None
        self._async: contextlib.AbstractAsyncContextManager[HybridSwitch] | None = None

    def __enter__(self) -> HybridSwitch:
        self._sync = self._switch._sync_rollout()
        return self._sync.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        if self._sync is None:
            raise RuntimeError("rollout scope exited without being entered")
        return self._sync.__exit__(*exc)

    async def __aenter__(self) -> HybridSwitch:
        self._async = self._switch._async_rollout()
        return await self._async.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        if self._async is None:
            raise RuntimeError("rollout scope exited without being entered")
        return await self._async.__aexit__(*exc)
