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

A mixin of :class:`~hybridmem.engine.switch.HybridSwitch`: the switch's state is
declared here for the type checker only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from hybridmem._checks import check_bool
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem.engine.reports import SwitchReport
from hybridmem.engine.switch_calls import then_run
from hybridmem.engine.switch_stages import SwitchState
from hybridmem.memory.offload import Offloader, OffloadInFlight, OffloadReport
from hybridmem.observe.memory import MemoryInfo

__all__ = ["KV_MARGIN_BYTES", "WEIGHTS_MARGIN_BYTES", "Offloading", "kv_need", "weights_need"]

#: Room left beyond what the last cycle's weight stages took, for weights under copies.
WEIGHTS_MARGIN_BYTES = 256 << 20
#: Room left beyond what the KV cache's last wake took, for the KV cache under copies.
KV_MARGIN_BYTES = 512 << 20

#: The stages whose memory the weight stages take: their lowest free reading counts.
WEIGHT_STAGES = ("wake_weights", "weight_sync")


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
        offloader: Offloader | None
        reports: list[SwitchReport]
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

    def _init_offloading(self, weights_under_offload: bool, kv_under_offload: bool) -> None:
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
        """Stage ``offload``: queue the copies (weights under them), or offload in full."""
        if self.offloader is None:
            return
        self._state.offloaded = True  # before: a failed offload may have moved some
        if self._room_for_weights():
            self._flight = self.offloader.start_offload()  # offload_land frees
            return
        report = self.offloader.offload()  # released as its copies land
        self.offload_report = report if isinstance(report, OffloadReport) else None

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
