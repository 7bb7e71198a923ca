"""vLLM's sleep-mode pool put to sleep and woken with only the work its state needs.

vLLM's sleep-mode pool is its ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``):
each allocation made inside ``use_memory_pool(tag)`` is recorded in
``pointer_to_data`` (its handle ``(device, size, address, handle pointer)``, its tag,
``is_asleep``, ``cpu_backup_tensor``), and vLLM's C extension maps and unmaps it
(``create_and_map``: ``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``;
``unmap_and_release``: ``cuMemUnmap``, ``cuMemRelease``). vLLM 0.33's default
sleep-mode backend, ``cumem``, calls ``CuMemAllocator.sleep``/``wake_up``, which run
a full ``gc.collect()`` and ``empty_cache()`` at every sleep and every wake, and at
level 1 copy each kept allocation synchronously into host memory pinned right then
(``torch.empty(..., pin_memory=True)``: the first sleep pins; 6.10 s for 14.5 GiB on
an H100).

:class:`PoolSleep` does the same to the same records with the same calls of vLLM's
extension, and only the work the state needs:

- the kept allocations (level 1's ``weights``; ``runtime`` and ``cudagraph`` at every
  level, as vLLM's backend keeps them) go to host memory pinned once, in exact-size
  chunks (:meth:`PoolSleep.reserve`, ahead of the first sleep), their copies queued
  together with one synchronisation;
- after a sleep, torch's cache is emptied with a young garbage collection, and a full
  one only where memory did not come back
  (:class:`~hybridmem.scopes.garbage.GarbageGate`); a wake collects and empties only
  when the device lacks the memory it maps;
- the records keep vLLM's meaning: a kept allocation's ``cpu_backup_tensor`` is its
  host copy, so vLLM's own ``wake_up`` brings it back too, and vLLM's own policy
  checks see what this sleep kept.

Scope: one process's pool (vLLM's allocator is a process singleton); not
thread-safe (vLLM's worker sleeps and wakes from one thread).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from hybridmem import _torch
from hybridmem._errors import SleepPoolError
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem.integrations.vllm.host_places import HostPlaces
from hybridmem.scopes.garbage import GarbageGate
from hybridmem.scopes.release import release_cache

__all__ = [
    "DEFERRABLE_TAGS",
    "KEPT_AT_EVERY_LEVEL",
    "PoolSleep",
    "SleepReport",
    "SleepState",
    "kept_tags",
    "pool_records",
]

#: The lifecycle vLLM's ``SleepModeBackend.state()`` reports (``/health``).
SleepState = Literal["RUNNING", "SUSPENDED", "RESUMING"]
#: Tags vLLM 0.33's ``cumem`` backend keeps in host memory at every level.
KEPT_AT_EVERY_LEVEL = ("runtime", "cudagraph")
#: Tags a wake leaves asleep unless asked (vLLM's ``DEFERRABLE_TAGS``): any wake maps
#: every other tag.
DEFERRABLE_TAGS = ("weights", "kv_cache")

MapFn = Callable[[Any], None]


def kept_tags(level: int) -> tuple[str, ...]:
    """The tags whose bytes a sleep at ``level`` keeps, as vLLM's ``cumem`` backend.

    Raises:
        ValueError: ``level`` is not 1 or 2.

    Example:
        >>> kept_tags(1), kept_tags(2)
        (('weights', 'runtime', 'cudagraph'), ('runtime', 'cudagraph'))
    """
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(
            f"sleep level must be 1 (weights kept in host memory) or 2 (weights "
            f"discarded: sync them after waking), got {level!r}"
        )
    return (("weights",) if level == 1 else ()) + KEPT_AT_EVERY_LEVEL


def pool_records(allocator: Any) -> dict[int, Any]:
    """The records of vLLM's pool (``pointer_to_data``), refused if it has none.

    Raises:
        TypeError: ``allocator`` is not vLLM's ``CuMemAllocator``, or its records keep
            no ``is_asleep`` flag (vLLM before 0.25).
    """
    records = getattr(allocator, "pointer_to_data", None)
    if not isinstance(records, dict):
        raise TypeError(
            f"expected vLLM's CuMemAllocator (CuMemAllocator.get_instance()), got "
            f"{type(allocator).__name__}: it has no pointer_to_data records"
        )
    for data in records.values():
        if not hasattr(data, "is_asleep"):
            raise TypeError(
                "this vLLM's sleep-mode pool keeps no is_asleep flag on its records (vLLM "
                "before 0.25): hybridmem cannot tell what sleeps. Use vLLM's own sleep here"
            )
        break
    return records


@dataclasses.dataclass(frozen=True)
class SleepReport:
    """What one sleep, wake or discard of the pool did.

    Attributes:
        action: ``"suspend"``, ``"resume"`` or ``"discard"``.
        allocations: allocations unmapped (suspend, discard) or mapped (resume).
        nbytes: their bytes.
        copied: bytes copied between the device and host memory.
        pinned: host bytes pinned by this call (0 once reserved ahead).
        released: torch's cache emptied by this call.
        seconds: its wall time.
        copy_seconds: the copies' part of it (queued, then synchronised).
    """

    action: str
    allocations: int
    nbytes: int
    copied: int
    pinned: int
    released: bool
    seconds: float
    copy_seconds: float = 0.0

    def __str__(self) -> str:
        return (
            f"{self.action}: {self.allocations} allocations, {fmt_bytes(self.nbytes)}, "
            f"{fmt_bytes(self.copied)} copied, {fmt_bytes(self.pinned)} pinned, "
            f"cache {'emptied' if self.released else 'left'}, {self.seconds * 1e3:.1f} ms"
        )


def _size(data: Any) -> int:
    return int(data.handle[1])


def _device(data: Any) -> int:
    return int(data.handle[0])


def _noop() -> None:
    return None


def _out_of_memory(exc: BaseException) -> bool:
    return "out of memory" in str(exc).lower()


class PoolSleep:
    """Sleep and wake vLLM's ``CuMemAllocator`` pool; keep tagged bytes in host memory pinned once.

    Args:
        allocator: vLLM's ``CuMemAllocator.get_instance()``.
        create_and_map: vLLM's ``cumem.create_and_map(handle)`` (its C extension).
        unmap_and_release: vLLM's ``cumem.unmap_and_release(handle)``.

    Raises:
        TypeError: ``allocator`` is not vLLM's, or its records say nothing of what
            sleeps (vLLM before 0.25).

    Example:
        >>> from vllm.device_allocator import cumem   # doctest: +SKIP
        >>> pool = PoolSleep(cumem.CuMemAllocator.get_instance(),
        ...                  create_and_map=cumem.create_and_map,
        ...                  unmap_and_release=cumem.unmap_and_release)  # doctest: +SKIP
        >>> pool.reserve(level=1)   # after the weights load: pins host memory  # doctest: +SKIP
        >>> pool.suspend(1); pool.resume(["weights"]); pool.resume(["kv_cache"])  # doctest: +SKIP

    Scope: one process's pool; not thread-safe.
    """

    def __init__(self, allocator: Any, *, create_and_map: MapFn, unmap_and_release: MapFn) -> None:
        pool_records(allocator)
        for name, fn in (
            ("create_and_map", create_and_map),
            ("unmap_and_release", unmap_and_release),
        ):
            if not callable(fn):
                raise TypeError(f"{name} must be vLLM's cumem.{name}, got {fn!r}")
        self.allocator = allocator
        self._map = create_and_map
        self._unmap = unmap_and_release
        self._places = HostPlaces(pin_memory=True)
        self._gate = GarbageGate()
        self._resuming = False
        #: the last call's report (None before the first)
        self.last: SleepReport | None = None

    # -- what is where -----------------------------------------------------------------

    def state(self) -> SleepState:
        """The pool's lifecycle: ``RESUMING``, ``SUSPENDED`` or ``RUNNING``.

        ``RESUMING`` inside :meth:`resume`, ``SUSPENDED`` while any allocation of the
        pool sleeps, ``RUNNING`` otherwise. Read from the pool's records, so a wake or
        sleep made by vLLM's own allocator calls counts too.
        """
        if self._resuming:
            return "RESUMING"
        records = pool_records(self.allocator)
        return "SUSPENDED" if any(d.is_asleep for d in records.values()) else "RUNNING"

    def asleep(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(asleep, kept)``: bytes asleep by tag, and of those the bytes kept in host memory."""
        asleep: dict[str, int] = {}
        kept: dict[str, int] = {}
        for data in pool_records(self.allocator).values():
            if data.is_asleep:
                asleep[data.tag] = asleep.get(data.tag, 0) + _size(data)
                if data.cpu_backup_tensor is not None:
                    kept[data.tag] = kept.get(data.tag, 0) + _size(data)
        return asleep, kept

    def _error(self, what: str, exc: BaseException) -> SleepPoolError:
        asleep, kept = self.asleep()
        parts = []
        for tag, n in sorted(asleep.items()):
            held = kept.get(tag, 0)
            how = "kept in host memory" if held == n else f"{fmt_bytes(held)} of it kept"
            if not held:
                how = "discarded"
            parts.append(f"{tag} {fmt_bytes(n)} ({how})")
        return SleepPoolError(
            f"{what}: {exc}. Asleep now: {', '.join(parts) or 'nothing'}; the rest of the "
            "pool is mapped. What is kept is still in host memory: a wake (resume, or "
            "vLLM's wake_up) maps it and copies it back",
            asleep=asleep,
            kept=kept,
        )

    # -- host memory ---------------------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        """Host memory pinned for kept allocations so far."""
        return self._places.nbytes

    def reserve(self, level: int = 1) -> int:
        """Pin host memory for what a sleep at ``level`` keeps; return the bytes pinned now.

        Call it once the engine has made its memory (after vLLM's model load, and
        after the KV cache and CUDA graphs for the ``runtime`` and ``cudagraph``
        tags), so that no sleep pins: pinning runs at a few GB/s, copies into pinned
        memory at tens. It also pays here the first copy into what it pinned (a first
        use, paid once: :mod:`~hybridmem.integrations.vllm.host_places`) and the
        one full garbage collection the sleeps' cache releases start with. An
        allocation freed since gives its place to a later one of its size or less; one
        made since gets a place of its own.

        Raises:
            ValueError: ``level`` is not 1 or 2.
            SleepPoolError: the first copy failed (what was pinned stays pinned, nothing
                sleeps).
        """
        keep = kept_tags(level)
        records = pool_records(self.allocator)
        kept = [(a, d) for a, d in records.items() if d.tag in keep]
        pinned = self._places.reserve(kept, live=records)
        # The first copy into the places pays a first use (host_places): make it
        # here, at load, not in the first sleep.
        began = time.perf_counter()
        try:
            warmed = self._places.warm(kept)
        except Exception as exc:
            raise self._error(
                "the first copy into the host memory just pinned failed (it stays "
                "pinned; the next reserve or sleep copies again)",
                exc,
            ) from exc
        if warmed:
            logger.info(
                "vLLM sleep pool: first copy of %s into the places in %.1f ms (at reserve)",
                fmt_bytes(warmed),
                (time.perf_counter() - began) * 1e3,
            )
        # The sleeps' cache release pays one full garbage collection, the first time
        # (GarbageGate): pay it here, at load, not in the first sleep.
        for device in {_device(d) for d in records.values()}:
            self._gate.release(device, "vllm sleep")
        return pinned

    # -- the lifecycle -----------------------------------------------------------------

    def suspend(self, level: int = 1) -> SleepReport:
        """Sleep the pool: keep the bytes of :func:`kept_tags` in host memory, discard the rest.

        What already sleeps stays as it is (vLLM's rule: a sleep does not change the
        policy of sleeping allocations; one warning says so where it would).

        Raises:
            ValueError: ``level`` is not 1 or 2 (nothing changed).
            SleepPoolError: a copy or an unmap failed; a failed copy leaves the pool
                as it was, a failed unmap says what is asleep.
        """
        keep = kept_tags(level)
        began = time.perf_counter()
        records = pool_records(self.allocator)
        if any(
            d.is_asleep and (d.tag in keep) != (d.cpu_backup_tensor is not None)
            for d in records.values()
        ):
            logger.warning(
                "vLLM sleep pool: a sleep at level %d cannot change what already sleeps "
                "(kept or discarded); those allocations stay as they are",
                level,
            )
        awake = [(a, d) for a, d in records.items() if not d.is_asleep]
        kept = [(a, d) for a, d in awake if d.tag in keep]
        pinned = self._places.reserve(kept, live=records)
        if pinned:
            info_once(
                "vllm-sleep-pinned-in-sleep",
                f"vLLM sleep pool: this sleep pinned {fmt_bytes(pinned)} of host memory; "
                "reserve it at load (hybridmem.integrations.vllm.sleep_backend."
                "reserve_sleep_backup, docs/backends/vllm.md) so that no sleep pins",
            )
        devices = {_device(d) for _, d in awake}
        for device in devices:
            torch.cuda.synchronize(device)  # the engine's last kernels on this memory
        copy_began = time.perf_counter()
        try:
            copied = self._places.copy_in(kept)
        except Exception as exc:
            raise self._error(
                "the sleep's copies into host memory failed, nothing was unmapped", exc
            ) from exc
        copy_seconds = time.perf_counter() - copy_began
        done = 0
        try:
            for address, data in awake:
                self._unmap(data.handle)
                data.is_asleep = True
                if data.tag in keep:
                    data.cpu_backup_tensor = self._places[address]
                done += 1
        except Exception as exc:
            raise self._error(
                f"the sleep stopped after unmapping {done} of {len(awake)} allocations", exc
            ) from exc
        released = False
        for device in devices:
            self._gate.release(device, "vllm sleep")
            released = True
        return self._report(
            "suspend",
            awake,
            copied=copied,
            pinned=pinned,
            released=released,
            began=began,
            copy_seconds=copy_seconds,
        )

    def resume(self, tags: Sequence[str] | None = None) -> SleepReport:
        """Wake ``tags`` (None: everything; other tags than ``weights``/``kv_cache`` always).

        Kept bytes come back; the rest is fresh memory (a level-2 ``weights`` wake
        needs a weight sync). The device's cache is emptied first only when its free
        memory is short of what is mapped, and a mapping the driver refuses for
        memory gets one full release and one more try.

        Raises:
            TypeError: ``tags`` is a string.
            SleepPoolError: a mapping or a copy failed; it says what still sleeps
                (what is kept stays in host memory for the next wake).
        """
        if isinstance(tags, str):
            raise TypeError(
                f"tags must be a list of tag names, got the string {tags!r}: [{tags!r}]"
            )
        began = time.perf_counter()
        records = pool_records(self.allocator)
        waking = [
            (a, d)
            for a, d in records.items()
            if d.is_asleep and (tags is None or d.tag in tags or d.tag not in DEFERRABLE_TAGS)
        ]
        self._resuming = True
        released = False
        copied = 0
        try:
            devices = {_device(d) for _, d in waking}
            for device in devices:
                needed = sum(_size(d) for _, d in waking if _device(d) == device)
                if _torch.mem_get_info(device)[0] < needed:
                    release_cache(device, collect_garbage=True)
                    released = True
            back: list[tuple[int, Any]] = []
            failure: Exception | None = None
            try:
                for address, data in waking:
                    try:
                        self._map(data.handle)
                    except RuntimeError as exc:
                        if not _out_of_memory(exc):
                            raise
                        release_cache(_device(data), collect_garbage=True)
                        released = True
                        self._map(data.handle)
                    data.is_asleep = False
                    if data.cpu_backup_tensor is not None:
                        back.append((address, data))
            except Exception as exc:  # what was mapped gets its bytes back first
                failure = exc
            try:
                for address, data in back:
                    view = _torch.tensor_from_memory(address, _size(data), _device(data), _noop)
                    view.copy_(data.cpu_backup_tensor, non_blocking=True)
                    copied += _size(data)
                for device in devices:
                    torch.cuda.synchronize(device)
            except Exception as exc:
                raise self._error(
                    "the wake's copies back failed (the mapped allocations' bytes are still "
                    "in their records' cpu_backup_tensor)",
                    exc,
                ) from exc
            for _, data in back:
                data.cpu_backup_tensor = None  # its place stays pinned for the next sleep
            if failure is not None:
                raise self._error("the wake failed", failure) from failure
        finally:
            self._resuming = False
        return self._report(
            "resume", waking, copied=copied, pinned=0, released=released, began=began
        )

    def discard(self, tags: Sequence[str]) -> SleepReport:
        """Unmap the mapped allocations of ``tags`` without keeping their bytes.

        What already sleeps stays as it is (kept bytes stay kept).

        Raises:
            TypeError: ``tags`` is a string or holds something else than names.
            SleepPoolError: an unmap failed; it says what is asleep.
        """
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise TypeError(f"tags must be a sequence of tag names, got {tags!r}")
        began = time.perf_counter()
        gone = [
            (a, d)
            for a, d in pool_records(self.allocator).items()
            if d.tag in tags and not d.is_asleep
        ]
        for device in {_device(d) for _, d in gone}:
            torch.cuda.synchronize(device)
        done = 0
        try:
            for _, data in gone:
                self._unmap(data.handle)
                data.is_asleep = True
                done += 1
        except Exception as exc:
            raise self._error(
                f"the discard stopped after unmapping {done} of {len(gone)} allocations", exc
            ) from exc
        return self._report("discard", gone, copied=0, pinned=0, released=False, began=began)

    def _report(
        self,
        action: str,
        records: Sequence[tuple[int, Any]],
        *,
        copied: int,
        pinned: int,
        released: bool,
        began: float,
        copy_seconds: float = 0.0,
    ) -> SleepReport:
        self.last = SleepReport(
            action=action,
            allocations=len(records),
            nbytes=sum(_size(d) for _, d in records),
            copied=copied,
            pinned=pinned,
            released=released,
            seconds=time.perf_counter() - began,
            copy_seconds=copy_seconds,
        )
        logger.debug("vLLM sleep pool: %s", self.last)
        return self.last

    def close(self) -> None:
        """Unpin and free the host memory; refused while kept bytes sleep in it.

        Raises:
            RuntimeError: some kept allocation still sleeps (its bytes are only there):
                wake it first.
        """
        kept = self.asleep()[1]
        if kept:
            said = ", ".join(f"{tag} {fmt_bytes(n)}" for tag, n in sorted(kept.items()))
            raise RuntimeError(
                f"the pool keeps {said} in host memory only: wake it (resume) before closing"
            )
        self._places.close()
