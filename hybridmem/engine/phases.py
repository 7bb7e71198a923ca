"""phase(): one decorator or block per sharding-manager method, composed from a recipe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any, NamedTuple, cast

from hybridmem import _torch
from hybridmem._checks import check_bool, check_number, check_seconds, refuse_bare_decoration
from hybridmem._log import logger
from hybridmem._scope import ScopedContext
from hybridmem.allocator import ExpandableSegments
from hybridmem.engine.backends.registry import (
    BackendProfile,
    Step,
    canonical_phase,
    check_step_args,
    get_backend,
    nearest,
)
from hybridmem.ipc.shareable import IpcSafe
from hybridmem.memory.offload_parts import check_reload_way
from hybridmem.memory.release import check_release_args, release_cache
from hybridmem.observe import timeline as _timeline

__all__ = ["Phase", "PhaseUse", "await_free", "await_free_async", "check_wait", "phase"]

POLL_S = 0.01  # how often free memory is read while waiting for it


_TOLERANCE = 2 << 20


def _settled(free: list[int], tolerance: int) -> bool:
    return len(free) >= 3 and max(free[-3:]) - min(free[-3:]) <= tolerance


def _polls(
    index: int, timeout_s: float, tolerance: int, free: list[int], enough: int | None = None
) -> Iterator[None]:
    """Read free memory into ``free`` until it settles, reaches ``enough`` or time is up.

    The caller sleeps at each yield (``time.sleep`` or ``asyncio.sleep``).
    """
    started = time.perf_counter()
    free.append(_torch.mem_get_info(index)[0])
    while (
        not _settled(free, tolerance)
        and (enough is None or free[-1] < enough)
        and time.perf_counter() - started < timeout_s
    ):
        yield
        free.append(_torch.mem_get_info(index)[0])


def await_free(
    device: int | None = None,
    *,
    timeout_s: float = 5.0,
    tolerance: int = _TOLERANCE,
    enough: int | None = None,
) -> tuple[int, float]:
    """Wait until device free memory stops rising (another process finishing a release).

    Polls ``cudaMemGetInfo`` every 10 ms until three readings agree within
    ``tolerance`` bytes, or ``timeout_s`` passes; a reading of at least ``enough``
    free bytes ends the wait at once (the release is known to be done by then:
    :class:`~hybridmem.HybridSwitch` passes what the engine's last sleep gave back,
    so that a wait after a sleep that has already returned its memory costs one
    reading, not three readings 20 ms apart). Does nothing (returns ``(0, 0.0)``)
    when CUDA is not initialised.

    Args:
        device: the device index (None: the current device).
        timeout_s: the longest wait, seconds (>= 0); past it, the last reading.
        tolerance: how far apart three readings may be and still agree, bytes.
        enough: free bytes that end the wait at once (None: only settling does).

    Returns:
        ``(free bytes, seconds waited)``.

    Scope: reads device-wide free memory (other processes count); thread-safe.

    Example:
        >>> from hybridmem.engine.phases import await_free
        >>> free, seconds = await_free(0, timeout_s=30)  # doctest: +SKIP
    """
    check_wait(timeout_s, enough)
    index = device if device is not None else _torch.current_device()
    if index is None:
        return 0, 0.0
    started = time.perf_counter()
    free: list[int] = []
    for _ in _polls(index, timeout_s, tolerance, free, enough):
        time.sleep(POLL_S)
    return free[-1], time.perf_counter() - started


async def await_free_async(device: int | None, timeout_s: float, enough: int | None = None) -> None:
    """:func:`await_free` for async code: polls with ``asyncio.sleep``, never blocking."""
    check_wait(timeout_s, enough)
    index = device if device is not None else _torch.current_device()
    if index is None:
        return
    for _ in _polls(index, timeout_s, _TOLERANCE, [], enough):
        await asyncio.sleep(POLL_S)


def check_wait(timeout_s: object, enough: object = None) -> None:
    """Refuse what :func:`await_free` refuses (its own checker: a phase's step uses it too)."""
    check_seconds("timeout_s", timeout_s, zero=True)
    if enough is not None:
        check_number("enough", enough, minimum=0, integer=True)


def _resolve(recipe: tuple[Step, ...], overrides: Mapping[str, object], where: str) -> list[Step]:
    """Apply overrides: False/None switches a step off, True keeps it, a mapping changes args."""
    names = [s.name for s in recipe]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(
            f"{where}: unknown override(s) {', '.join(map(repr, unknown))}"
            f"{nearest(unknown[0], names)}; this recipe's steps are "
            f"{', '.join(map(repr, names)) or 'none'} (pass False to switch one off, or a "
            "dict of its arguments)"
        )
    steps: list[Step] = []
    for step in recipe:
        if step.name not in overrides:
            steps.append(step)
            continue
        value = overrides[step.name]
        if value is False or value is None:
            continue
        if value is True:
            steps.append(step)
        elif isinstance(value, Mapping):
            check_step_args(f"{where}: override {step.name}", step.action, value)
            steps.append(replace(step, args={**step.args, **value}))
        elif step.action in ("offload", "reload"):  # an Offloader, as a shorthand
            steps.append(replace(step, args={**step.args, "offloader": value}))
        else:
            raise TypeError(
                f"{where}: override {step.name}={value!r}: pass True, False or a dict of arguments"
            )
    return steps


class _Prepared:
    """One step of a phase, built and checked once: a scope to enter, or an action to run.

    Each argument is checked by its primitive's own checker (``ExpandableSegments`` and
    ``IpcSafe`` by their constructors, ``release_cache``'s and ``await_free``'s by
    theirs), so a phase accepts exactly what the primitive accepts (issue #27).
    """

    def __init__(self, step: Step, where: str) -> None:
        self.step = step
        args = dict(step.args)
        self.args = args
        self.timeout_s = args.get("timeout_s", 5.0)  # an await_free step's bound
        self.scope: ScopedContext | None = None
        try:
            if step.when == "scope":
                if step.action == "expandable_segments":
                    self.scope = ExpandableSegments(
                        args.get("enabled", False),
                        release_cache=args.get("release_cache", True),
                        force=args.get("force", False),
                    )
                else:
                    self.scope = IpcSafe(fallback=args.get("fallback", "auto"))
            elif step.action == "release_cache":
                check_release_args(
                    args.get("sync", True),
                    args.get("collect_garbage", True),
                    args.get("ipc_collect", True),
                )
            elif step.action == "await_free":
                check_wait(self.timeout_s)
            elif step.action == "reload" and "by" in args:
                check_reload_way(args["by"], 0)
        except (TypeError, ValueError) as exc:  # say which phase and step, keep the type
            # "phase('sleep', backend='vllm'): release_cache.collect_garbage must be ..."
            raise type(exc)(f"{where}: {step.name}.{exc}") from None

    def run(self, collect_garbage: bool | None, enough_free: int | None = None) -> None:
        """Run the action (``collect_garbage``, if given, overrides a release's own).

        ``enough_free``: free bytes that end an ``await_free`` step at once.
        """
        args, action = self.args, self.step.action
        if action == "release_cache":
            release_cache(
                args.get("device"),
                sync=args.get("sync", True),
                collect_garbage=args.get("collect_garbage", True)
                if collect_garbage is None
                else collect_garbage,
                ipc_collect=args.get("ipc_collect", True),
            )
        elif action == "await_free":
            await_free(args.get("device"), timeout_s=self.timeout_s, enough=enough_free)
        else:
            offloader = args.get("offloader")
            if offloader is None:
                logger.debug("phase step %s skipped: no offloader given", self.step.name)
            elif action == "offload":
                offloader.offload(args.get("groups"))
            elif "by" in args:  # "kernel" after an engine's sleep (decision 80)
                offloader.reload(args.get("groups"), by=args["by"])
            else:
                offloader.reload(args.get("groups"))


# The phases a sharding manager's `with` block is (decorating its __enter__ spans it).
_BLOCK_PHASES = ("train", "rollout")


class _Entered(NamedTuple):
    """What entering a phase leaves for its exit: the scopes entered and the per-use options."""

    scopes: list[ScopedContext]
    span: Any
    collect_garbage: bool | None
    enough_free: int | None


class Phase(ScopedContext):
    """A phase of a hybrid engine, composed from its backend's recipe (see :func:`phase`).

    Built once: the name canonicalised, the recipe looked up, every step's arguments
    checked and its scope made. Entering it again (it is re-entrant, as every scope
    is) re-runs the steps, not the checks; :meth:`entering` passes per-use options.
    """

    def __init__(
        self, name: str, backend: str | BackendProfile | None, overrides: Mapping[str, object]
    ) -> None:
        super().__init__()
        self.name = canonical_phase(name)
        self.profile = backend if isinstance(backend, BackendProfile) else get_backend(backend)
        where = f"phase({self.name!r}, backend={self.profile.name!r})"
        # Registration keyed the recipes by canonical name: no second canonicalisation.
        recipe = self.profile.recipes.get(self.name, ())
        self.steps = tuple(_resolve(recipe, overrides, where))
        self._prepared = tuple(_Prepared(step, where) for step in self.steps)
        self._label = where

    def __repr__(self) -> str:
        return self._label

    def _spans_with_block(self) -> bool:
        # train and rollout are what a manager's `with` block is; wake_up, weight_sync
        # and sleep are the work its __enter__ and __exit__ do.
        return self.name in _BLOCK_PHASES

    def entering(
        self,
        *,
        collect_garbage: bool | None = None,
        enough_free: int | None = None,
        enter_releases: bool = True,
        exit_releases: bool = True,
    ) -> PhaseUse:
        """This phase with per-use options, for one ``with`` (nothing is rebuilt).

        Args:
            collect_garbage: False: the recipe's cache releases skip Python's garbage
                collector this time (a :class:`~hybridmem.HybridSwitch` whose garbage
                policy says so); None: as the recipe says.
            enough_free: device free bytes that end the recipe's ``await_free`` steps
                at once (what the engine's release is known to reach: a
                :class:`~hybridmem.HybridSwitch` passes what its last sleep gave
                back); None: they wait for free memory to settle.
            enter_releases: False: the recipe's cache releases on entry are skipped
                this time (a :class:`~hybridmem.HybridSwitch` whose offload is still
                copying: a release synchronizes the device, so it would wait for the
                copies; the switch releases once they have landed).
            exit_releases: False: the recipe's cache releases on exit are skipped
                this time, for the same reason (decision 89). The returned use's
                ``exit_releases`` attribute may still be set until it is left.

        Example:
            >>> with hm.phase("sleep").entering(collect_garbage=False):  # doctest: +SKIP
            ...     engine.sleep()
        """
        if collect_garbage is not None:
            check_bool("collect_garbage", collect_garbage)
        if enough_free is not None:
            check_number("enough_free", enough_free, minimum=0, integer=True)
        check_bool("enter_releases", enter_releases)
        check_bool("exit_releases", exit_releases)
        return PhaseUse(self, collect_garbage, enough_free, enter_releases, exit_releases)

    def _enter(self) -> object:
        return self._open(None, None)

    def _open(
        self, collect_garbage: bool | None, enough_free: int | None, releases: bool = True
    ) -> object:
        entered: list[ScopedContext] = []
        try:
            for prepared in self._prepared:
                if prepared.step.when == "enter":
                    if releases or prepared.step.action != "release_cache":
                        prepared.run(collect_garbage)
                elif prepared.scope is not None:
                    prepared.scope.__enter__()
                    entered.append(prepared.scope)
        except BaseException as exc:
            for scope in reversed(entered):
                scope.__exit__(type(exc), exc, exc.__traceback__)
            raise
        logger.debug("%s entered (%d steps)", self._label, len(self.steps))
        span = _timeline.begin(f"phase:{self.name}", "phase", backend=self.profile.name)
        return _Entered(entered, span, collect_garbage, enough_free)

    def _exit(self, token: object, exc: BaseException | None, releases: bool = True) -> None:
        self._leave(token, exc, skip_waits=False, releases=releases)

    def _leave(
        self, token: object, exc: BaseException | None, *, skip_waits: bool, releases: bool = True
    ) -> None:
        entered, span, collect_garbage, enough_free = cast(_Entered, token)
        errors: list[BaseException] = []
        # Exit actions run first (in reverse recipe order), inside the phase's scopes.
        for prepared in reversed(self._prepared):
            step = prepared.step
            if step.when != "exit" or (skip_waits and step.action == "await_free"):
                continue
            if not releases and step.action == "release_cache":
                continue
            try:
                prepared.run(collect_garbage, enough_free)
            except Exception as error:  # keep going: the scopes must still be restored
                errors.append(error)
        for scope in reversed(entered):
            scope.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        failed = exc if exc is not None else (errors[0] if errors else None)
        if failed is not None:
            _timeline.end(span, error=repr(failed))
        else:
            _timeline.end(span)
        if errors and exc is None:
            raise errors[0]
        for failure in errors:  # an exception is already in flight: say what else failed
            logger.warning("%s: an exit step failed too: %r", self._label, failure)

    async def _aexit(self, token: object, exc: BaseException | None, releases: bool = True) -> None:
        enough_free = cast(_Entered, token).enough_free
        for prepared in reversed(self._prepared):  # the waits first, polling without blocking
            if prepared.step.when == "exit" and prepared.step.action == "await_free":
                await await_free_async(prepared.args.get("device"), prepared.timeout_s, enough_free)
        self._leave(token, exc, skip_waits=True, releases=releases)


class PhaseUse(ScopedContext):
    """One use of a built :class:`Phase` with per-use options (see :meth:`Phase.entering`)."""

    def __init__(
        self,
        phase: Phase,
        collect_garbage: bool | None,
        enough_free: int | None,
        enter_releases: bool = True,
        exit_releases: bool = True,
    ) -> None:
        super().__init__()
        self.phase = phase
        self.collect_garbage = collect_garbage
        self.enough_free = enough_free
        self.enter_releases = enter_releases
        #: read when the use is left: a switch decides after entering (decision 89)
        self.exit_releases = exit_releases

    def __repr__(self) -> str:
        skipped = "" if self.enter_releases else ", enter_releases=False"
        skipped += "" if self.exit_releases else ", exit_releases=False"
        return (
            f"{self.phase!r}.entering(collect_garbage={self.collect_garbage!r}, "
            f"enough_free={self.enough_free!r}{skipped})"
        )

    def _spans_with_block(self) -> bool:
        return self.phase._spans_with_block()

    def _enter(self) -> object:
        return self.phase._open(self.collect_garbage, self.enough_free, self.enter_releases)

    def _exit(self, token: object, exc: BaseException | None) -> None:
        self.phase._exit(token, exc, self.exit_releases)

    async def _aexit(self, token: object, exc: BaseException | None) -> None:
        await self.phase._aexit(token, exc, self.exit_releases)


def phase(name: str, backend: str | BackendProfile | None = None, **overrides: object) -> Phase:
    """Run a phase's recipe (from the backend's profile) around a block, call or class.

    Steps run in recipe order on entry (``"enter"`` actions run, ``"scope"`` steps are
    entered) and in reverse on exit (``"exit"`` actions run inside the scopes, then the
    scopes are left), on any exception too. Every form of the base works: function,
    ``async def`` (the context spans the awaited body), generator, async generator,
    context-manager class (spans each ``with manager:`` block), ``with``/``async with``.

    Args:
        name: ``"train"``, ``"wake_up"``, ``"weight_sync"``, ``"rollout"``, ``"sleep"`` or
            an alias (``"generate"``, ``"update_weights"``, ...).
        backend: a registered backend name (``"vllm"``, ``"sglang"``, ``"default"``), a
            :class:`BackendProfile`, or None for ``HYBRIDMEM_BACKEND`` / ``"default"``.
        **overrides: per step name: ``False`` switches it off, ``True`` keeps it, a dict
            changes its arguments (``phase("sleep", backend="vllm", release_cache=False)``).

    Returns:
        A :class:`Phase` (context manager and decorator).

    Raises:
        ValueError: unknown phase, backend or override name (the message lists the
            known ones).
        TypeError: an override value that is not True, False or a dict.

    Scope: the allocator scopes it enters are process-global; releases act on the
    current device. Thread-safe like the primitives it composes.

    Example:
        >>> @hm.phase("rollout", backend="vllm")      # doctest: +SKIP
        ... class VLLMShardingManager:
        ...     def __enter__(self): ...
        ...     def __exit__(self, *exc): ...
    """
    refuse_bare_decoration("phase", name, '@hm.phase("rollout", backend="vllm"), the phase by name')
    return Phase(name, backend, overrides)
