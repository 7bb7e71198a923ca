"""What one entry of :func:`hybridmem.suspend_communicators` did: its report."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridmem._format import fmt_bytes

__all__ = ["CommunicatorReport"]


@dataclass
class CommunicatorReport:
    """What one entry of :func:`suspend_communicators` did, completed at its exit.

    Attributes:
        suspended: the groups this entry suspended (torch's names).
        nested: groups an outer scope already held (left to it).
        skipped: group -> why it was left alone.
        released: device bytes NCCL counted as suspendable in the suspended groups.
        freed: device free memory gained by the suspends (``cudaMemGetInfo``; other
            processes on the device count too). None without a device.
        suspend_s, resume_s: seconds spent in the suspends and the resumes (None:
            not resumed yet, or not by this entry).
    """

    suspended: list[str] = field(default_factory=list)
    nested: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    released: int = 0
    freed: int | None = None
    suspend_s: float = 0.0
    resume_s: float | None = None

    def __str__(self) -> str:
        parts = [
            f"suspended {len(self.suspended)} communicator(s), NCCL released "
            f"{fmt_bytes(self.released)} (device free +{fmt_bytes(self.freed)}) in "
            f"{self.suspend_s * 1e3:.1f} ms"
        ]
        if self.resume_s is not None:
            parts.append(f"resumed in {self.resume_s * 1e3:.1f} ms")
        if self.skipped:
            parts.append("left alone: " + "; ".join(f"{g} ({w})" for g, w in self.skipped.items()))
        return ", ".join(parts)
