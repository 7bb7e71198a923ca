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

__all__ = ["cache_anatomy", "kept_page_bytes", "where"]

#: The pages of an expandable segment: torch maps a large-pool segment in 20 MiB
#: pages (``kLargeBuffer``), a small-pool one in 2 MiB pages (``kSmallBuffer``).
LARGE_PAGE_BYTES = 20 << 20
SMALL_PAGE_BYTES = 2 << 20
_LIVE = ("active_allocated", "active_pending_free")


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


def kept_page_bytes(snap: dict[str, Any] | None = None) -> int | None:
    """Free bytes on the units of release that also hold a live block: what no release frees.

    ``empty_cache`` unmaps an expandable segment's pages that hold no live block and
    frees a classic segment that holds none; a page (classic: the whole segment) with
    one live block keeps all of its bytes. A plan that moves part of a state and keeps
    the rest keeps the page where a moved and a kept tensor met: its free part is
    counted here.

    Args:
        snap: an allocator snapshot (``torch.cuda.memory._snapshot()``); None: this
            process's, now.

    Returns:
        The bytes, or None where there is no snapshot (no CUDA, an older torch).

    Example:
        >>> page = 20 << 20
        >>> segment = {"address": 0, "total_size": 2 * page, "is_expandable": True,
        ...            "segment_type": "large", "blocks": [
        ...     {"address": 0, "size": page + 1024, "state": "active_allocated"},
        ...     {"address": page + 1024, "size": page - 1024, "state": "inactive"}]}
        >>> kept_page_bytes({"segments": [segment]})  # the second page's free part
        20970496
    """
    snap = _torch.snapshot() if snap is None else snap
    if not snap:
        return None
    kept = 0
    for segment in snap.get("segments", []):
        blocks = [b for b in segment.get("blocks", []) if b.get("state") in _LIVE]
        if not blocks:
            continue
        live = sum(int(b.get("size", 0)) for b in blocks)
        if not segment.get("is_expandable"):
            kept += int(segment.get("total_size", 0)) - live
            continue
        page = LARGE_PAGE_BYTES if segment.get("segment_type") == "large" else SMALL_PAGE_BYTES
        base = int(segment.get("address", 0))
        pages: set[int] = set()
        for block in blocks:
            start = int(block.get("address", 0)) - base
            end = start + max(1, int(block.get("size", 0))) - 1
            pages.update(range(start // page, end // page + 1))
        kept += len(pages) * page - live
    return kept
