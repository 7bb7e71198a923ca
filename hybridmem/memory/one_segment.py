"""Make tensors back to back in one segment: the allocator's rounding paid once, not per tensor.

The caching allocator gives each request over 1 MiB a classic segment of its own,
rounded up to 2 MiB (or a share of a 20 MiB one): a 10.7 MiB weight sits in a 12
MiB segment, and the 1.3 MiB beside it stays cached as long as the weight lives.
An engine's weights in a torch_memory_saver region keep that cache for good: the
region is a private ``torch.cuda.MemPool`` (in both hook modes), whose free
segments ``empty_cache`` never returns, so no later move can take it back (97.7 MiB
of the bench engine's weights: docs/benchmarks.md).

:func:`one_segment` acts when the tensors are made: on entry it allocates one block
as large as they will be and frees it at once, where the caller allocates (inside
the region); the allocator keeps it cached and carves each request made inside
from it (best fit on this stream, split while more than 1 MiB remains).

Scope: the current CUDA device and stream; the allocator settings are switched
process-wide for the block (expandable segments off: the block must be a classic
segment, and torch_memory_saver's ``preload`` hook sees only those); not
thread-safe (another thread's requests would be carved from the block too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from hybridmem import _torch
from hybridmem._checks import MAX_DEVICE_BYTES, check_number, refuse_bare_decoration
from hybridmem._devices import DeviceArg, device_index
from hybridmem._format import fmt_bytes
from hybridmem._log import logger, warn_user
from hybridmem._names import suggests_keywords
from hybridmem._scope import ScopedContext
from hybridmem.observe.memory import MemoryInfo, read_memory
from hybridmem.scopes.allocator import ExpandableSegments, expandable_segments

__all__ = ["OneSegment", "SegmentReport", "one_segment", "segment_bytes"]

Sizes = int | Mapping[Any, torch.Tensor] | Iterable[torch.Tensor]
#: what an entry leaves for its exit: the settings scope, the device, the reading
#: before, and why no block was held ("" when one was)
_Token = tuple[ExpandableSegments, int, MemoryInfo, str]


@dataclass(frozen=True)
class SegmentReport:
    """What one :func:`one_segment` block did.

    Attributes:
        nbytes: the block held for the tensors (0: none could be, see ``reason``).
        reserved: bytes the device's reserved memory grew by inside the block.
        allocated: bytes of tensors made inside that were still alive at its end.
        cached: ``reserved - allocated``: what the tensors made inside left cached
            (the block's unused rest, the rounding of tensors that did not fit in it,
            temporaries freed inside).
        reason: why no block was held (``""`` when one was).
    """

    nbytes: int
    reserved: int
    allocated: int
    reason: str = ""

    @property
    def cached(self) -> int:
        """Bytes reserved inside the block and not held by a tensor at its end."""
        return self.reserved - self.allocated

    def __str__(self) -> str:
        if self.reason:
            return f"one_segment: no block ({self.reason})"
        return (
            f"one_segment of {fmt_bytes(self.nbytes)}: {fmt_bytes(self.allocated)} of tensors "
            f"in {fmt_bytes(self.reserved)} reserved, {fmt_bytes(self.cached)} cached"
        )


def segment_bytes(sizes: Sizes) -> int:
    """The block :func:`one_segment` needs for tensors like ``sizes``.

    Each tensor over 1 MiB (the others go to the allocator's small pool), rounded
    up as the allocator rounds it (512 bytes). Tensors on the ``meta`` device give
    the sizes without memory.

    Args:
        sizes: a byte count, or tensors (a state dict, a list): distinct storages.

    Returns:
        The bytes (``sizes`` itself for an int).

    Raises:
        TypeError: ``sizes`` is neither an int nor tensors.
        ValueError: a negative byte count.

    Example:
        >>> segment_bytes([torch.empty(2731, 1024, device="meta"), torch.empty(1024)])
        11186176
    """
    if isinstance(sizes, bool):
        raise TypeError(f"one_segment sizes must be a byte count or tensors, got {sizes!r}")
    if isinstance(sizes, int):
        check_number(
            "one_segment sizes",
            sizes,
            integer=True,
            minimum=0,
            maximum=MAX_DEVICE_BYTES,
            expected="a byte count from 0 to 1 TiB, or tensors",
        )
        return sizes
    if not isinstance(sizes, (Mapping, list, tuple)):
        raise TypeError(
            "one_segment sizes must be a byte count or tensors (a state dict, a list; meta "
            f"tensors give sizes without memory), got {sizes!r} ({type(sizes).__name__})"
        )
    tensors = list(sizes.values() if isinstance(sizes, Mapping) else sizes)
    wrong = [t for t in tensors if not isinstance(t, torch.Tensor)]
    if wrong:
        raise TypeError(
            "one_segment sizes must be a byte count or tensors (a state dict, a list; "
            f"meta tensors give sizes without memory), got a {type(wrong[0]).__name__}"
        )
    return sum(
        _torch.block_bytes(t.nbytes) for t in tensors if t.nbytes > _torch.SMALL_REQUEST_BYTES
    )


class OneSegment(ScopedContext):
    """Hold one block on entry; on exit, report what was made inside (:func:`one_segment`)."""

    def __init__(self, nbytes: int, device: int | None) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.device = device  # None: the current device at each entry
        #: the last block's report (None before the first exit)
        self.report: SegmentReport | None = None

    def __repr__(self) -> str:
        return f"one_segment({self.nbytes})"

    def _spans_with_block(self) -> bool:
        return False  # it places the tensors one call makes: on __enter__, that call's

    def _enter(self) -> object:
        index = self.device if self.device is not None else _torch.current_device() or 0
        settings = expandable_segments(False, release_cache=False)
        settings.__enter__()
        try:
            _torch.synchronize(index)
            before = read_memory(index)
            reason = "" if self.nbytes > 0 else "no tensor over 1 MiB to make"
            if not reason:
                try:
                    _torch.hold_block(self.nbytes, torch.device("cuda", index))
                except torch.OutOfMemoryError as exc:
                    reason = f"no room: {str(exc).splitlines()[0]}"
                    warn_user(
                        f"one_segment could not hold one block of {fmt_bytes(self.nbytes)} "
                        f"({reason}); the tensors made inside go where the allocator puts them"
                    )
        except BaseException:
            settings.__exit__(None, None, None)
            raise
        return settings, index, before, reason

    def _exit(self, token: object, exc: BaseException | None) -> None:
        settings, index, before, reason = cast(_Token, token)
        try:
            _torch.synchronize(index)
            after = read_memory(index)
            self.report = SegmentReport(
                nbytes=0 if reason else self.nbytes,
                reserved=after.reserved - before.reserved,
                allocated=after.allocated - before.allocated,
                reason=reason,
            )
            logger.info("%s", self.report)
        finally:
            settings.__exit__(None, None, None)


@suggests_keywords
def one_segment(sizes: Sizes, *, device: DeviceArg = None) -> OneSegment:
    """Make the tensors of a block (or call) back to back in one segment.

    Use it where tensors are made that will live long and must stay in classic
    segments: an engine's weights inside its torch_memory_saver region (SGLang's
    ``release_memory_occupation`` frees the region, rounding and all, and takes it
    back whole). Where expandable segments may be used, they pack tensors as well
    (:func:`hybridmem.compact` moves existing ones there).

    Args:
        sizes: the block's bytes, or the tensors to be made (meta tensors will do):
            see :func:`segment_bytes`. Too small: the rest are placed as usual (and
            rounded); too large: the unused rest stays cached.
        device: the CUDA device, as everywhere in hybridmem (``hybridmem._devices``):
            None (default) is the current device at each entry.

    Returns:
        A :class:`OneSegment` context/decorator; ``.report`` is a
        :class:`SegmentReport` after each exit (also logged at INFO). With no room
        for the block, a :class:`~hybridmem.HybridMemWarning` says so and the block
        runs all the same.

    Raises:
        TypeError, ValueError: ``sizes`` is not a byte count >= 0 or tensors, or
            ``device`` names no CUDA device (at the call, before anything is
            allocated).

    Scope: the device's current stream; expandable segments off for the block,
    process-wide; not thread-safe (other threads' requests would be carved too).

    Example:
        >>> shapes = meta_model.state_dict()                 # doctest: +SKIP
        >>> with saver.region("weights"), hm.one_segment(shapes) as packed:  # doctest: +SKIP
        ...     model = build_model(device="cuda")
        >>> print(packed.report)                             # doctest: +SKIP
    """
    refuse_bare_decoration(
        "one_segment", sizes, "@hm.one_segment(nbytes) or @hm.one_segment(meta_state_dict)"
    )
    nbytes = segment_bytes(sizes)
    return OneSegment(nbytes, None if device is None else device_index(device))
