"""What a process's cache is made of: the segments torch could not give back, and why.

``empty_cache`` returns only segments (classic) or pages (expandable) with no live
block; what stays cached is the free part of segments that still hold one. This
names those segments, their size, what is free in them, and the live blocks that
keep them, with the first stack frame outside torch of where each was allocated
(when :func:`hybridmem._torch.record_memory_history` is on).

Scope: the current process's CUDA allocator; costly (a full snapshot): diagnostics.
"""

from __future__ import annotations

from typing import Any

from hybridmem import _torch

__all__ = ["cache_anatomy", "where"]


def where(frames: list[dict[str, Any]] | None) -> str:
    """The first frame outside torch and the standard library: ``file:line function``."""
    for frame in frames or []:
        filename = str(frame.get("filename", ""))
        if not filename.endswith(".py"):  # C++ frames of torch's own unwinder
            continue
        if "/torch/" in filename or "/lib/python3" in filename:
            continue
        return f"{filename}:{frame.get('line')} {frame.get('name')}"
    python = [f for f in frames or [] if str(f.get("filename", "")).endswith(".py")]
    if python:  # only torch's own Python frames: the innermost of them
        return f"{python[0].get('filename')}:{python[0].get('line')} {python[0].get('name')}"
    if frames:
        first = frames[0]
        return f"{first.get('filename')}:{first.get('line')} {first.get('name')}"
    return "unknown (memory history off)"


def cache_anatomy(top: int = 8) -> dict[str, Any]:
    """The segments with cached (free) bytes, largest first, and what holds each.

    Returns:
        ``{"cached": bytes in all, "segments": [{"kind", "pool", "stream", "total",
        "cached", "live_blocks", "holders": [{"size", "where"}]}]}`` (at most ``top``
        segments, three holders each); ``{}`` when there is no snapshot.
    """
    snap = _torch.snapshot()
    if not snap:
        return {}
    parts: list[dict[str, Any]] = []
    for segment in snap.get("segments", []):
        total = int(segment.get("total_size", 0))
        cached = total - int(segment.get("allocated_size", 0))
        if cached <= 0:
            continue
        live = [b for b in segment.get("blocks", []) if b.get("state") == "active_allocated"]
        live.sort(key=lambda b: -int(b.get("size", 0)))
        parts.append(
            {
                "kind": "expandable" if segment.get("is_expandable") else "classic",
                "pool": segment.get("segment_type"),
                "stream": segment.get("stream"),
                "total": total,
                "cached": cached,
                "live_blocks": len(live),
                "holders": [
                    {"size": int(b.get("size", 0)), "where": where(b.get("frames"))}
                    for b in live[:3]
                ],
            }
        )
    parts.sort(key=lambda p: -int(p["cached"]))
    return {"cached": sum(int(p["cached"]) for p in parts), "segments": parts[:top]}
