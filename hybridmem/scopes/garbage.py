"""When a series of releases collects Python's garbage: one vocabulary, one policy.

One release takes a :data:`~hybridmem.scopes.release.Garbage` value (``True`` a full
``gc.collect()``, ``False`` none, ``"young"`` generations 0 and 1). A series of
releases, such as a :class:`~hybridmem.HybridSwitch`'s five per cycle, takes a
:data:`GarbageMode`: one of those three for every release, ``"once"`` (a full pass at
the first release of each series), or ``"adaptive"`` (young generations every time, a
full pass only where device memory did not come back: :class:`GarbageGate`). A
:class:`GarbagePolicy` decides each release of a series, its phase recipes' releases
included (:meth:`GarbagePolicy.for_recipe`).

A full pass costs tens of milliseconds in a trainer process (67 ms on the H200 with
the bench's trainer, up to 135 ms with two million more Python objects) and almost
never finds what holds device memory; when it does, more memory stays allocated than
last time at the same point, which is what the gate looks for.
"""

from __future__ import annotations

from typing import Literal

from hybridmem._devices import DeviceArg
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem.scopes.release import Garbage, ReleaseReport, release_cache

__all__ = [
    "GARBAGE_MODES",
    "GC_SLACK_BYTES",
    "GarbageGate",
    "GarbageMode",
    "GarbagePolicy",
    "check_garbage_mode",
]

#: How much more device memory than last time a release may leave allocated before
#: :class:`GarbageGate` pays for a full collection.
GC_SLACK_BYTES = 64 << 20

#: When a series of releases collects (a :class:`GarbagePolicy`, a switch's
#: ``collect_garbage=``): a :data:`Garbage` value for every release, ``"once"`` a full
#: pass at the first release of a series only, ``"adaptive"`` young generations every
#: time and a full pass only when memory did not come back (:class:`GarbageGate`).
GarbageMode = Garbage | Literal["once", "adaptive"]
#: The one vocabulary, in words, for the errors.
GARBAGE_MODES = "True, False, 'young', 'once' or 'adaptive'"


def check_garbage_mode(mode: object) -> GarbageMode:
    """Return ``mode`` if a series takes it (:data:`GarbageMode`), else raise naming the five.

    Raises:
        TypeError: any other value.
    """
    if isinstance(mode, bool) or mode in ("young", "once", "adaptive"):
        return mode
    raise TypeError(f"collect_garbage must be {GARBAGE_MODES}, got {mode!r}")


class GarbageGate:
    """Young generations at every release; a full pass only when memory did not come back.

    A full ``gc.collect()`` costs tens of milliseconds in a trainer process (67 ms
    on the H200 with the bench's trainer) and almost always finds nothing that holds
    device memory. A reference cycle that does (a closure over activations, an
    exception's traceback keeping a frame) shows as more device memory allocated
    after the release than after the last one at the same point. So: collect the
    young generations (``gc.collect(1)``), release, and compare what is still
    allocated with the last time under the same ``key``; only when it is more by
    over :data:`GC_SLACK_BYTES` (or there is no last time) collect everything and
    release again. The level after a full pass becomes the reference.

    Scope: the devices it releases; one instance per switch (not thread-safe).

    Example:
        >>> gate = GarbageGate()
        >>> report = gate.release(None, "to_rollout")   # doctest: +SKIP
    """

    def __init__(self, slack_bytes: int = GC_SLACK_BYTES) -> None:
        self.slack_bytes = slack_bytes
        self._reference: dict[str, int] = {}
        self.full_passes = 0  # how many releases needed the full pass

    def release(self, device: DeviceArg, key: str) -> ReleaseReport:
        """Release under ``key`` (a point of the cycle); return the last release's report."""
        report = release_cache(device, collect_garbage="young")
        allocated = report.allocated_after
        reference = self._reference.get(key)
        if reference is None or allocated > reference + self.slack_bytes:
            if reference is not None:
                logger.info(
                    "release(%s): %s more allocated than last time after a young collection: "
                    "a full garbage collection",
                    key,
                    fmt_bytes(allocated - reference),
                )
            report = release_cache(device, sync=False, collect_garbage=True)
            self.full_passes += 1
            allocated = report.allocated_after
            self._reference[key] = allocated
        elif allocated < reference:
            self._reference[key] = allocated
        return report


class GarbagePolicy:
    """When each release of a series collects garbage, decided in one place.

    A :class:`~hybridmem.HybridSwitch` keeps one for its releases (a series per
    direction of the switch); a phase's recipe releases follow it through
    :meth:`for_recipe`.

    Args:
        mode: a :data:`GarbageMode`: ``True``/``False``/``"young"`` for every release,
            ``"once"`` (a full pass at the first release of each series), or
            ``"adaptive"`` (young generations, and a full pass only where memory did
            not come back: :class:`GarbageGate`).

    Raises:
        TypeError: another ``mode`` (the message lists the five).

    Scope: one series at a time (not thread-safe).

    Example:
        >>> policy = GarbagePolicy("once")
        >>> policy.begin("to_rollout")
        >>> policy.release(None, "release")   # doctest: +SKIP
    """

    def __init__(self, mode: GarbageMode = "adaptive") -> None:
        self.mode: GarbageMode = check_garbage_mode(mode)
        self.gate = GarbageGate()  # "adaptive": young first, full when memory stayed
        self._series = ""
        self._collected = False

    def __repr__(self) -> str:
        return f"GarbagePolicy({self.mode!r})"

    def begin(self, series: str) -> None:
        """Start a series of releases (``"once"`` collects again; ``"adaptive"`` compares
        like with like: each release's point is keyed under its series)."""
        self._series = series
        self._collected = False

    def _full_now(self) -> Garbage:
        """What the next release collects under a stateless or ``"once"`` mode (counted)."""
        if self.mode == "once":
            first = not self._collected
            self._collected = True
            return first
        return self.mode if self.mode != "adaptive" else False

    def for_recipe(self) -> Garbage | None:
        """What a phase recipe's release collects now: None for the recipe's own.

        ``"adaptive"``: nothing (the series' own releases go through the gate);
        ``"once"``: the recipe's own at the first release of the series, then nothing.
        """
        if self.mode == "adaptive":
            return False
        collect = self._full_now()
        return None if collect is True else collect

    def release(self, device: DeviceArg, point: str) -> ReleaseReport:
        """Release the cache at ``point`` of the series, collecting as the mode says."""
        if self.mode == "adaptive":
            return self.gate.release(device, f"{self._series}:{point}")
        return release_cache(device, collect_garbage=self._full_now())
