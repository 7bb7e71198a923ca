"""The switch's offload, and the engine's weights woken and synced under its copies.

Why (issue #25, item 3; decisions 85 and 86): at 32 GiB of trainer state the switch to
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
from hybridmem.engine.switch_parts import SwitchState
from hybridmem.memory.offload import Offloader, OffloadInFlight, OffloadReport
from hybridmem.observe.memory import MemoryInfo

__all__ = ["WEIGHTS_MARGIN_BYTES", "Offloading", "weights_need"]

#: Room left beyond what the last cycle's weight stages took, for weights under copies.
WEIGHTS_MARGIN_BYTES = 256 << 20

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


class Offloading:
    """The ``offload``, ``release`` and ``offload_land`` stages of the switch to rollout."""

    if TYPE_CHECKING:  # the switch's, used here
        offloader: Offloader | None
        reports: list[SwitchReport]
        _state: SwitchState
        _shared_device: bool
        _async_mode: bool

        def _memory(self) -> MemoryInfo: ...

        def _release(self, point: str = "release") -> Awaitable[Any] | None: ...

    def _init_offloading(self, weights_under_offload: bool) -> None:
        self.weights_under_offload = check_bool("weights_under_offload", weights_under_offload)
        self._flight: OffloadInFlight | None = None  # an offload whose copies still run
        #: the Offloader's report of the last offload: its copies' time and bytes,
        #: whether the weights ran under them or not (the ``offload`` stage then
        #: only queued them)
        self.offload_report: OffloadReport | None = None

    @property
    def _copying(self) -> bool:
        """Whether the offload's copies were queued and its storages not freed yet."""
        return self._flight is not None and self._flight.pending

    def _room_for_weights(self) -> bool:
        """Whether the weight stages fit beside the trainer state now (decision 86)."""
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
        if need is None:
            return False
        free = self._memory().free
        fits = free is not None and free >= need + WEIGHTS_MARGIN_BYTES
        if not fits:
            logger.debug(
                "HybridSwitch: no room for the weights under the offload (free %s, need %s)",
                fmt_bytes(free or 0),
                fmt_bytes(need + WEIGHTS_MARGIN_BYTES),
            )
        return fits

    def _offload(self) -> None:
        """Stage ``offload``: queue the copies (weights under them), or offload in full."""
        if self.offloader is None:
            return
        self._state.offloaded = True  # before: a failed offload may have moved some
        if self._room_for_weights():
            self._flight = self.offloader.start_offload()  # offload_land frees
            return
        report = self.offloader.offload()  # released as its copies land (decisions 83, 85)
        self.offload_report = report if isinstance(report, OffloadReport) else None

    def _release_offloaded(self) -> Awaitable[Any] | None:
        """Stage ``release``: return what the offload freed (after ``offload_land`` if copying).

        A release synchronizes the device: while the copies run it would wait for them.
        """
        return None if self._copying else self._release()

    def _offload_land(self) -> Awaitable[Any] | None:
        """Stage ``offload_land``: free the storages as their copies land, then release."""
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
                released = self._release()
                if released is not None:
                    await released

            return land_async()
        land()
        return self._release()

    def _cancel_offload(self) -> None:
        """Drop an offload whose copies still run: nothing was freed (recovery)."""
        flight, self._flight = self._flight, None
        if flight is None or not flight.pending:
            return
        flight.cancel()
        if self.offloader is not None:
            self._state.offloaded = bool(self.offloader.offloaded_groups)
        logger.info("HybridSwitch: the offload in flight was cancelled; nothing was freed")
