"""Move trainer state to pinned host memory and back, in place, at copy-engine speed.

Before rollout the trainer moves parameters, gradients and optimizer state off the
GPU, after it brings them back. ``.to("cpu")`` runs at pageable speed (H200: 13 GB/s
D2H, 7 GB/s H2D, ~1 GB/s on fresh host memory, against 55 GB/s pinned); pinning anew
every step costs more, and ``.cpu().pin_memory()`` doubles host peak memory.

:class:`Offloader` instead:

- keeps **one persistent pinned pool** (:mod:`hybridmem.memory.host_pool`), sized
  exactly, allocated on the first offload and reused every cycle; a larger offload
  (planned by need) grows it by a chunk of the difference, pinning only that;
- frees and restores **device storage in place** (``storage.resize_``): every
  ``Parameter`` and tensor keeps its identity, shape and views, so optimizers,
  hooks and FSDP2/DTensor local shards keep working;
- copies on a **side stream** (the driver's, not torch's pool) after the work that
  made the data: the host never reads a copy in flight, the device never uses a
  tensor before its reload (a non-blocking one orders the current stream after it).

Scope: one CUDA device per Offloader (its tensors', not device 0); not thread-safe.

Why this module is long: one transaction (free all storages or none, reload in
place) whose failure paths each undo the steps before; pool and slots live apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Literal, TypeAlias

import torch

from hybridmem import _torch
from hybridmem._checks import check_bool, check_number
from hybridmem._devices import DeviceArg, device_index
from hybridmem._env import disabled
from hybridmem._errors import OffloadError
from hybridmem._format import fmt_bytes
from hybridmem._log import info_once, logger
from hybridmem._names import suggests_keywords
from hybridmem.memory.host_pool import HostPool
from hybridmem.memory.need_plan import choose, need_rank
from hybridmem.memory.offload_free import (
    Landing,
    OffloadInFlight,
    free_as_landed,
    free_slots,
)
from hybridmem.memory.offload_report import CopyClock, OffloadReport
from hybridmem.memory.offload_walk import stream_to_host
from hybridmem.memory.reload_feed import FEED_CHUNK_BYTES, ReloadFeed
from hybridmem.memory.reload_plan import (
    RELOAD_WAYS,
    check_reload_way,
    first_slots,
    kernel_split,
    reload_need,
)
from hybridmem.memory.slots import (
    Slot,
    allocate,
    check_freeable,
    check_refillable,
    collect_slots,
    groups_of,
    unallocate,
)
from hybridmem.memory.targets import (
    GROUPS,
    Group,
    StorageEntry,
    Target,
    device_storages,
    drop_grads,
    flatten,
    select_groups,
)
from hybridmem.observe import timeline as _timeline

__all__ = ["GROUPS", "RELOAD_WAYS", "OffloadInFlight", "OffloadReport", "Offloader"]

_ALIGN = 512  # bytes; each storage starts on this boundary in the pinned pool

#: One walk of the targets: a slot per storage, and the device they are on.
Walk: TypeAlias = tuple[list[Slot], torch.device | None]


def _place_bytes(nbytes: int) -> int:
    """The pool bytes a storage of ``nbytes`` takes (its place, to the next boundary)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _places_end(slots: list[Slot]) -> int:
    """Where the last of ``slots``' places in the pool ends (0: none)."""
    return max((slot.offset + _place_bytes(slot.nbytes) for slot in slots), default=0)


