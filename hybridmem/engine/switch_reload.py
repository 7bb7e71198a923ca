"""The switch's reload: queued before the engine sleeps when the device has room, else after.

Why: a host-to-device copy right after another process freed
a lot of device memory runs at about half its rate, for half a second and more
(measured on an H200, ``benchmarks/reload_rate.py``: 0.46-0.50 of the pinned rate
against 0.90-1.00 otherwise, whatever memory the copy lands in). The reload after
the engine's sleep paid that every cycle, and waited for the sleep besides. When the
device already has room for the trainer state while the engine still holds its
memory (an engine whose KV cache does not fill the device), the copies are queued
just before the engine is put to sleep: they run while it sleeps, and the
``reload`` stage only waits for them. Without that room, the reload runs after the
engine's sleep and the room check, as before.

On by default since the GPU switch tests ran fifty cycles with it (their
``handed_back`` now counts the trainer's own reserved change over the sleep out);
``HybridSwitch(reload_early=False)`` always reloads after the sleep.

How: the reload after the sleep is done by kernels reading the
pinned pool's device mapping (``reload_by="kernel"``, :mod:`hybridmem._torch.mapped`):
the copy engines slow down as the engine frees, during the sleep as after it (0.46 of
the pinned rate after a 60 GiB free and 0.53-0.64 during it; kernels 0.80-0.82,
``benchmarks/reload_by_kernel.py``). The early reload is by copy engine, in two parts,
in its own stage ``reload_early`` before the sleep: a **head** the host waits for, at
the full rate while the engine still holds its memory, then a **tail** fed to the
copy engines a chunk at a time through the sleep and the wait for free memory
(:func:`tail_bytes`, :meth:`~hybridmem.memory.offload.Offloader.start_reload`), so
that those stages overlap the copy. The ``reload`` stage stops the feed and copies
what is left by ``reload_by`` (sleeps vary, and a tail queued in full
could neither stop when a short sleep ended nor go on through a long one). Not by
kernel: kernels top out at 0.82 of the pinned rate even with nothing freed, both ways
at once ran slower than kernels alone (0.62-0.71), and a tail by kernel held the
engine's sleep up (84-110 ms against 22-64 ms with the copy engines, in the bench at 8
and 32 GiB).

Where: every reload allocates the trainer state in the allocator mode
the backend's ``train`` recipe trains in (expandable segments, for the built-in
backends; :func:`trainer_allocation`), whatever mode the process runs in between
phases. Reloaded in classic segments, the state's next offload freed classic
segments, whose ``cudaFree`` waits for the whole device: the offload's release as its
copies land then waited for all of them (31-34 ms after the copies at
32 GiB in the bench; 1-2 ms as they land). A profile whose ``train`` recipe has no
``expandable_segments`` step reloads in the process's own mode.

A mixin of :class:`~hybridmem.engine.switch.HybridSwitch`: the switch's state is
declared here for the type checker only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Literal

from hybridmem._checks import check_bool
from hybridmem._errors import OffloadError
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem.engine.reports import SwitchReport
from hybridmem.engine.switch_calls import in_thread, then_run
from hybridmem.engine.switch_stages import SwitchState
from hybridmem.memory.offload import RELOAD_WAYS, Offloader, OffloadReport
from hybridmem.memory.reload_feed import ReloadFeed
from hybridmem.scopes.allocator import expandable_segments
from hybridmem.scopes.profiles import BackendProfile

__all__ = [
    "TAIL_CYCLES",
    "TAIL_SHARE",
    "TAIL_STAGES",
    "TAIL_STRETCH",
    "Reloading",
    "early_margin",
    "tail_bytes",
    "trainer_allocation",
]

#: The least room, beyond the trainer state, that an early reload leaves the device.
EARLY_MARGIN_BYTES = 256 << 20


def early_margin(need: int) -> int:
    """Room an early reload leaves beyond ``need`` bytes: 256 MiB or 1/32 of it.

    The allocator rounds and the engine may still touch memory until it sleeps: a
    reload that only just fits is left for after the sleep.

    Example:
        >>> early_margin(1 << 30) >> 20, early_margin(64 << 30) >> 20
        (256, 2048)
    """
    return max(EARLY_MARGIN_BYTES, need // 32)


def _seconds(reports: list[SwitchReport], direction: str, stage: str) -> float | None:
    """The last ``stage``'s seconds among the ``direction`` reports, or None."""
    for report in reversed(reports):
        if report.direction == direction:
            try:
                return report.stage(stage).seconds
            except KeyError:  # a switch that failed before that stage
                return None
    return None


