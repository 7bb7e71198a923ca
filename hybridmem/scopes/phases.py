"""phase(): one decorator or block per sharding-manager method, composed from a recipe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeAlias, cast

from hybridmem import _torch
from hybridmem._checks import check_bool, check_number, check_seconds, refuse_bare_decoration
from hybridmem._log import logger
from hybridmem._names import nearest, suggests_keywords
from hybridmem._scope import ScopedContext
from hybridmem.observe import timeline as _timeline
from hybridmem.scopes.allocator import ExpandableSegments
from hybridmem.scopes.communicators import SuspendCommunicators
from hybridmem.scopes.ipc_safe import IpcSafe
from hybridmem.scopes.profiles import (
    BackendProfile,
    Step,
    canonical_phase,
    check_step_args,
)
from hybridmem.scopes.registry import get_backend
from hybridmem.scopes.release import Garbage, check_release_args, release_cache

__all__ = [
    "Act",
    "Phase",
    "PhaseStep",
    "await_exit_waits",
    "await_free",
    "await_free_async",
    "check_wait",
    "enter_steps",
    "leave_steps",
    "phase",
    "run_step",
    "skipping_waits",
]

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
        >>> from hybridmem.scopes.phases import await_free
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
    """Apply overrides: False/None switches a step off, True keeps it, a mapping changes args.

    An opt-in step (``Step.opt_in``: ``suspend_communicators``) is left out unless an
    override names it: True or a mapping switches it on.
    """
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
            if not step.opt_in:
                steps.append(step)
            continue
        value = overrides[step.name]
        if value is False or value is None:
            continue
        if value is True:
            steps.append(step)
        elif isinstance(value, Mapping):
            check_step_args(f"{where}: override {step.name}", step.action, value)
            try:
                steps.append(replace(step, args={**step.args, **value}))
            except (TypeError, ValueError) as exc:  # the step's own check, with the phase
                raise type(exc)(f"{where}: {exc}") from None
        elif step.action in ("offload", "reload"):  # an Offloader, as a shorthand
            steps.append(replace(step, args={**step.args, "offloader": value}))
        else:
            raise TypeError(
                f"{where}: override {step.name}={value!r}: pass True, False or a dict of arguments"
            )
    return steps


class PhaseStep:
    """One step of a phase, built and checked once: a scope to enter, or an action to run.

    Each argument is checked by its primitive's own checker (``ExpandableSegments`` and
    ``IpcSafe`` by their constructors, ``release_cache``'s and ``await_free``'s by
    theirs), so a phase accepts exactly what the primitive accepts.

    Attributes:
        step: the recipe's :class:`~hybridmem.scopes.profiles.Step`.
        scope: the scope a ``"scope"`` step enters (None for an action).
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
                elif step.action == "suspend_communicators":
                    enabled = check_bool(f"{step.name}.enabled", args.get("enabled", True))
                    scope = SuspendCommunicators(
                        args.get("groups"),
                        timeout_s=args.get("timeout_s", 600.0),
                        label=where,
                    )
                    self.scope = scope if enabled else None
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
        except (TypeError, ValueError) as exc:  # say which phase and step, keep the type
            # "phase('sleep', backend='vllm'): release_cache.collect_garbage must be ..."
            raise type(exc)(f"{where}: {step.name}.{exc}") from None

    def run(self, collect_garbage: Garbage | None = None, enough_free: int | None = None) -> None:
        """Run the action as the recipe says, or with these per-use changes.

        Args:
            collect_garbage: what a ``release_cache`` step collects, instead of the
                recipe's (None: the recipe's).
            enough_free: free bytes that end an ``await_free`` step at once.
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
            elif "by" in args:  # "kernel" right after an engine's sleep
                offloader.reload(args.get("groups"), by=args["by"])
            else:
                offloader.reload(args.get("groups"))


# The phases a sharding manager's `with` block is (decorating its __enter__ spans it).
_BLOCK_PHASES = ("train", "rollout")

#: How a use of a phase runs one of its actions (the step, then what it does).
Act: TypeAlias = Callable[[PhaseStep], None]


def run_step(step: PhaseStep) -> None:
    """Run ``step`` as its recipe says: what a plain ``with phase(...)`` does."""
    step.run()


def enter_steps(steps: Sequence[PhaseStep], act: Act = run_step) -> list[ScopedContext]:
    """Enter a phase's steps in recipe order: ``"enter"`` actions by ``act``, scopes entered.

    Returns:
        The scopes entered, for :func:`leave_steps`. If a step fails, the scopes
        entered before it are left (told of the error) and the error is raised.
    """
    entered: list[ScopedContext] = []
    try:
        for step in steps:
            if step.step.when == "enter":
                act(step)
            elif step.scope is not None:
                step.scope.__enter__()
                entered.append(step.scope)
    except BaseException as exc:
        for scope in reversed(entered):
            scope.__exit__(type(exc), exc, exc.__traceback__)
        raise
    return entered


def leave_steps(
    steps: Sequence[PhaseStep],
    entered: Sequence[ScopedContext],
    exc: BaseException | None,
    where: str,
    act: Act = run_step,
) -> BaseException | None:
    """Leave a phase: ``"exit"`` actions by ``act`` in reverse order, then its scopes.

    The scopes are left whatever the actions raise. With no exception in flight, the
    first failed action is raised once the scopes are left; with one, each failure is
    logged (never raised over it).

    Returns:
        What failed (the exception in flight, else None): for the timeline.
    """
    errors: list[BaseException] = []
    for step in reversed(steps):
        if step.step.when != "exit":
            continue
        try:
            act(step)
        except Exception as error:  # keep going: the scopes must still be restored
            errors.append(error)
    for scope in reversed(entered):
        scope.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
    if errors and exc is None:
        raise errors[0]
    for failure in errors:  # an exception is already in flight: say what else failed
        logger.warning("%s: an exit step failed too: %r", where, failure)
    return exc


async def await_exit_waits(steps: Sequence[PhaseStep], enough_free: int | None = None) -> None:
    """The ``await_free`` exit steps, polled with ``asyncio.sleep`` (never blocking the loop)."""
    for step in reversed(steps):
        if step.step.when == "exit" and step.step.action == "await_free":
            await await_free_async(step.args.get("device"), step.timeout_s, enough_free)


def skipping_waits(act: Act) -> Act:
    """``act``, but ``await_free`` steps do nothing (an async exit awaited them first)."""

    def acting(step: PhaseStep) -> None:
        if step.step.action != "await_free":
            act(step)

    return acting


class Phase(ScopedContext):
    """A phase of a hybrid engine, composed from its backend's recipe (see :func:`phase`).

    Built once: the name canonicalised, the recipe looked up, every step's arguments
    checked and its scope made. Entering it again (it is re-entrant, as every scope
    is) re-runs the steps, not the checks.

    Attributes:
        name: the canonical phase name.
        profile: the backend's :class:`~hybridmem.scopes.profiles.BackendProfile`.
        steps: the recipe's steps after the overrides.
        prepared: each step built and checked (:class:`PhaseStep`), in recipe order:
            what :func:`enter_steps` and :func:`leave_steps` run, for a runner of
            one's own (:class:`~hybridmem.HybridSwitch` has one).
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
        self.prepared = tuple(PhaseStep(step, where) for step in self.steps)
        self._label = where

    def __repr__(self) -> str:
        return self._label

    def _spans_with_block(self) -> bool:
        # train and rollout are what a manager's `with` block is; wake_up, weight_sync
        # and sleep are the work its __enter__ and __exit__ do.
        return self.name in _BLOCK_PHASES

    def begin(self, act: Act = run_step) -> tuple[list[ScopedContext], Any]:
        """Enter the steps (``"enter"`` actions by ``act``) and open the phase's timeline span.

        Returns:
            What :meth:`end` takes: the scopes entered and the span.
        """
        entered = enter_steps(self.prepared, act)
        logger.debug("%s entered (%d steps)", self._label, len(self.steps))
        return entered, _timeline.begin(f"phase:{self.name}", "phase", backend=self.profile.name)

    def end(
        self,
        begun: tuple[list[ScopedContext], Any],
        exc: BaseException | None,
        act: Act = run_step,
    ) -> None:
        """Leave what :meth:`begin` entered (``"exit"`` actions by ``act``); close the span."""
        entered, span = begun
        failed: BaseException | None = exc
        try:
            leave_steps(self.prepared, entered, exc, self._label, act)
        except Exception as error:
            failed = error
            raise
        finally:
            if failed is not None:
                _timeline.end(span, error=repr(failed))
            else:
                _timeline.end(span)

    def _enter(self) -> object:
        return self.begin()

    def _exit(self, token: object, exc: BaseException | None) -> None:
        self.end(cast(tuple[list[ScopedContext], Any], token), exc)

    async def _aexit(self, token: object, exc: BaseException | None) -> None:
        await await_exit_waits(self.prepared)
        self.end(cast(tuple[list[ScopedContext], Any], token), exc, skipping_waits(run_step))


@suggests_keywords
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