@suggests_keywords
class Offloader:
    """Offload trainer state to a persistent pinned host pool and reload it in place.

    Args:
        *targets: ``nn.Module`` (parameters, buffers, gradients),
            ``torch.optim.Optimizer`` (state tensors), tensors, or dicts/lists of
            them. Only tensors on a CUDA device move; CPU tensors (Adam's ``step``)
            are left alone. Sharded parameters (DTensor) move their local shard.
        pin_memory: use a pinned pool (True) or a pageable one (False: slower,
            for hosts that cannot pin that much).
        grads: ``"keep"`` offloads gradients with the rest; ``"drop"`` frees
            them (``param.grad = None``) without copying.
        max_host_bytes: fail with ``ValueError`` *before* pinning if the pool
            would exceed this many bytes.
        device: the CUDA device the state is on; by default the one device all
            target tensors are on.

    Raises:
        TypeError: a target is not a module, optimizer, tensor or container of them.
        ValueError: no targets, or a bad ``grads`` / ``max_host_bytes``.

    Example:
        >>> off = hm.Offloader(model, optimizer)           # doctest: +SKIP
        >>> # before rollout
        >>> off.offload()  # doctest: +SKIP
        >>> # when each is needed
        >>> off.reload("parameters"); off.reload("optimizer")  # doctest: +SKIP

    Scope: the device of the targets; not thread-safe. Touching an offloaded tensor
    before reloading it is an error torch does not catch (its storage is empty:
    expect a crash or an illegal-address error), as with FSDP2's resharded
    parameters: scope the offload with :func:`offloaded` where you can.
    """

    def __init__(
        self,
        *targets: Target,
        pin_memory: bool = True,
        grads: Literal["keep", "drop"] = "keep",
        max_host_bytes: int | None = None,
        device: DeviceArg = None,
    ) -> None:
        if not targets:
            raise ValueError("Offloader needs at least one target (a module, optimizer or tensor)")
        # Containers are walked again at every offload, so entries replaced in a
        # dict or list are followed; walking them now validates the types.
        self._targets = targets
        for index, target in enumerate(targets):
            list(flatten(target, f"targets[{index}]"))
        check_bool("pin_memory", pin_memory)
        if grads not in ("keep", "drop"):
            raise ValueError(f"grads must be 'keep' or 'drop', got {grads!r}")
        if max_host_bytes is not None:
            check_number(
                "max_host_bytes",
                max_host_bytes,
                integer=True,
                above=0,
                wrong_type=ValueError,
                expected="a positive int or None",
            )
        self.pin_memory = pin_memory
        self.grads = grads
        self.max_host_bytes = max_host_bytes
        self._device = self._parse_device(device)
        self._slots: list[Slot] = []
        # resident(keep_walk=True)'s walk, for the next offload to take (None: walk)
        self._kept_walk: Walk | None = None
        self._host = HostPool(pin_memory)
        self._stream: Any = None
        self._stream_device: torch.device | None = None
        # start_offload's or start_reload's, until it ends
        self._in_flight: OffloadInFlight | ReloadFeed | None = None

    @staticmethod
    def _parse_device(device: DeviceArg) -> torch.device | None:
        # None: the targets' device, found when they are walked (not the current one).
        if device is None:
            return None
        return torch.device("cuda", device_index(device, current=False))

    # ------------------------------------------------------------------ #
    # Introspection
    # ------------------------------------------------------------------ #
    @property
    def host_bytes(self) -> int:
        """Bytes of the host pool (pinned unless ``pin_memory=False``); 0 before any offload."""
        return self._host.nbytes

    @property
    def offloaded_groups(self) -> frozenset[str]:
        """The groups with device storage freed now (in part, after a double fault)."""
        return frozenset(slot.group for slot in self._slots if slot.offloaded)

    def reload_bytes(self, groups: str | Iterable[str] | None = None) -> int:
        """Device memory a reload of the offloaded ``groups`` needs, about (bytes).

        The bytes offloaded, with each storage rounded as the caching allocator
        rounds it (512 B for small ones, 2 MiB blocks for large ones), plus one
        20 MiB block: what must be free before :meth:`reload` can fit. 0 when
        nothing is offloaded. Storages a reload feed has allocated are not counted.
        """
        wanted = select_groups(groups)
        return reload_need([s for s in self._slots if s.group in wanted and s.offloaded])

    @property
    def device(self) -> torch.device | None:
        """The CUDA device the state lives on (None until known)."""
        return self._device

    def __repr__(self) -> str:
        return (
            f"Offloader({len(self._targets)} targets, pool {fmt_bytes(self.host_bytes)}, "
            f"offloaded={sorted(self.offloaded_groups)})"
        )

    # ------------------------------------------------------------------ #
    # Collection and planning
    # ------------------------------------------------------------------ #
    def _storages(self) -> Iterator[StorageEntry]:
        """Each distinct device storage of the targets (:func:`~.targets.device_storages`)."""
        return device_storages(self._targets, gradients=self.grads == "keep")

    def _collect(self, kept: Walk | None = None) -> list[Slot]:
        """A fresh slot per storage of the targets, or ``kept``'s where its sizes still hold.

        ``kept``: a walk :meth:`resident` kept for this offload; a storage resized
        since makes it stale, and the targets are walked again.
        """
        if kept is not None and all(s.storage.nbytes() == s.nbytes for s in kept[0]):
            slots, self._device = kept
        else:
            slots, self._device = collect_slots(self._storages(), self._device)
        return slots

    def _plan(self, *, whole: bool = True, kept: Walk | None = None) -> None:
        """Collect the storages and give each a place in the pool (nothing offloaded).

        Places go in :data:`~hybridmem.memory.need_plan.NEED_ORDER`, cheapest to move
        first, so an offload planned by need fills a prefix of the pool and the pool
        need only be that long (``whole=False``: sized by the caller,
        :meth:`_size_pool`); ``whole``: as long as every storage needs.
        """
        slots = self._collect(kept)
        layout = [(s.key, s.nbytes, s.group) for s in slots]
        if layout != [(s.key, s.nbytes, s.group) for s in self._slots]:
            offset = 0
            for slot in sorted(slots, key=lambda s: need_rank(s.group)):  # stable
                slot.offset = offset
                offset += _place_bytes(slot.nbytes)
            if whole:  # may refuse (max_host_bytes): keep the old plan then
                self._host.check(offset, self.max_host_bytes)
            # Nothing is offloaded: the pool is kept only where no new place can
            # straddle two of its chunks (one chunk holding every place).
            if len(self._host.chunks) > 1 or self._host.nbytes < offset:
                self._host.close()
            if whole:
                self._host.grow(offset, self.max_host_bytes)
            if self._slots:
                logger.info(
                    "Offloader: targets changed since the last offload; re-planned the pool"
                )
            self._slots = slots
        elif whole:  # same storages, same sizes: the offsets fit; the pool may be short
            self._size_pool(self._slots)

    def _size_pool(self, slots: list[Slot]) -> None:
        """Make the pool reach the end of ``slots``' places (kept: what it holds)."""
        self._host.grow(_places_end(slots), self.max_host_bytes)

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None or self._stream_device != device:
            _torch.release_stream(self._stream)
            self._stream = _torch.new_stream(device)
            self._stream_device = device
        return self._stream

    # ------------------------------------------------------------------ #
    # Offload / reload
    # ------------------------------------------------------------------ #
    def resident(
        self, groups: str | Iterable[str] | None = None, *, keep_walk: bool = False
    ) -> list[tuple[str, int]]:
        """Each device storage of ``groups`` still on the device, as ``(group, bytes)``.

        In the targets' order, each storage once (what an offload would move): the
        input of :func:`~hybridmem.memory.need_plan.plan_by_need`. Walks the targets;
        moves nothing.

        Args:
            groups: None for all, or some of the groups.
            keep_walk: the next :meth:`offload` / :meth:`start_offload` with
                ``max_bytes`` takes this walk instead of walking the targets again (a
                planned switch plans, then offloads: the walk's Python work grows with
                the tensor count, ~2.5 µs a storage on a 2-core CPU). Any other call of
                this Offloader drops it; a storage resized meanwhile makes the offload
                walk again. Add no tensor to the targets in between: it would not be seen.

        Example:
            >>> off.resident()                         # doctest: +SKIP
            [('parameters', 4194304), ('optimizer', 8388608), ...]
        """
        self._check_idle("resident")
        check_bool("keep_walk", keep_walk)
        wanted = select_groups(groups)
        slots, device = collect_slots(self._storages(), self._device)
        self._kept_walk = (slots, device) if keep_walk else None
        return [(s.group, s.nbytes) for s in slots if s.group in wanted and s.nbytes]

    @_timeline.traced("offload", lambda r: {"nbytes": r.nbytes, "gbps": r.gbps})
    def offload(
        self,
        groups: str | Iterable[str] | None = None,
        *,
        release_cache: bool = True,
        max_bytes: int | None = None,
    ) -> OffloadReport:
        """Copy the device state to the host pool and free its device storage.

        Blocks until the copies are done. Groups already offloaded are skipped, so a
        repeated call is harmless.

        Args:
            groups: ``None`` for all, or some of ``"parameters"``, ``"buffers"``,
                ``"gradients"``, ``"optimizer"``, ``"tensors"``.
            release_cache: return the freed memory to the driver
                (``torch.cuda.empty_cache()``), so another process can use it: every
                512 MiB of copies, as they land, while the later ones run (the
                release overlaps the copies, :mod:`~hybridmem.memory.offload_free`).
                False: free once every copy has landed; the caller releases.
            max_bytes: offload only enough storages to cover this many bytes, the
                cheapest to move first (:data:`~hybridmem.memory.need_plan.NEED_ORDER`:
                optimizer state, gradients, bare tensors, buffers, parameters), whole
                storages, so it may move up to one storage more; 0 moves nothing.
                None (default): every storage of ``groups``.

        Returns:
            An :class:`OffloadReport` (also logged at INFO).

        Raises:
            TypeError: a target tensor has no storage that can be freed in place.
            ValueError: a target's memory is not this process's to free (imported
                through CUDA IPC or DLPack); both are checked before anything is freed.
            OffloadError: freeing failed midway; what was freed was put back.
            RuntimeError: an offload is in flight (:meth:`start_offload`).
        """
        return self.start_offload(groups, release_cache=release_cache, max_bytes=max_bytes).finish()

    def start_offload(
        self,
        groups: str | Iterable[str] | None = None,
        *,
        release_cache: bool = True,
        max_bytes: int | None = None,
    ) -> OffloadInFlight:
        """Queue an offload's copies and return before any storage is freed.

        The targets stay on the device, intact and readable (not to be written: the
        copies read them), until :meth:`OffloadInFlight.finish` frees them as
        :meth:`offload` does, or :meth:`OffloadInFlight.cancel` drops the offload.
        Meanwhile the device runs other work beside the copies (the switch syncs the
        engine's weights there). ``offload()`` is ``start_offload().finish()``.

        Args:
            groups, release_cache, max_bytes: as for :meth:`offload`.

        Returns:
            The :class:`OffloadInFlight`; every other call of this Offloader is
            refused until it is finished or cancelled.

        Raises:
            TypeError, ValueError: as for :meth:`offload`, before anything is freed.
            RuntimeError: an offload is already in flight.

        Example:
            >>> flight = off.start_offload()           # doctest: +SKIP
            >>> push_weights(); flight.finish()        # doctest: +SKIP
        """
        kept = self._kept_walk  # resident(keep_walk=True)'s, made for this offload
        self._check_idle("start_offload")
        wanted = select_groups(groups)
        check_bool("release_cache", release_cache)
        if max_bytes is not None:
            check_number(
                "max_bytes", max_bytes, integer=True, minimum=0, expected="an int >= 0 or None"
            )
        start = time.perf_counter()
        if disabled() or max_bytes == 0:
            return OffloadInFlight.done(self._report("offload", [], start))
        dropped = drop_grads(self._targets) if self.grads == "drop" and "gradients" in wanted else 0
        landing = Landing() if release_cache else None  # freed and released as they land
        clock = CopyClock()  # the copies' own time: other work may run beside them
        # A partial offload chooses its storages first: the walk copies everything it finds.
        streamed = None if max_bytes is not None else self._stream_to_host(wanted, landing, clock)
        if streamed is not None:
            todo, side = streamed
        else:
            if not self.offloaded_groups:
                self._plan(whole=max_bytes is None, kept=kept)
            todo = [s for s in self._slots if s.group in wanted and not s.offloaded]
            if max_bytes is not None:
                todo = choose(todo, [s.nbytes for s in todo], [s.group for s in todo], max_bytes)
            # The pool as long as what is offloaded reaches (a part: a prefix of it).
            self._size_pool([s for s in self._slots if s.offloaded] + todo)
            if not todo:
                if not self._slots:
                    info_once(
                        "offload-nothing",
                        "Offloader: no target tensor is on a GPU; nothing to move",
                    )
                return OffloadInFlight.done(self._report("offload", [], start, dropped))
            for slot in todo:
                if slot.storage.nbytes() != slot.nbytes:
                    raise RuntimeError(
                        f"{slot.name} changed size ({slot.nbytes} -> {slot.storage.nbytes()} "
                        "bytes) while other groups were offloaded; reload everything before "
                        "changing targets"
                    )
            landing = Landing() if release_cache else None  # the walk's copies were dropped
            side, _ = self._copy(todo, to_host=True, landing=landing, clock=clock)
        try:
            clock.stop(side)
            check_freeable(todo)
        except BaseException:
            _torch.synchronize_stream(side)  # nothing is freed; the pool must not be
            raise

        def free() -> OffloadReport:
            if landing is None:  # the caller releases: free once every copy has landed
                _torch.synchronize_stream(side)  # no free before the copies land
                free_slots(todo, self._restore, self._unallocate)
            else:
                free_as_landed(todo, landing, side, self._restore, self._unallocate)
            return self._report("offload", todo, start, dropped, clock.seconds())

        self._in_flight = OffloadInFlight(free, partial(_torch.synchronize_stream, side))
        return self._in_flight

    def _check_idle(self, call: str) -> None:
        """Refuse ``call`` while a :meth:`start_offload` or :meth:`start_reload` is in flight.

        Every call passes here: a walk :meth:`resident` kept is dropped (its next call
        alone may take it).
        """
        self._kept_walk = None
        if self._in_flight is not None and self._in_flight.pending:
            started, ends = (
                ("a reload", "finish() or stop() on what start_reload()")
                if isinstance(self._in_flight, ReloadFeed)
                else ("an offload", "finish() or cancel() on what start_offload()")
            )
            raise RuntimeError(
                f"Offloader.{call}() while {started} is in flight: call {ends} returned first"
            )

    def _restore(self, slots: Sequence[Slot]) -> None:
        """Reallocate and refill freed storages from the pool (blocking)."""
        if slots:
            self._copy_back(slots, blocking=True)

    def _copy_back(
        self, slots: Sequence[Slot], *, blocking: bool, kernel_after: int | None = None
    ) -> None:
        """Reallocate the slots' storage and copy the pool into it; device use waits for it."""
        side, current = self._copy(slots, to_host=False, kernel_after=kernel_after)
        _torch.wait_stream(current, side)
        if blocking:
            _torch.synchronize_stream(side)
        for slot in slots:
            slot.refill = False

    @_timeline.traced("reload", lambda r: {"nbytes": r.nbytes, "gbps": r.gbps})
    def reload(
        self,
        groups: str | Iterable[str] | None = None,
        *,
        non_blocking: bool = False,
        by: Literal["copy_engine", "kernel"] = "copy_engine",
        copy_engine_first: int = 0,
        max_bytes: int | None = None,
    ) -> OffloadReport:
        """Reallocate the device storage and copy the state back, in place.

        Args:
            groups: ``None`` for every offloaded group, or some of them (e.g.
                ``"parameters"`` first, ``"optimizer"`` when the step needs it).
            non_blocking: return once the copies are queued; the current stream
                is ordered after them, so device work issued afterwards sees the
                data, without the host waiting.
            by: ``"copy_engine"`` (leaves the SMs to work beside it) or ``"kernel"``:
                kernels read the pool's device mapping at full speed where the copy
                engines run at half after another process's large free.
            copy_engine_first: with ``"kernel"``, storages in the first this many
                bytes go by copy engine (kernels hold up another process's unmapping).
            max_bytes: reload only the first storages (in the targets' order) within this many
                bytes, at least one; the rest stay offloaded for a later ``reload()``.

        Returns:
            An :class:`OffloadReport` (also logged at INFO).

        Raises:
            OffloadError: the device memory did not fit (the out-of-memory error is
                its cause) or a copy failed: nothing was reloaded, the data is
                intact in the host pool, and calling ``reload()`` again retries.
            RuntimeError: a storage was reallocated by someone else while offloaded
                (reloading would overwrite it), or an offload is in flight
                (:meth:`start_offload`).
        """
        self._check_idle("reload")
        check_bool("non_blocking", non_blocking)
        kernel_after = check_reload_way(by, copy_engine_first)
        start = time.perf_counter()
        todo = self._reload_todo(groups, max_bytes)
        if not todo:
            return self._report("reload", [], start)
        try:
            self._copy_back(todo, blocking=not non_blocking, kernel_after=kernel_after)
        except BaseException as exc:
            self._unallocate(todo)
            need = sum(s.nbytes for s in todo)
            raise OffloadError(
                f"reload of {', '.join(groups_of(todo))} failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}) with "
                f"{fmt_bytes(need)} to bring back to {self._device}: nothing was reloaded, the "
                "data is intact in the host pool and still offloaded; call reload() again "
                "once the device has room (the engine may not have let go yet)",
                offloaded=self.offloaded_groups,
            ) from exc
        for slot in todo:
            slot.offloaded = False
        return self._report("reload", todo, start)

    def _reload_todo(self, groups: str | Iterable[str] | None, max_bytes: object) -> list[Slot]:
        """The offloaded slots of ``groups`` a reload takes (``max_bytes``), checked."""
        wanted = select_groups(groups)
        todo = first_slots([s for s in self._slots if s.group in wanted and s.offloaded], max_bytes)
        check_refillable(todo)
        return todo

    def start_reload(
        self,
        groups: str | Iterable[str] | None = None,
        *,
        max_bytes: int | None = None,
        chunk_bytes: int = FEED_CHUNK_BYTES,
    ) -> ReloadFeed:
        """Reload by copy engine, a chunk at a time from a thread, until told to stop.

        Allocates every storage here (this thread's allocator mode) while the first
        copies run; a thread then keeps two chunks in flight.

        Args:
            groups, max_bytes: as for :meth:`reload`.
            chunk_bytes: bytes of copies between two of the feed's events.

        Returns:
            A :class:`~hybridmem.memory.reload_feed.ReloadFeed`: ``finish(by=)`` copies
            the rest and waits, ``stop()`` leaves it offloaded. Until one of them, the
            Offloader refuses every other call.

        Raises:
            OffloadError: an allocation or a copy failed: what was fed is reloaded, the
                rest intact in the host pool and still offloaded.

        Example:
            >>> feed = off.start_reload()             # doctest: +SKIP
            >>> engine.sleep(); feed.finish(by="kernel")  # doctest: +SKIP
        """
        self._check_idle("start_reload")
        start = time.perf_counter()
        todo = self._reload_todo(groups, max_bytes)
        if not todo or self._device is None:
            return ReloadFeed.done(self._report("reload", [], start))
        device = self._device
        feed = ReloadFeed(
            todo,
            _torch.new_stream(device),
            device,
            copy=partial(self._host.copy_one, device=device, to_host=False),
            rest=lambda slots, by: self._copy_back(
                slots, blocking=True, kernel_after=check_reload_way(by, 0)
            ),
            unallocate=self._unallocate,
            report=partial(self._report, "reload", start=start),
            chunk_bytes=chunk_bytes,
        )
        feed.start()
        self._in_flight = feed
        return feed

    def _unallocate(self, slots: Sequence[Slot]) -> None:
        """Free again the slots reallocated but not refilled (:func:`.slots.unallocate`)."""
        unallocate(slots, self._stream)

    def _stream_to_host(
        self, wanted: list[Group], landing: Landing | None, clock: CopyClock
    ) -> tuple[list[Slot], Any] | None:
        """Copy to the pool while walking the targets (:func:`.offload_walk.stream_to_host`).

        Returns:
            ``(slots copied, side stream)``, or None (not planned yet, something
            is offloaded, or the targets changed).
        """
        if (
            self._host.nbytes == 0
            or not self._slots
            or self.offloaded_groups
            or self._device is None
            or self._host.nbytes < _places_end(self._slots)  # sized for a part: plan again
        ):
            return None
        side = self._side_stream(self._device)
        todo = stream_to_host(
            self._slots,
            self._storages(),
            host=self._host,
            device=self._device,
            side=side,
            wanted=wanted,
            landing=landing,
            clock=clock,
        )
        return None if todo is None else (todo, side)

    def _copy(
        self,
        slots: Sequence[Slot],
        *,
        to_host: bool,
        kernel_after: int | None = None,
        landing: Landing | None = None,
        clock: CopyClock | None = None,
    ) -> tuple[Any, Any]:
        """Queue the copies between device storage and pool on the side stream.

        The side stream first waits for the work queued on the current stream, which
        produced the data (offload) or last used the memory (reload). A reload
        reallocates each slot on the current stream, where the tensors are used: just
        before its copy by copy engine, so the copies overlap the allocations (mapping
        16 GiB of expandable segments takes tens of ms), but all those going by kernel
        (from ``kernel_after`` bytes on; None: none) before any kernel is queued, since
        a mapping waited for the kernels in flight (measured on an H200: a queued reload
        of 1.6 GiB by kernel took as long to queue as to run).

        Returns:
            ``(side stream, current stream)``.
        """
        assert self._host.chunks, "planned before copying"
        assert self._device is not None, "planned before copying"
        side = self._side_stream(self._device)
        current = _torch.current_stream(self._device)
        _torch.wait_stream(side, current)
        if clock is not None:  # (again, after a walk's dropped copies)
            clock.start(side)
        split = kernel_split(slots, kernel_after)  # the slots from ``split`` on go by kernel
        if not to_host:  # mapping memory waits for kernels in flight: theirs first
            for slot in slots[split:]:
                allocate(slot)
        for index, slot in enumerate(slots):
            if not to_host and index < split:
                allocate(slot)
            with _torch.stream_scope(side):
                self._host.copy_one(slot, self._device, to_host=to_host, by_kernel=index >= split)
            if landing is not None:
                landing.copied(side, slot.nbytes)
        return side, current

    def _report(
        self,
        direction: Literal["offload", "reload"],
        slots: Sequence[Slot],
        start: float,
        dropped: int = 0,
        copy_seconds: float | None = None,
    ) -> OffloadReport:
        report = OffloadReport.of(
            direction, slots, start, self.host_bytes, self._device, dropped, copy_seconds
        )
        if slots or dropped:
            logger.info("%s", report)
        return report

    def close(self) -> None:
        """Unpin and free the host pool. Refused while anything is offloaded or in flight."""
        self._check_idle("close")
        if self.offloaded_groups:
            raise RuntimeError(
                f"cannot close: {sorted(self.offloaded_groups)} are offloaded; reload() them first"
            )
        self._host.close()
        _torch.release_stream(self._stream)  # kept for the next owner, never destroyed
        self._stream = None