#: The share of the offload's rate an early reload's tail (by copy engine) is sized at
#: while the engine sleeps: the copy engines ran at 0.53-0.64 of the pinned rate
#: during a peer's free (``benchmarks/reload_by_kernel.py``). Below that on purpose:
#: a tail still in flight when the ``confirm`` stage releases the cache is waited for
#: there, which lengthens ``confirm`` and so the next tail; at 0.75 and 1.0 that grew
#: cycle after cycle in the bench (confirm 232 -> 357 ms at 32 GiB), at 0.5 it settled
#: after one cycle.
TAIL_SHARE = 0.5

#: The stages an early reload's tail runs through: the engine's sleep and the wait for
#: its memory (not the release after them, whose first full garbage collection took
#: 166-243 ms in the bench and would size the next tail by it).
TAIL_STAGES = ("sleep", "confirm")

#: The cycles whose longest sleep sizes the tail, and the margin on it.
#: Fed a chunk at a time (:meth:`~hybridmem.memory.offload.Offloader.start_reload`), a
#: tail that outlasts the sleep is stopped by the ``reload`` stage, which copies the
#: rest by kernel at 1/0.8 of its head time: a quarter more for each byte too many.
#: (Where the sleep phase's release synchronizes the device first, that wait lets the
#: feed finish on the copy engines instead, at half rate: in the bench it mostly did.)
#: One that ends early leaves the copy engines idle for the rest of the sleep, which
#: costs each byte too few in full. Sleeps vary (38, 61, 54 ms in one run at 32 GiB),
#: so the tail is sized for the longest of the last three, and a quarter more.
TAIL_CYCLES = 3
TAIL_STRETCH = 1.25


def _window(reports: list[SwitchReport]) -> float:
    """The longest :data:`TAIL_STAGES` time of the last :data:`TAIL_CYCLES` to-trainer switches."""
    windows: list[float] = []
    for report in reversed(reports):
        if report.direction == "to_trainer":  # one that failed before a stage: 0 for it
            names = {stage.name for stage in report.stages}
            windows.append(sum(report.stage(s).seconds for s in TAIL_STAGES if s in names))
            if len(windows) == TAIL_CYCLES:
                break
    return max(windows, default=0.0)


def tail_bytes(reports: list[SwitchReport], host_bytes: int, offload_s: float | None = None) -> int:
    """Bytes of an early reload to feed through the engine's sleep (the tail).

    What the copy engines move in the longest :data:`TAIL_STAGES` (the engine's sleep
    and the wait for its memory) of the last :data:`TAIL_CYCLES` cycles, a
    :data:`TAIL_STRETCH` more, at :data:`TAIL_SHARE` of the last offload's rate (the
    same pool and bus, the other way): ``host_bytes`` over ``offload_s`` (the
    Offloader's report: its copies' own time), else over the last
    ``offload`` stage. The rest (the head) goes first, and the host waits for it:
    those copies run at the full rate while the engine still holds its memory. 0
    before any full cycle: all of it first, then the sleep.

    Example:
        >>> tail_bytes([], 1 << 30)
        0
    """
    window = _window(reports)
    # The offload's own seconds where known: with the weights under its copies
    # the ``offload`` stage only queues them.
    offload = offload_s or _seconds(reports, "to_rollout", "offload")
    if not window or not offload or host_bytes <= 0:
        return 0
    return min(host_bytes, int(host_bytes / offload * TAIL_SHARE * window * TAIL_STRETCH))


def trainer_allocation(profile: BackendProfile) -> contextlib.AbstractContextManager[Any]:
    """The allocator mode of ``profile``'s ``train`` recipe, for allocating trainer state.

    Args:
        profile: the switch's backend profile.

    Returns:
        ``hm.expandable_segments(enabled)`` as the recipe's ``expandable_segments``
        step says (without releasing the cache: the switch has just released it), or
        a scope that changes nothing where the recipe has no such step.

    Scope: process-global while entered (as every allocator scope); enter and leave
    it in one thread.

    Example:
        >>> from hybridmem.scopes.registry import get_backend
        >>> with trainer_allocation(get_backend("sglang")):   # doctest: +SKIP
        ...     offloader.reload()
    """
    for step in profile.recipes.get("train", ()):
        if step.action == "expandable_segments" and step.when == "scope":
            enabled = bool(step.args.get("enabled", True))
            force = bool(step.args.get("force", False))
            return expandable_segments(enabled, release_cache=False, force=force)
    return contextlib.nullcontext()


