"""A sharding manager decorated the way verl's engineers write it (docs/phases.md's table).

The manager's ``__enter__`` wakes the engine and syncs the weights, its ``with`` block
generates, its ``__exit__`` puts the engine to sleep. Each of the card's three
primitives goes on ``__enter__``, on ``__exit__`` and on the class; the state each
moment sees is what the table in docs/phases.md says.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

import pytest

import hybridmem as hm
from hybridmem import HybridMemWarning
from hybridmem._scope import ScopedContext
from tests.conftest import FakeTorch, patch_seam

# --------------------------------------------------------------------------- #
# The moments a manager has, and what each sees
# --------------------------------------------------------------------------- #

MOMENTS = ("before", "sync", "generate", "sleep", "after")


class Seen:
    """What the manager saw at each moment: expandable segments, and releases so far."""

    def __init__(self, fake: FakeTorch) -> None:
        self.fake = fake
        self.expandable: dict[str, bool] = {}
        self.releases: dict[str, int] = {}

    def at(self, moment: str) -> None:
        self.expandable[moment] = hm.allocator_state().expandable_segments
        self.releases[moment] = self.fake.events.count("empty_cache")


Decorator = Callable[[Any], Any]

PRIMITIVES: dict[str, Callable[[], Decorator]] = {
    "expandable_segments(False)": lambda: hm.expandable_segments(False),
    "ipc_safe()": lambda: hm.ipc_safe(),
    "aggressive_cache_release()": lambda: hm.aggressive_cache_release(),
    "aggressive_cache_release(on='enter')": lambda: hm.aggressive_cache_release(on="enter"),
}

# Expandable segments at each moment (training keeps them on), by primitive kind and place.
OFF_WHEN = {
    "enter": {"sync", "generate", "sleep"},  # a state on __enter__ spans the with block
    "exit": {"sleep"},  # on __exit__: that call
    "class": {"sync", "generate", "sleep"},
}
# The moment by which the release has run, by place: (on="exit", on="enter").
RELEASED_BY = {
    "enter": ("generate", "sync"),  # an action on __enter__ stays on that call
    "exit": ("after", "sleep"),
    "class": ("after", "sync"),
}


def build_manager(decorator: Decorator, place: str, seen: Seen) -> type:
    """A verl-shaped manager with ``decorator`` on ``__enter__``, ``__exit__`` or the class."""

    class Manager:
        def __enter__(self) -> Manager:
            seen.at("sync")  # wake the engine's weights, sync them
            return self

        def __exit__(self, *exc: object) -> None:
            seen.at("sleep")  # put the engine to sleep

    if place == "enter":

        class OnEnter:
            @decorator
            def __enter__(self) -> OnEnter:
                seen.at("sync")
                return self

            def __exit__(self, *exc: object) -> None:
                seen.at("sleep")

        return OnEnter
    if place == "exit":

        class OnExit:
            def __enter__(self) -> OnExit:
                seen.at("sync")
                return self

            @decorator
            def __exit__(self, *exc: object) -> None:
                seen.at("sleep")

        return OnExit
    return decorator(Manager)  # type: ignore[no-any-return]


@pytest.mark.parametrize("place", ["enter", "exit", "class"])
@pytest.mark.parametrize("primitive", list(PRIMITIVES))
@pytest.mark.parametrize("raises", [False, True])
def test_the_table(training: FakeTorch, primitive: str, place: str, raises: bool) -> None:
    seen = Seen(training)
    manager = build_manager(PRIMITIVES[primitive](), place, seen)()
    seen.at("before")

    class Generation(Exception):
        pass

    try:
        with manager:
            seen.at("generate")
            if raises:
                raise Generation
    except Generation:
        assert raises
    seen.at("after")

    if primitive.startswith("aggressive"):
        assert all(seen.expandable.values())  # a release changes no setting
        by = RELEASED_BY[place][primitive.endswith("'enter')")]
        released = {m for m in MOMENTS if seen.releases[m] > seen.releases["before"]}
        assert released == set(MOMENTS[MOMENTS.index(by) :])
        assert seen.releases["after"] == seen.releases["before"] + 1  # once, not twice
    else:
        off = {m for m in MOMENTS if not seen.expandable[m]}
        assert off == OFF_WHEN[place], seen.expandable
    assert hm.allocator_state().scopes == ()


def test_the_three_stacked_on_enter_hold_through_the_block(training: FakeTorch) -> None:
    seen = Seen(training)

    class ShardingManager:
        @hm.expandable_segments(False)
        @hm.aggressive_cache_release(on="enter")
        @hm.ipc_safe()
        def __enter__(self) -> ShardingManager:
            seen.at("sync")
            assert hm.allocator_state().scopes == (
                "expandable_segments(False)",
                "ipc_safe(fallback='auto')",
            )
            return self

        def __exit__(self, *exc: object) -> None:
            seen.at("sleep")

    seen.at("before")
    with ShardingManager():
        seen.at("generate")
    seen.at("after")
    assert seen.expandable == {
        "before": True,
        "sync": False,
        "generate": False,
        "sleep": False,
        "after": True,
    }
    assert seen.releases["sync"] > seen.releases["before"]  # released before the sync
    assert hm.allocator_state().scopes == ()


def test_a_failing_enter_leaves_nothing_behind(training: FakeTorch) -> None:
    class Manager:
        @hm.expandable_segments(False)
        def __enter__(self) -> None:
            raise RuntimeError("engine failed to wake")

        def __exit__(self, *exc: object) -> None:
            raise AssertionError("never reached: __enter__ failed")

    with pytest.raises(RuntimeError, match="engine failed to wake"), Manager():
        pass
    assert hm.allocator_state().expandable_segments
    assert hm.allocator_state().scopes == ()


def test_a_failing_exit_still_restores(training: FakeTorch) -> None:
    class Manager:
        @hm.expandable_segments(False)
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            raise RuntimeError("engine failed to sleep")

    with pytest.raises(RuntimeError, match="failed to sleep"), Manager():
        assert not hm.allocator_state().expandable_segments
    assert hm.allocator_state().expandable_segments


def test_an_exit_that_suppresses_the_block_error_restores(training: FakeTorch) -> None:
    class Manager:
        @hm.ipc_safe()
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> bool:
            return True

    with Manager():
        raise KeyError("swallowed by the manager")
    assert hm.allocator_state().expandable_segments


# --------------------------------------------------------------------------- #
# Nesting, re-entry, instances, subclasses, threads, async
# --------------------------------------------------------------------------- #


class Recorder(ScopedContext):
    """A state scope that logs its entries and exits."""

    def __init__(self, log: list[str], name: str) -> None:
        super().__init__()
        self.log = log
        self.name = name

    def __repr__(self) -> str:
        return f"Recorder({self.name})"

    def _enter(self) -> object:
        self.log.append(f"+{self.name}")
        return self.name

    def _exit(self, token: object, exc: BaseException | None) -> None:
        self.log.append(f"-{token}")


def recorded_manager(log: list[str]) -> type:
    class Manager:
        def __init__(self, name: str) -> None:
            self.name = name

        @Recorder(log, "outer")
        @Recorder(log, "inner")
        def __enter__(self) -> Any:
            log.append(f"enter {self.name}")
            return self

        def __exit__(self, *exc: object) -> None:
            log.append(f"exit {self.name}")

    return Manager


def test_stacked_scopes_enter_outer_first_and_leave_after_exit() -> None:
    log: list[str] = []
    with recorded_manager(log)("m"):
        log.append("block")
    assert log == ["+outer", "+inner", "enter m", "block", "exit m", "-inner", "-outer"]


def test_nested_and_reentered_managers_pair_their_scopes() -> None:
    log: list[str] = []
    manager_class = recorded_manager(log)
    a, b = manager_class("a"), manager_class("b")
    with a:
        with a:  # the same instance re-entered
            log.append("a twice")
        with b:
            log.append("a and b")
    assert log == [
        *("+outer", "+inner", "enter a"),
        *("+outer", "+inner", "enter a", "a twice", "exit a", "-inner", "-outer"),
        *("+outer", "+inner", "enter b", "a and b", "exit b", "-inner", "-outer"),
        *("exit a", "-inner", "-outer"),
    ]


def test_two_instances_exited_out_of_order_each_leave_their_own() -> None:
    log: list[str] = []
    manager_class = recorded_manager(log)
    a, b = manager_class("a"), manager_class("b")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert log[-3:] == ["exit a", "-inner", "-outer"]
    b.__exit__(None, None, None)
    assert log[-3:] == ["exit b", "-inner", "-outer"]


def test_a_subclass_keeps_the_span() -> None:
    log: list[str] = []

    class Sub(recorded_manager(log)):  # type: ignore[misc]
        def __enter__(self) -> Any:
            log.append("sub enter")
            return super().__enter__()

    with Sub("s"):
        log.append("block")
    assert log == [
        "+outer",
        "+inner",
        "sub enter",
        "enter s",
        "block",
        "exit s",
        "-inner",
        "-outer",
    ]


def test_threads_with_a_manager_each() -> None:
    log: list[str] = []
    lock = threading.Lock()
    manager_class = recorded_manager(log)
    both_inside = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def rollout(name: str) -> None:
        try:
            with manager_class(name) as manager:
                both_inside.wait()
                with lock:
                    log.append(f"block {manager.name}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rollout, args=(n,)) for n in ("t1", "t2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert log.count("+outer") == log.count("-outer") == 2
    for name in ("t1", "t2"):  # each block ran inside its own scopes
        block = log.index(f"block {name}")
        assert log.index(f"enter {name}") < block < log.index(f"exit {name}")


def test_an_async_manager_spans_the_async_with_block(training: FakeTorch) -> None:
    seen = Seen(training)

    class AsyncManager:
        @hm.expandable_segments(False)
        async def __aenter__(self) -> AsyncManager:
            await asyncio.sleep(0)
            seen.at("sync")
            return self

        async def __aexit__(self, *exc: object) -> None:
            seen.at("sleep")

    async def main() -> None:
        async with AsyncManager():
            await asyncio.sleep(0)
            seen.at("generate")

    asyncio.run(main())
    seen.at("after")
    assert seen.expandable == {"sync": False, "generate": False, "sleep": False, "after": True}


def test_a_manager_with_both_protocols_spans_only_the_decorated_one() -> None:
    log: list[str] = []

    class Both:
        @Recorder(log, "sync-only")
        def __enter__(self) -> None:
            log.append("enter")

        def __exit__(self, *exc: object) -> None:
            log.append("exit")

        async def __aenter__(self) -> None:
            log.append("aenter")

        async def __aexit__(self, *exc: object) -> None:
            log.append("aexit")

    async def main() -> None:
        async with Both():
            pass

    asyncio.run(main())
    assert log == ["aenter", "aexit"]
    with Both():
        pass
    assert log[2:] == ["+sync-only", "enter", "exit", "-sync-only"]


def test_the_kill_switch_still_decorates(training: FakeTorch, monkeypatch: Any) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")

    class Manager:
        @hm.expandable_segments(False)
        def __enter__(self) -> str:
            return "woke"

        def __exit__(self, *exc: object) -> None:
            pass

    with Manager() as woke:
        assert woke == "woke"
        assert hm.allocator_state().expandable_segments


# --------------------------------------------------------------------------- #
# Where the span cannot be made: one warning, and the call is still covered
# --------------------------------------------------------------------------- #


def foreign(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator of somebody else's (a memory logger, say) that wraps with a plain function."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def test_a_foreign_decorator_outside_warns_once_and_covers_the_call() -> None:
    log: list[str] = []

    class Manager:
        @foreign
        @Recorder(log, "r")
        def __enter__(self) -> None:
            log.append("enter")

        def __exit__(self, *exc: object) -> None:
            log.append("exit")

    warned = pytest.warns(HybridMemWarning, match=r"covers only the call.*decorators outermost")
    with warned as record, Manager():
        log.append("block")
    assert log == ["+r", "enter", "-r", "block", "exit"]
    # It points at the method to change (its first decorator's line), not at a wrapper.
    (found,) = [w for w in record if "covers only the call" in str(w.message)]
    lines, start = inspect.getsourcelines(
        test_a_foreign_decorator_outside_warns_once_and_covers_the_call
    )
    decorated = start + next(i for i, line in enumerate(lines) if "@foreign" in line)
    assert (found.filename, found.lineno) == (__file__, decorated)
    assert "\n" not in str(found.message)
    with Manager():  # once: the second use is silent
        pass


def test_a_nameless_foreign_decorator_inside_hides_the_enter() -> None:
    # Without functools.wraps the function is "wrapper" to the scope, which then
    # cannot know it decorates __enter__ (docs/phases.md says so): the call only.
    log: list[str] = []

    class Manager:
        @Recorder(log, "r")
        @foreign
        def __enter__(self) -> None:
            log.append("enter")

        def __exit__(self, *exc: object) -> None:
            log.append("exit")

    with Manager():
        log.append("block")
    assert log == ["+r", "enter", "-r", "block", "exit"]


def test_a_named_foreign_decorator_inside_keeps_the_span() -> None:
    log: list[str] = []

    def logged(fn: Callable[..., Any]) -> Callable[..., Any]:
        import functools

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    class Manager:
        @Recorder(log, "r")
        @logged
        def __enter__(self) -> None:
            log.append("enter")

        def __exit__(self, *exc: object) -> None:
            log.append("exit")

    with Manager():
        log.append("block")
    assert log == ["+r", "enter", "block", "exit", "-r"]


def test_an_enter_without_an_exit_warns_at_class_creation() -> None:
    log: list[str] = []
    with pytest.warns(HybridMemWarning, match=r"Half has no __exit__.*Define __exit__"):

        class Half:
            @Recorder(log, "r")
            def __enter__(self) -> None:
                log.append("enter")

    Half().__enter__()
    assert log == ["+r", "enter", "-r"]


def test_a_mixin_exit_is_found() -> None:
    log: list[str] = []

    class Exits:
        def __exit__(self, *exc: object) -> None:
            log.append("exit")

    class Manager(Exits):
        @Recorder(log, "r")
        def __enter__(self) -> None:
            log.append("enter")

    with Manager():
        log.append("block")
    assert log == ["+r", "enter", "block", "exit", "-r"]


def test_a_function_named_enter_outside_a_class_is_a_plain_function() -> None:
    log: list[str] = []

    def __enter__() -> str:
        log.append("called")
        return "ok"

    wrapped = Recorder(log, "r")(__enter__)
    assert wrapped() == "ok"
    assert log == ["+r", "called", "-r"]


def test_the_rollout_phase_spans_and_the_wake_up_phase_stays(training: FakeTorch) -> None:
    seen = Seen(training)

    class Manager:
        @hm.phase("rollout", backend="vllm")
        @hm.phase("wake_up", backend="vllm")
        def __enter__(self) -> None:
            seen.at("sync")

        def __exit__(self, *exc: object) -> None:
            seen.at("sleep")

    seen.at("before")
    with Manager():
        seen.at("generate")
    seen.at("after")
    # wake_up (release, classic segments) on the call; rollout (classic) through the block
    assert seen.expandable == {
        "before": True,
        "sync": False,
        "generate": False,
        "sleep": False,
        "after": True,
    }
    assert seen.releases["sync"] > seen.releases["before"]
    assert seen.releases["generate"] == seen.releases["sync"]


def test_the_wake_up_phase_alone_stays_on_enter(training: FakeTorch) -> None:
    seen = Seen(training)

    class Manager:
        @hm.phase("wake_up", backend="vllm")
        def __enter__(self) -> None:
            seen.at("sync")

        def __exit__(self, *exc: object) -> None:
            seen.at("sleep")

    with Manager():
        seen.at("generate")
    assert not seen.expandable["sync"]
    assert seen.expandable["generate"]


def test_one_segment_on_enter_places_only_that_calls_tensors(
    training: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[int] = []

    def hold_block(nbytes: int, device: object) -> int:
        held.append(nbytes)
        return 0

    patch_seam(monkeypatch, "hold_block", hold_block)
    seen = Seen(training)

    class Manager:
        @hm.one_segment(64 << 20)
        def __enter__(self) -> None:
            seen.at("sync")  # the engine's weights are made here, in the held block

        def __exit__(self, *exc: object) -> None:
            seen.at("sleep")

    with Manager():
        seen.at("generate")
    assert held == [64 << 20]
    assert seen.expandable == {"sync": False, "generate": True, "sleep": True}


def test_record_on_enter_records_the_block() -> None:
    from hybridmem.observe.timeline import recording

    class Manager:
        @hm.record
        def __enter__(self) -> None:
            assert recording()

        def __exit__(self, *exc: object) -> None:
            assert recording()

    with Manager():
        assert recording()
    assert not recording()
