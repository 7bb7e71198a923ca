"""The switch's reload: queued before the engine sleeps when the device has room, else after.

Why (issue #25, decision 79): a host-to-device copy right after another process freed
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

How (decision 80): the copies themselves are done by kernels reading the pinned
pool's device mapping (``reload_by="kernel"``, :mod:`hybridmem._torch.mapped`): the
copy engines slow down as the engine frees, during the sleep as after it (0.46 of
the pinned rate after a 60 GiB free and 0.56-0.64 during it; kernels 0.81-0.82,
``benchmarks/reload_by_kernel.py``). An early reload sends its first bytes by copy
engine (:func:`copy_engine_budget`): kernels in flight held the engine's sleep up.

A mixin of :class:`~hybridmem.engine.switch.HybridSwitch`: the switch's state is
declared here for the type checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from hybridmem import _torch
from hybridmem._checks import check_bool
from hybridmem._errors import OffloadError
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem.engine.reports import SwitchReport
from hybridmem.engine.switch_parts import SwitchState
from hybridmem.memory.offload import RELOAD_WAYS, Offloader

__all__ = ["Reloading", "copy_engine_budget", "early_margin"]

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


def copy_engine_budget(reports: list[SwitchReport], host_bytes: int) -> int:
    """Bytes of an early reload the copy engines can move while the engine sleeps.

    The last ``sleep`` stage's seconds at the last ``offload`` stage's rate (the same
    pool and copy engines, the other way). Those bytes go by copy engine, the rest by
    kernel: kernels in flight held the engine's sleep up (measured on an H200: 55-104
    ms against 29-47 ms with the copy engines, decision 80), and the copy engines run
    at full rate until the engine frees. 0 before any full cycle: all by kernel.

    Example:
        >>> copy_engine_budget([], 1 << 30)
        0
    """
    sleep = _seconds(reports, "to_trainer", "sleep")
    offload = _seconds(reports, "to_rollout", "offload")
    if not sleep or not offload or host_bytes <= 0:
        return 0
    return int(host_bytes / offload * sleep)


class Reloading:
    """Reload the trainer state early (room permitting) or after the engine's sleep."""

    if TYPE_CHECKING:  # the switch's, used here
        offloader: Offloader | None
        device: int | None
        reports: list[SwitchReport]
        _state: SwitchState

        def _room(self) -> tuple[bool, int | None, int]: ...

    def _init_reload(self, reload_early: bool, reload_by: Literal["kernel", "copy_engine"]) -> None:
        """Check and keep the switch's ``reload_early`` and ``reload_by``."""
        self.reload_early = check_bool("reload_early", reload_early)
        if reload_by not in RELOAD_WAYS:
            raise ValueError(
                f"reload_by must be 'kernel' or 'copy_engine', got {reload_by!r}: 'kernel' "
                "reloads at about 1.7x the copy engines' rate right after the engine's sleep"
            )
        self.reload_by: Literal["kernel", "copy_engine"] = reload_by
        self._queued = False  # a reload queued before the sleep, not yet waited for
        self._shared_device = False  # another rank's switch works on this GPU too

    def _reload_before_sleep(self) -> None:
        """Queue the reload now if the device has room for it and a margin; else leave it.

        Nothing fails here: without room, or if the reload is refused (nothing was
        reloaded, the data is intact in the host pool), the ``reload`` stage reloads
        after the engine's sleep as usual.
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
        try:
            first = copy_engine_budget(self.reports, self.offloader.host_bytes)
            self.offloader.reload(non_blocking=True, by=self.reload_by, copy_engine_first=first)
        except OffloadError as exc:  # nothing reloaded, intact: after the sleep, then
            logger.info("HybridSwitch: early reload refused (%s); reloading after the sleep", exc)
            return
        self._state.offloaded = False
        self._queued = True
        logger.debug(
            "HybridSwitch: %s queued for reload before the engine's sleep (%s free; "
            "the first %s by copy engine)",
            fmt_bytes(need),
            fmt_bytes(free),
            fmt_bytes(first if self.reload_by == "kernel" else need),
        )

    def _reload(self) -> None:
        if self._queued:  # queued before the engine's sleep: wait for the copies to land
            self._queued = False
            index = self.device if self.device is not None else _torch.current_device()
            if index is not None:
                _torch.synchronize(index)
        # Not ``else``: a switch that failed after queueing one leaves the flag, and
        # what a later cycle offloaded must still come back.
        if self.offloader is not None and self._state.offloaded:
            self.offloader.reload(by=self.reload_by)
            self._state.offloaded = False