class Reloading:
    """Reload the trainer state early (room permitting) or after the engine's sleep."""

    if TYPE_CHECKING:  # the switch's, used here
        offload_report: OffloadReport | None
        profile: BackendProfile
        offloader: Offloader | None
        reports: list[SwitchReport]
        _state: SwitchState

        _async_mode: bool

        def _room(self) -> tuple[bool, int | None, int]: ...

        def _exit_phase(self, exc: BaseException | None = None) -> Awaitable[None] | None: ...

    def _init_reload(self, reload_early: bool, reload_by: Literal["kernel", "copy_engine"]) -> None:
        """Check and keep the switch's ``reload_early`` and ``reload_by``."""
        self.reload_early = check_bool("reload_early", reload_early)
        if reload_by not in RELOAD_WAYS:
            raise ValueError(
                f"reload_by must be 'kernel' or 'copy_engine', got {reload_by!r}: 'kernel' "
                "reloads at about 1.7x the copy engines' rate right after the engine's sleep"
            )
        self.reload_by: Literal["kernel", "copy_engine"] = reload_by
        self._feed: ReloadFeed | None = None  # fed through the sleep, not yet finished
        self._shared_device = False  # another rank's switch works on this GPU too

    def _reload_early(self) -> object:
        """Stage ``reload_early``: leave the rollout phase; reload now where there is room.

        After the phase: the trainer state's memory is allocated in the train recipe's
        allocator mode (:func:`trainer_allocation`). The head's wait
        runs in a worker thread under the async driver (the event loop keeps running).
        """

        def reload() -> object:
            if self._async_mode:
                return in_thread(self._reload_before_sleep)
            self._reload_before_sleep()
            return None

        return then_run(self._exit_phase(), reload)  # rollout

    def _reload_before_sleep(self) -> None:
        """Reload now if the device has room for it and a margin; else leave it for later.

        The head by copy engine, waited for; the tail (:func:`tail_bytes`) fed to the
        copy engines through the sleep (:meth:`Offloader.start_reload`), for the
        ``reload`` stage to finish. Nothing fails here for want of room: without it,
        or if a part is refused (what was not reloaded is intact in the host pool),
        the ``reload`` stage reloads the rest after the engine's sleep as usual.
        """
        if not self.reload_early or self.offloader is None or not self._state.offloaded:
            return
        if self._shared_device:  # another rank's engine here may still be generating
            info_once(
                "switch-shared-device",
                "HybridSwitch: another rank's switch works on this GPU; the reload waits "
                "for every rank's engine to sleep (reload_early does not apply)",
            )
            return
        _, free, need = self._room()
        if not need or free is None or free < need + early_margin(need):
            return
        total = self.offloader.host_bytes
        last = self.offload_report
        # The copies' own time: the report's wall time ran on to a
        # landing after the KV wake, and would size the tail too small.
        tail = tail_bytes(self.reports, total, last.copy_or_wall_seconds if last else None)
        try:
            with trainer_allocation(self.profile):  # where it trains
                if tail < total:  # the host waits: no engine frees while these copies run
                    self.offloader.reload(by="copy_engine", max_bytes=total - tail)
                if self.offloader.offloaded_groups:  # through the sleep, a chunk at a time
                    self._feed = self.offloader.start_reload()
        except OffloadError as exc:  # what was not reloaded is intact: after the sleep
            logger.info("HybridSwitch: early reload refused (%s); reloading after the sleep", exc)
            return
        self._state.offloaded = self._feed is not None  # its rest: the reload stage's
        logger.debug(
            "HybridSwitch: %s reloaded before the engine's sleep (%s free): %s by copy "
            "engine first, %s fed through the sleep",
            fmt_bytes(need),
            fmt_bytes(free),
            fmt_bytes(total - tail),
            fmt_bytes(tail),
        )

    def _stop_feed(self) -> None:
        """Stop a feed still running (recovery): what it fed stays, the rest offloaded."""
        feed, self._feed = self._feed, None
        if feed is not None and feed.pending:
            feed.stop()

    def _reload(self) -> None:
        feed, self._feed = self._feed, None
        if feed is not None and feed.pending:  # fed through the sleep: the rest now
            feed.finish(by=self.reload_by)
            if self.offloader is not None and not self.offloader.offloaded_groups:
                self._state.offloaded = False
        # Not ``else``: what a feed did not cover (a later group) must still come back.
        if self.offloader is not None and self._state.offloaded:
            with trainer_allocation(self.profile):  # where it trains
                self.offloader.reload(by=self.reload_by)
            self._state.offloaded = False
