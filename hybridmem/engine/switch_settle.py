"""When the engine's sleep has given its memory back: as much as it gave the last time.

Why: after the engine's sleep returns, the switch waits for device
free memory to settle (SGLang's ``release_memory_occupation`` can return before the
scheduler has freed). Settling is three equal readings 10 ms apart: at
least 20 ms, every cycle (``confirm`` took 21-22 ms in the bench at every size, a
third of the switch to trainer's distance from its ceiling at 32 GiB). An engine gives
back the same memory cycle after cycle (its weights and KV cache), so once one sleep
has been seen through, the next is done when free memory has risen as far again: the
first reading that shows it ends the wait. A sleep that gives back less than before
still waits for settling, as before.

Only raised, never lowered: a wait that stopped on this figure reads no more than it,
and a settling that came too early (a scheduler that had not begun to free) reads
less than the truth; either would otherwise lower the next figure, cycle after cycle,
until a wait ended before any memory came back. Not used where another rank's switch
shares the GPU (its engine's memory moves the same reading).
"""

from __future__ import annotations

from hybridmem.observe.memory import MemoryInfo

__all__ = ["SETTLE_SLACK_BYTES", "EngineReturn"]

#: How far short of the last sleep's return a reading may be and still end the wait:
#: readings after the same engine's sleep differed by a few MiB in the bench.
SETTLE_SLACK_BYTES = 64 << 20


class EngineReturn:
    """What the engine's sleeps gave back, and the free memory that ends the next wait.

    Example:
        >>> returns = EngineReturn()
        >>> before = MemoryInfo(0, True, reserved=1 << 30, free=10 << 30, total=80 << 30)
        >>> returns.mark(before, shared=False) is None   # nothing seen yet: settle
        True
        >>> returns.learn(MemoryInfo(0, True, reserved=1 << 30, free=50 << 30, total=80 << 30))
        >>> returns.freed >> 30, returns.mark(before, shared=False) >> 20
        (40, 51136)

    Scope: one switch's engine, on the switch's thread.
    """

    def __init__(self) -> None:
        self.freed: int | None = None  # the most one sleep gave back, bytes
        self._mark: tuple[int, int] | None = None  # (free, own reserved) before this sleep

    def mark(self, before: MemoryInfo, *, shared: bool) -> int | None:
        """Note the memory just before the engine sleeps; return the free bytes that end the wait.

        Args:
            before: this process's reading just before the sleep.
            shared: another rank's switch works on this GPU (then None: settle).

        Returns:
            Device free bytes that mean this sleep is done, or None (wait for settling).
        """
        if before.free is None:  # no CUDA context here: nothing to read
            self._mark = None
            return None
        self._mark = (before.free, before.reserved)
        if shared or not self.freed:
            return None
        return max(0, before.free + self.freed - SETTLE_SLACK_BYTES)

    def learn(self, after: MemoryInfo) -> None:
        """Note what this sleep gave back, read once the wait for it has ended.

        What the engine gave back is the rise in device free memory less this process's
        own part in it (its cache released meanwhile lowers its reserved bytes by as
        much as it raises free memory).
        """
        mark, self._mark = self._mark, None
        if mark is None or after.free is None:
            return
        freed = (after.free - mark[0]) + (after.reserved - mark[1])
        if freed > 0:
            self.freed = max(self.freed or 0, freed)
