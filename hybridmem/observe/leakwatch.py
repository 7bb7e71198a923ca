"""LeakWatch: memory at a phase boundary that keeps growing across cycles.

Slow leaks show up only after 50-220 steps (verl #1232, #3902): a staging
buffer kept per step, a reference cycle holding activations, IPC blocks nobody
collects. Measuring the same boundary every cycle and fitting a line over a window
turns "it OOMs at step 223" into "allocated grows 38 MiB per cycle after sleep".
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Literal

from hybridmem._checks import check_number
from hybridmem._devices import resolve_devices
from hybridmem._format import fmt_bytes
from hybridmem._log import logger, warn_once
from hybridmem._names import suggests_keywords
from hybridmem._phase_names import canonical_phase
from hybridmem.observe import timeline as _timeline
from hybridmem.observe.memory import memory_info

__all__ = ["LeakWatch", "Metric"]

Metric = Literal["allocated", "reserved", "used"]
_METRICS = ("allocated", "reserved", "used")
_MAX_WINDOW = 1_000_000  # cycles: the window is a deque of that many readings


def slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index (bytes per cycle)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


@suggests_keywords
class LeakWatch:
    """Flag memory at one phase boundary that grows across cycles.

    Feed it one reading per cycle, either by hand (:meth:`observe`) or from the
    timeline (``attach=True``: the ``after`` memory of every end of the phase
    ``boundary``, which needs :func:`hybridmem.record` or ``HYBRIDMEM_TIMELINE``).
    Once ``window`` readings are in, it fits a line over the last ``window``; a
    slope above ``slope_bytes`` per cycle logs a :class:`HybridMemWarning` once,
    with the figure.

    Args:
        boundary: the phase whose end is measured (``"sleep"``: after the engine
            gave its memory back, where growth means the trainer leaks).
        metric: ``"allocated"`` (live tensors), ``"reserved"`` (torch's cache) or
            ``"used"`` (device total minus free: every process on the device).
        window: how many cycles the line is fitted over (>= 3).
        slope_bytes: growth per cycle that counts as a leak (default 2 MiB).
        device: the device read by :meth:`observe` without a value (None: current).
        attach: listen to the timeline for the boundary's events.

    Scope: thread-safe. Example::

        watch = hm.LeakWatch("sleep", window=20)
        for step in range(steps):
            ...
            watch.observe()          # or attach=True with hm.record()
    """

    def __init__(
        self,
        boundary: str = "sleep",
        *,
        metric: Metric = "allocated",
        window: int = 20,
        slope_bytes: float = 2 * 2**20,
        device: int | None = None,
        attach: bool = False,
    ) -> None:
        self.boundary = canonical_phase(boundary)
        if metric not in _METRICS:
            raise ValueError(f"metric must be one of {', '.join(_METRICS)}; got {metric!r}")
        check_number(
            "window",
            window,
            integer=True,
            minimum=3,
            maximum=_MAX_WINDOW,
            wrong_type=ValueError,
            expected=f"an int from 3 to {_MAX_WINDOW}",
        )
        if device is not None:
            resolve_devices(device)  # checked now, read at each boundary
        check_number("slope_bytes", slope_bytes, above=0)
        self.metric = metric
        self.window = window
        self.slope_bytes = float(slope_bytes)
        self.device = device
        self.samples: deque[int] = deque(maxlen=window)
        self.cycles = 0
        self.flagged = False
        self._lock = threading.Lock()
        self._attached = False
        if attach:
            _timeline.get_timeline().add_listener(self._on_event)
            self._attached = True

    def __repr__(self) -> str:
        return (
            f"LeakWatch({self.boundary!r}, metric={self.metric!r}, window={self.window}, "
            f"slope={fmt_bytes(int(self.slope_bytes))}/cycle)"
        )

    def _read(self) -> int | None:
        info = memory_info(self.device)
        if not info.available or info.free is None or info.total is None:
            return None
        if self.metric == "used":
            return info.total - info.free
        return info.allocated if self.metric == "allocated" else info.reserved

    def _on_event(self, event: _timeline.Event) -> None:
        if event.kind != "phase" or event.name != f"phase:{self.boundary}":
            return
        if self.metric in event.after:
            self.observe(event.after[self.metric])

    def observe(self, value: int | None = None) -> float | None:
        """Add one cycle's reading (None: read it now); return the fitted slope, if any.

        Returns None until ``window`` readings are in (or when nothing can be read).
        """
        if value is None:
            value = self._read()
            if value is None:
                return None
        with self._lock:
            self.samples.append(int(value))
            self.cycles += 1
            if len(self.samples) < self.window:
                return None
            fitted = slope([float(v) for v in self.samples])
            flag = fitted > self.slope_bytes and not self.flagged
            if flag:
                self.flagged = True
        if flag:
            message = (
                f"possible leak: {self.metric} memory after {self.boundary!r} grew "
                f"{fmt_bytes(int(fitted))} per cycle over the last {self.window} cycles "
                f"(now {fmt_bytes(int(value))}, cycle {self.cycles}; threshold "
                f"{fmt_bytes(int(self.slope_bytes))}/cycle)"
            )
            warn_once(f"leak:{id(self)}", message)
            logger.warning("%s", message)
        return fitted

    @property
    def slope(self) -> float | None:
        """The slope over the readings so far (bytes per cycle); None before two."""
        with self._lock:
            values = [float(v) for v in self.samples]
        return slope(values) if len(values) >= 2 else None

    def close(self) -> None:
        """Stop listening to the timeline."""
        if self._attached:
            _timeline.get_timeline().remove_listener(self._on_event)
            self._attached = False
