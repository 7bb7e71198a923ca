"""The switch's offload, and the engine's weights (and KV cache) woken under its copies.

Why: at 32 GiB of trainer state the switch to
rollout spent 22-24 ms in its weight stages after an offload of 315 ms, about 7% of
the ceiling. Measured on an H200 with a prototype: once the ``wake_up`` recipe's
release (a device-wide synchronize) was left out, the engine's weights woke in 3 ms
and synced in 21-23 ms (6 ms at 8 GiB) while the offload's copies ran, as fast as
with nothing in flight (``switch-kv-weights-during-offload-no-wake-release-*.log``).
Built, the switch to rollout went from 1.15x to 1.08x the ceiling at 32 GiB and from
1.085x to 1.041x at 64 (``switch-wuo-stages.txt``, main and this one after another).

How: where the device has room for the weight stages beside the trainer state (what
they took in the last cycle, plus :data:`WEIGHTS_MARGIN_BYTES`), the ``offload`` stage
only queues the copies (:meth:`~hybridmem.memory.offload.Offloader.start_offload`), the
``release`` stage after it waits for nothing, ``wake_weights`` enters the ``wake_up``
phase without its release, and ``offload_land``, after the weight sync, frees the
storages as their copies land and releases. Elsewhere (the first cycle, no room, a
GPU another rank's switch works on too, ``weights_under_offload=False``) ``offload``
finishes in its own stage as before and ``offload_land`` does nothing. A failure
while the copies run cancels the offload: nothing was freed, the state stays where
it is (:meth:`Offloading._cancel_offload`, from the recovery).
Where the process runs expandable segments between phases, entering ``wake_up``
changes the allocator mode, and that change releases the cache (a synchronize):
the weights then wait for the copies, correct but no faster.

The KV cache too: where the copies still
run after the weight sync and the device has room for what the KV cache's wake took in
the last cycle whose copies had landed before it (:func:`kv_need`, plus
:data:`KV_MARGIN_BYTES`), ``offload_land`` leaves the copies in flight,
``free_staging`` leaves the ``weight_sync`` phase without its release, the engine's
KV cache wakes, and ``offload_land_late`` frees as the copies land and releases once
for both. Ranks: each rank's room is its own GPU's, measured from its ``barrier_kv``
to after the direction's last exchange, when every rank's KV wake has returned, so a
KV wake that one rank starts for the engine's every GPU is counted on each of them. A
rank without room lands before ``barrier_kv`` as before, so after that barrier every
GPU has either its room or its trainer state gone. Measured on an H200
(``kv_under_probe.py.txt``): to rollout 1.18-1.22x -> 1.09-1.13x the ceiling at 8 GiB,
1.07x -> 1.04-1.05x at 32.

Planned by need (``rollout_need``): the ``plan`` stage releases this process's cache,
reads device free memory and plans only the deficit, ``need + NEED_MARGIN_BYTES - free``,
cheapest first (:mod:`hybridmem.memory.need_plan`); nothing when nothing is short. The
reload then brings back only what moved. A rollout that would still lack memory with
everything offloaded fails the switch before anything moves, naming the shortfall. Each
rank plans for its own GPU (free memory is per GPU); at ``barrier_plan`` the ranks
exchange their deficits and each moves the largest (or all it has), so every rank moves
the same bytes of its state, and one rank's failed plan fails every rank before any
moves anything.

A mixin of :class:`~hybridmem.engine.switch.HybridSwitch`: the switch's state is
declared here for the type checker only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from hybridmem._checks import MAX_DEVICE_BYTES, check_bool, check_number
from hybridmem._errors import HybridSwitchError
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem.engine.ranks import RankStatus
from hybridmem.engine.reports import SwitchReport
from hybridmem.engine.switch_calls import then_run
from hybridmem.engine.switch_stages import SwitchState
from hybridmem.memory.need_plan import NeedPlan, plan_by_need
from hybridmem.memory.offload import Offloader, OffloadInFlight, OffloadReport
from hybridmem.observe import timeline as _timeline
from hybridmem.observe.memory import MemoryInfo
from hybridmem.scopes.engines import EngineAdapter
from hybridmem.scopes.release import release_cache

__all__ = [
    "KV_MARGIN_BYTES",
    "NEED_MARGIN_BYTES",
    "WEIGHTS_MARGIN_BYTES",
    "Offloading",
    "RolloutNeed",
    "check_rollout_need",
    "kv_need",
    "weights_need",
]

#: What a switch can be told the rollout needs: bytes, a callable that says (None: not
#: known this cycle, offload everything), or "engine": what the engine adapter reads
#: from the engine's own memory setting (:meth:`EngineAdapter.awake_bytes`).
RolloutNeed = int | Callable[[], "int | None"] | Literal["engine"] | None

#: Room left beyond what the last cycle's weight stages took, for weights under copies.
WEIGHTS_MARGIN_BYTES = 256 << 20
#: Room left beyond what the KV cache's last wake took, for the KV cache under copies.
KV_MARGIN_BYTES = 512 << 20

#: Room kept free beyond the rollout's need by a planned offload (allocator rounding,
#: the engine's small allocations).
NEED_MARGIN_BYTES = 256 << 20

#: The stages whose memory the weight stages take: their lowest free reading counts.
WEIGHT_STAGES = ("wake_weights", "weight_sync")


def check_rollout_need(need: object) -> RolloutNeed:
    """``need`` if it is what ``HybridSwitch(rollout_need=...)`` takes.

    Raises:
        TypeError: not None, an int, a callable or ``"engine"``.
        ValueError: an int below 0 or above 1 TiB.

    Example:
        >>> check_rollout_need(8 << 30)
        8589934592
    """
    if need is None or callable(need) or need == "engine":
        return need
    if isinstance(need, str):
        raise TypeError(
            f"rollout_need must be bytes (an int), a callable returning them, None or "
            f"'engine' (what the engine's own memory setting says), got {need!r}"
        )
    value = check_number(  # an int at run time (integer=True; bools refused)
        "rollout_need",
        need,
        integer=True,
        minimum=0,
        maximum=MAX_DEVICE_BYTES,
        expected="bytes (an int from 0 to 1 TiB), a callable returning them, or None",
    )
    return int(value)


def weights_need(reports: list[SwitchReport]) -> int | None:
    """Device memory the last switch to rollout's weight stages took (None: not known).

    The drop of device free memory from before ``wake_weights`` to the lowest reading
    after it or ``weight_sync`` (the engine's weights and the sync's staging). None
    before a switch to rollout got that far, or where memory was not measured.

    Example:
        >>> weights_need([]) is None
        True
    """
    for report in reversed(reports):
        if report.direction != "to_rollout":
            continue
        try:
            first = report.stage(WEIGHT_STAGES[0]).free_before
            after = [report.stage(name).free_after for name in WEIGHT_STAGES]
        except KeyError:  # a switch that failed before those stages
            return None
        if first is None or any(a is None for a in after):
            return None
        return max(0, first - min(a for a in after if a is not None))
    return None


def kv_need(report: SwitchReport, free_after: int | None) -> int | None:
    """Device memory a switch to rollout's KV wake took (None: not known).

    The drop of device free memory from the start of ``barrier_kv`` (no rank can
    have woken a KV cache yet) to ``free_after``, read once every rank's KV wake has
    returned. Meaningful only where the offload landed before ``barrier_kv``.

    Example:
        >>> kv_need(SwitchReport("to_rollout", 0), 10) is None
        True
    """
    try:
        before = report.stage("barrier_kv").free_before
    except KeyError:  # a switch that failed before it
        return None
    if before is None or free_after is None:
        return None
    return max(0, before - free_after)


class Offloading:
    """The switch to rollout's ``offload``, ``release`` and landing stages."""

    if TYPE_CHECKING:  # the switch's, used here
        engine: EngineAdapter
        offloader: Offloader | None
        reports: list[SwitchReport]
        device: int | None
        rank: int
        _state: SwitchState
        _shared_device: bool
        _async_mode: bool

        def _memory(self) -> MemoryInfo: ...

        def _exit_phase(
            self, exc: BaseException | None = None, *, releases: bool = True
        ) -> Awaitable[None] | None: ...

        def _enter_phase(
            self, name: str, enough_free: int | None = None, *, enter_releases: bool = True
        ) -> None: ...

        def _wake(self, tag: str) -> Awaitable[Any] | None: ...

        def _release(self, point: str = "release") -> Awaitable[Any] | None: ...

    def _init_offloading(
        self, weights_under_offload: bool, kv_under_offload: bool, rollout_need: object = None
    ) -> None:
        self.rollout_need = check_rollout_need(rollout_need)
        #: the last switch to rollout's plan (None: not planned, everything offloaded)
        self.plan: NeedPlan | None = None
        #: the resident storages that plan was made from (the offload takes their walk)
        self._resident: list[tuple[str, int]] = []
        self.weights_under_offload = check_bool("weights_under_offload", weights_under_offload)
        self.kv_under_offload = check_bool("kv_under_offload", kv_under_offload)
        self._flight: OffloadInFlight | None = None  # an offload whose copies still run
        #: what the KV cache's wake took in the last cycle whose copies landed first
        self._kv_need: int | None = None
        #: the Offloader's report of the last offload: its copies' time and bytes,
        #: whether the weights ran under them or not (the ``offload`` stage then
        #: only queued them)
        self.offload_report: OffloadReport | None = None

    @property
    def _copying(self) -> bool:
        """Whether the offload's copies were queued and its storages not freed yet."""
        return self._flight is not None and self._flight.pending

    def _room_for_weights(self) -> bool:
        """Whether the weight stages fit beside the trainer state now."""
        if not self.weights_under_offload:
            return False
        if self._shared_device:  # another rank's engine here may wake in our memory
            info_once(
                "switch-shared-device-weights",
                "HybridSwitch: another rank's switch works on this GPU; the engine's weights "
                "wake after the offload (weights_under_offload does not apply)",
            )
            return False
        need = weights_need(self.reports)
        return need is not None and self._fits_now(need + WEIGHTS_MARGIN_BYTES, "the weights")

    def _room_for_kv(self) -> bool:
        """Whether the KV cache fits beside the copies still in flight now."""
        if not self.kv_under_offload or self._kv_need is None:
            return False
        return self._fits_now(self._kv_need + KV_MARGIN_BYTES, "the KV cache")

    def _fits_now(self, need: int, what: str) -> bool:
        """Whether device free memory now holds ``need`` bytes (``what`` under the copies)."""
        free = self._memory().free
        fits = free is not None and free >= need
        if not fits:
            logger.debug(
                "HybridSwitch: no room for %s under the offload (free %s, need %s)",
                what,
                fmt_bytes(free or 0),
                fmt_bytes(need),
            )
        return fits

    def _learn_kv_need(self, report: SwitchReport) -> None:
        """After a switch to rollout whose copies landed before its KV wake: what it took."""
        if self.offloader is None or not (self.kv_under_offload and self.weights_under_offload):
            return  # no copies for the KV cache to wake under
        if self._state.kv_under:
            return  # a KV wake under the copies: the landing's frees blur its reading
        need = kv_need(report, self._memory().free)
        if need is not None:
            self._kv_need = need

    def _offload(self) -> None:
        """Stage ``offload``: queue the copies (weights under them), or offload in full.

        With ``rollout_need``: only the deficit, planned first (nothing when none).
        """
        if self.offloader is None:
            return
        plan = self.plan  # set by the plan stage (and agreed by every rank); None: everything
        max_bytes = None if plan is None else plan.deficit
        if max_bytes == 0:
            self.offload_report = None
            return  # nothing is short: nothing moves
        self._state.offloaded = True  # before: a failed offload may have moved some
        if self._room_for_weights():
            self._flight = self.offloader.start_offload(max_bytes=max_bytes)  # landing frees
            return
        report = self.offloader.offload(max_bytes=max_bytes)  # released as its copies land
        self.offload_report = report if isinstance(report, OffloadReport) else None

    def _plan(self) -> None:
        """Stage ``plan`` (planned by need only): what must move, before anything does.

        Raises:
            HybridSwitchError: even offloading everything leaves the rollout short.
        """
        self.plan = self._plan_by_need()

    def _agree_plan(self, statuses: list[RankStatus]) -> None:
        """After ``barrier_plan``: move what the rank with the largest deficit must.

        Every rank then offloads the same bytes of its (like-sized) state and no rank's
        engine wakes into a GPU its trainer left shorter than another's.
        """
        plan = self.plan
        deficits = [s.deficit for s in statuses if s.deficit is not None]
        if plan is None or not deficits or max(deficits) <= plan.deficit:
            return
        agreed = max(deficits)
        self.plan = plan.moving(self._resident, agreed)  # no walk: the offload takes the plan's
        logger.info(
            "HybridSwitch: rank %d moves %s, the largest deficit of the ranks (its own: %s)",
            self.rank,
            fmt_bytes(agreed),
            fmt_bytes(plan.deficit),
        )

    def _need(self) -> int | None:
        """The rollout's need this cycle, in bytes (None: not planned).

        Raises:
            HybridSwitchError: ``"engine"`` where the engine says nothing of its size.
        """
        need = self.rollout_need
        if need == "engine":
            total = self._memory().total
            said = None if total is None else self.engine.awake_bytes(total)
            if said is None:
                raise HybridSwitchError(
                    f"rollout_need='engine': {self.engine!r} says nothing of what it takes "
                    "awake (no gpu_memory_utilization or mem_fraction_static read, or no "
                    "device memory reading); nothing was offloaded. Pass rollout_need=bytes"
                )
            return int(said)
        if callable(need):
            need = check_rollout_need(need())
            if callable(need) or isinstance(need, str):
                raise TypeError("rollout_need() must return bytes (an int) or None")
        return need

    def _plan_by_need(self) -> NeedPlan | None:
        """Release this process's cache, read what is free, plan the deficit (or None).

        Raises:
            HybridSwitchError: even offloading everything leaves less than the need
                free; nothing was moved.
        """
        need = self._need()
        if need is None or self.offloader is None:
            return None
        span = _timeline.begin("switch:plan", "plan", device=self.device, rank=self.rank)
        # What is free once this process's cache is back: a release without a gc pass
        # (the switch's own release after the offload collects, as before).
        release_cache(self.device, collect_garbage=False, ipc_collect=False)
        free = self._memory().free
        if free is None:  # no device to measure: nothing can be planned
            _timeline.end(span, planned=False)
            info_once(
                "switch-plan-no-device",
                "HybridSwitch: no device memory reading; rollout_need ignored, "
                "offloading everything",
            )
            return None
        # The offload stage takes this walk: the targets are walked once per switch.
        self._resident = self.offloader.resident(keep_walk=True)
        plan = plan_by_need(self._resident, need, free, NEED_MARGIN_BYTES)
        _timeline.end(span, **plan.as_dict())
        logger.info("HybridSwitch: offload planned by need: %s", plan)
        if plan.short:
            raise HybridSwitchError(
                f"the rollout needs {fmt_bytes(need)} (+{fmt_bytes(NEED_MARGIN_BYTES)} "
                f"margin) and {fmt_bytes(free)} is free: offloading the whole trainer state "
                f"({fmt_bytes(plan.nbytes)}) still leaves it {fmt_bytes(plan.short)} short. "
                "Nothing was offloaded; lower the rollout's memory (its KV cache size) or "
                "free memory elsewhere"
            )
        return plan

    def _release_offloaded(self) -> Awaitable[Any] | None:
        """Stage ``release``: return what the offload freed (after ``offload_land`` if copying).

        A release synchronizes the device: while the copies run it would wait for them.
        """
        return None if self._copying else self._release()

    def _wake_weights(self) -> Awaitable[Any] | None:
        """Stage ``wake_weights``: enter ``wake_up`` (without its release under the copies)."""
        # Under the offload's copies the recipe's release would wait for them.
        self._enter_phase("wake_up", enter_releases=not self._copying)
        return self._wake("weights")

    def _offload_land(self) -> Awaitable[Any] | None:
        """Stage ``offload_land``: free as the copies land and release; or leave them in flight.

        Left in flight where the KV cache fits beside them (``offload_land_late`` lands them).
        """
        if not self._copying:
            return None
        if self._room_for_kv():
            self._state.kv_under = True
            return None
        return self._land("release")

    def _free_staging(self) -> object:
        """Stage ``free_staging``: leave ``weight_sync``, its recipe collecting and releasing.

        With the copies still in flight, its release (a synchronize) would wait for them:
        ``offload_land_late`` releases instead, once for both.
        """
        if self._copying:
            return self._exit_phase(releases=False)
        return then_run(self._exit_phase(), lambda: self._release("free_staging"))

    def _offload_land_late(self) -> Awaitable[Any] | None:
        """Stage ``offload_land_late``: after the KV cache woke under the copies, land them."""
        # The staging's release point too (its release is this one): a point of its own
        # cost the first cycle under the KV cache a full gc pass in the garbage gate
        # (190-245 ms at 8-64 GiB on the H200, the bench's cycle 2); an engine in this
        # process, its KV cache allocated by now, costs one full pass there instead.
        return self._land("free_staging") if self._copying else None

    def _land(self, point: str) -> Awaitable[Any] | None:
        """Free the storages as their copies land, then release (at ``point``)."""
        flight = self._flight
        if flight is None or not flight.pending:
            return None
        self._flight = None

        def land() -> None:
            report = flight.finish()
            self.offload_report = report if isinstance(report, OffloadReport) else None

        if self._async_mode:  # the copies' wait and the frees: off the event loop

            async def land_async() -> None:
                await asyncio.to_thread(land)
                released = self._release(point)
                if released is not None:
                    await released

            return land_async()
        land()
        return self._release(point)

    def _cancel_offload(self) -> None:
        """Drop an offload whose copies still run: nothing was freed (recovery)."""
        flight, self._flight = self._flight, None
        if flight is None or not flight.pending:
            return
        flight.cancel()
        if self.offloader is not None:
            self._state.offloaded = bool(self.offloader.offloaded_groups)
        logger.info("HybridSwitch: the offload in flight was cancelled; nothing was freed")
