"""The context-decorator base: every form, nesting, errors, threads, kill switch."""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import threading
from collections.abc import AsyncGenerator, Generator, Iterator
from typing import Any

import pytest

from hybridmem import HybridMemWarning
from hybridmem._scope import ScopedContext


class Recorder(ScopedContext):
    """A primitive that records its entries and exits, and whether it is inside."""

    def __init__(self, log: list[str], name: str = "r") -> None:
        super().__init__()
        self.log = log
        self.name = name
        self.depth = 0

    def __repr__(self) -> str:
        return f"Recorder({self.name})"

    def _enter(self) -> object:
        self.depth += 1
        token = f"{self.name}{self.depth}"
        self.log.append(f"enter {token}")
        return token

    def _exit(self, token: object, exc: BaseException | None) -> None:
        self.depth -= 1
        self.log.append(f"exit {token} {type(exc).__name__ if exc else '-'}")


def inside(log: list[str]) -> int:
    """Net number of contexts entered according to the log."""
    return sum(1 for e in log if e.startswith("enter")) - sum(
        1 for e in log if e.startswith("exit")
    )


# --------------------------------------------------------------------------- #
# with / async with
# --------------------------------------------------------------------------- #


def test_with_enters_and_exits() -> None:
    log: list[str] = []
    with Recorder(log) as ctx:
        assert ctx.active
        assert log == ["enter r1"]
    assert log == ["enter r1", "exit r1 -"]
    assert not ctx.active


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt, SystemExit])
def test_with_exits_on_any_exception(error: type[BaseException]) -> None:
    log: list[str] = []
    with pytest.raises(error), Recorder(log):
        raise error()
    assert log == ["enter r1", f"exit r1 {error.__name__}"]


def test_same_instance_nests_as_a_stack() -> None:
    log: list[str] = []
    ctx = Recorder(log)
    with ctx, ctx, ctx:
        assert inside(log) == 3
    assert log == ["enter r1", "enter r2", "enter r3", "exit r3 -", "exit r2 -", "exit r1 -"]


def test_exit_without_enter_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="exited more often"):
        Recorder([]).__exit__(None, None, None)


def test_async_with() -> None:
    log: list[str] = []

    async def main() -> None:
        async with Recorder(log):
            await asyncio.sleep(0)
            assert inside(log) == 1

    asyncio.run(main())
    assert log == ["enter r1", "exit r1 -"]


def test_async_with_restores_on_cancel() -> None:
    log: list[str] = []
    started = asyncio.Event()

    async def body() -> None:
        async with Recorder(log):
            started.set()
            await asyncio.Event().wait()

    async def main() -> None:
        task = asyncio.create_task(body())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["enter r1", "exit r1 CancelledError"]


# --------------------------------------------------------------------------- #
# Decorating functions, coroutines, generators
# --------------------------------------------------------------------------- #


def test_function_decorator_wraps_and_uses_fresh_state() -> None:
    log: list[str] = []
    ctx = Recorder(log)

    @ctx
    def work(x: int) -> int:
        """Doc."""
        assert inside(log) == 1
        return x * 2

    assert work(3) == 6
    assert work(4) == 8
    assert work.__name__ == "work"
    assert work.__doc__ == "Doc."
    assert log == ["enter r1", "exit r1 -", "enter r1", "exit r1 -"]
    assert not ctx.active  # the template itself is never entered


def test_function_decorator_restores_on_error() -> None:
    log: list[str] = []

    @Recorder(log)
    def fail() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        fail()
    assert log == ["enter r1", "exit r1 KeyError"]


def test_recursive_decorated_calls_nest() -> None:
    log: list[str] = []

    @Recorder(log)
    def countdown(n: int) -> int:
        return 0 if n == 0 else 1 + countdown(n - 1)

    assert countdown(2) == 2
    assert [e.split()[0] for e in log] == ["enter"] * 3 + ["exit"] * 3


def test_coroutine_decorator_spans_the_awaited_body() -> None:
    log: list[str] = []

    @Recorder(log)
    async def work() -> str:
        await asyncio.sleep(0)
        assert inside(log) == 1  # contextlib.ContextDecorator would have exited already
        return "done"

    assert inspect.iscoroutinefunction(work)
    assert asyncio.run(work()) == "done"
    assert log == ["enter r1", "exit r1 -"]


def test_coroutine_decorator_restores_on_cancel() -> None:
    log: list[str] = []

    @Recorder(log)
    async def hang() -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        task = asyncio.create_task(hang())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["enter r1", "exit r1 CancelledError"]


def test_generator_is_inside_while_running_and_outside_at_yield() -> None:
    log: list[str] = []
    seen: list[int] = []

    @Recorder(log)
    def gen(n: int) -> Iterator[int]:
        for i in range(n):
            seen.append(inside(log))
            yield i
        return None

    assert inspect.isgeneratorfunction(gen)
    out = []
    for value in gen(3):
        out.append(value)
        assert inside(log) == 0  # restored at each yield
    assert out == [0, 1, 2]
    assert seen == [1, 1, 1]


def test_generator_send_throw_close_and_return_value() -> None:
    log: list[str] = []

    @Recorder(log)
    def echo() -> Generator[Any, Any, str]:
        received = yield "ready"
        try:
            yield f"got {received}"
        except ValueError:
            yield "handled"
        yield "last"
        return "result"

    g = echo()
    assert next(g) == "ready"
    assert g.send(5) == "got 5"
    assert g.throw(ValueError("x")) == "handled"
    assert next(g) == "last"
    with pytest.raises(StopIteration) as stop:
        next(g)
    assert stop.value.value == "result"
    assert inside(log) == 0

    closing = echo()
    next(closing)
    closing.close()
    assert inside(log) == 0
    assert log[-2:] == ["enter r1", "exit r1 -"]  # the body's cleanup ran inside


def test_generator_error_in_body_restores() -> None:
    log: list[str] = []

    @Recorder(log)
    def bad() -> Iterator[int]:
        yield 1
        raise RuntimeError("boom")

    g = bad()
    next(g)
    with pytest.raises(RuntimeError, match="boom"):
        next(g)
    assert inside(log) == 0


def test_async_generator_forms() -> None:
    log: list[str] = []
    seen: list[int] = []

    @Recorder(log)
    async def agen(n: int) -> AsyncGenerator[int, None]:
        for i in range(n):
            await asyncio.sleep(0)
            seen.append(inside(log))
            try:
                yield i
            except KeyError:
                yield -1

    async def main() -> list[int]:
        out = []
        async for value in agen(2):
            assert inside(log) == 0
            out.append(value)
        g = agen(3)
        out.append(await g.__anext__())
        out.append(await g.athrow(KeyError()))
        await g.aclose()
        return out

    assert inspect.isasyncgenfunction(agen)
    assert asyncio.run(main()) == [0, 1, 0, -1]
    assert seen == [1, 1, 1]
    assert inside(log) == 0


# --------------------------------------------------------------------------- #
# Decorating context-manager classes
# --------------------------------------------------------------------------- #


def test_class_decorator_spans_the_managed_block() -> None:
    log: list[str] = []

    @Recorder(log)
    class Manager:
        def __enter__(self) -> Manager:
            log.append("class enter")
            return self

        def __exit__(self, *exc: object) -> None:
            log.append("class exit")

    with Manager() as m:
        assert isinstance(m, Manager)
        log.append("body")
    assert log == ["enter r1", "class enter", "body", "class exit", "exit r1 -"]


def test_class_decorator_when_class_enter_fails() -> None:
    log: list[str] = []

    @Recorder(log)
    class Broken:
        def __enter__(self) -> None:
            raise OSError("wake_up failed")

        def __exit__(self, *exc: object) -> None:
            log.append("never")

    with pytest.raises(OSError, match="wake_up failed"), Broken():
        pass
    assert log == ["enter r1", "exit r1 OSError"]


def test_class_decorator_sees_suppression_and_exit_errors() -> None:
    log: list[str] = []

    @Recorder(log)
    class Swallow:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> bool:
            return True

    with Swallow():
        raise ValueError("swallowed")
    assert log == ["enter r1", "exit r1 -"]

    @Recorder(log)
    class Raising:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            raise LookupError("sleep failed")

    log.clear()
    with pytest.raises(LookupError), Raising():
        pass
    assert log == ["enter r1", "exit r1 LookupError"]


def test_class_decorator_nested_reentry_and_slots() -> None:
    log: list[str] = []

    @Recorder(log)
    class Slotted:
        __slots__ = ()

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    manager = Slotted()
    with manager:
        with manager:
            assert inside(log) == 2
        assert inside(log) == 1
    assert inside(log) == 0


def test_class_decorator_async_manager() -> None:
    log: list[str] = []

    @Recorder(log)
    class AsyncManager:
        async def __aenter__(self) -> AsyncManager:
            await asyncio.sleep(0)
            log.append("class aenter")
            return self

        async def __aexit__(self, *exc: object) -> None:
            log.append("class aexit")

    async def main() -> None:
        async with AsyncManager():
            log.append("body")
        with pytest.raises(ZeroDivisionError):
            async with AsyncManager():
                1 / 0  # noqa: B018

    asyncio.run(main())
    assert log[:5] == ["enter r1", "class aenter", "body", "class aexit", "exit r1 -"]
    assert log[-1] == "exit r1 ZeroDivisionError"


def test_class_decorator_inherited_enter() -> None:
    log: list[str] = []

    class Base:
        def __enter__(self) -> str:
            return "base"

        def __exit__(self, *exc: object) -> None:
            return None

    @Recorder(log)
    class Child(Base):
        pass

    with Child() as value:
        assert value == "base"
        assert inside(log) == 1
    with Base():
        assert inside(log) == 0  # the base class is untouched


def test_decorating_a_plain_class_or_a_value_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="context manager"):

        @Recorder([])
        class NotAManager:
            pass

    with pytest.raises(TypeError, match="decorates functions"):
        Recorder([])(42)


# --------------------------------------------------------------------------- #
# Threads and the kill switch
# --------------------------------------------------------------------------- #


def test_one_instance_shared_by_threads_pairs_tokens_per_thread() -> None:
    log: list[str] = []
    ctx = Recorder(log)
    barrier = threading.Barrier(2)
    tokens: dict[str, object] = {}
    lock = threading.Lock()

    class Tracking(Recorder):
        pass

    original_exit = ctx._exit

    def recording_exit(token: object, exc: BaseException | None) -> None:
        with lock:
            tokens[threading.current_thread().name] = token
        original_exit(token, exc)

    ctx._exit = recording_exit  # type: ignore[method-assign]
    entered: dict[str, object] = {}

    def worker() -> None:
        with ctx:
            with lock:
                entered[threading.current_thread().name] = f"r{ctx.depth}"
            barrier.wait()  # both threads inside; the second one entered last
        barrier.wait()

    threads = [threading.Thread(target=worker, name=f"t{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each thread exits with the token it entered with, whatever the order
    assert entered == tokens
    assert not ctx.active


def test_kill_switch_makes_it_a_noop_that_still_decorates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    log: list[str] = []

    @Recorder(log)
    def work() -> int:
        return 7

    assert work() == 7
    with Recorder(log):
        pass
    assert log == []


def test_kill_switch_flipped_inside_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    with Recorder(log):
        monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    assert log == ["enter r1", "exit r1 -"]  # what was entered is still undone
    with Recorder(log):
        monkeypatch.setenv("HYBRIDMEM_DISABLE", "0")
    assert log == ["enter r1", "exit r1 -"]  # entered disabled: nothing to undo


def test_unrecognised_kill_switch_value_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "maybe")
    log: list[str] = []
    with pytest.warns(HybridMemWarning, match="HYBRIDMEM_DISABLE='maybe'"), Recorder(log):
        pass
    assert log == ["enter r1", "exit r1 -"]  # treated as off


# --------------------------------------------------------------------------- #
# Issue #11: callables that return coroutines, descriptors, subclasses
# --------------------------------------------------------------------------- #


def test_a_sync_wrapper_of_an_async_def_gets_the_scope_around_the_awaited_body() -> None:
    log: list[str] = []
    recorder = Recorder(log)

    async def body() -> int:
        await asyncio.sleep(0)
        log.append(f"body inside={inside(log)}")
        return 7

    def wrapper() -> Any:  # a sync function handing back a coroutine
        return body()

    decorated = recorder(wrapper)
    assert asyncio.run(decorated()) == 7
    assert "body inside=1" in log
    assert inside(log) == 0


def test_an_object_with_an_async_call_is_decorated_as_a_coroutine() -> None:
    log: list[str] = []

    class Handler:
        async def __call__(self, x: int) -> int:
            await asyncio.sleep(0)
            log.append(f"call inside={inside(log)}")
            return x + 1

    decorated = Recorder(log)(Handler())
    assert asyncio.run(decorated(1)) == 2
    assert log == ["enter r1", "call inside=1", "exit r1 -"]


def test_a_function_returning_a_generator_or_future_warns_once() -> None:
    log: list[str] = []

    def gen_maker() -> Any:
        return (i for i in range(3))

    decorated = Recorder(log)(gen_maker)
    with pytest.warns(HybridMemWarning, match="covered only the call that made it"):
        assert list(decorated()) == [0, 1, 2]
    list(decorated())  # once only (the test config turns a second warning into an error)


def test_a_function_returning_another_awaitable_warns_and_hands_it_back_as_it_is() -> None:
    """An engine's future or a Ray ref: its work runs when awaited, after the scope."""
    log: list[str] = []

    class EngineCall:  # awaitable, not a coroutine: what vLLM's or Ray's calls return
        def __await__(self) -> Any:
            log.append(f"awaited inside={inside(log)}")
            yield from asyncio.sleep(0).__await__()
            return 5

    call = EngineCall()

    def ask_engine() -> Any:
        return call

    decorated = Recorder(log)(ask_engine)
    with pytest.warns(HybridMemWarning, match=r"returned a EngineCall \(an awaitable\)"):
        returned = decorated()
    assert returned is call  # its caller may need what it is

    async def main() -> Any:
        return await returned

    assert asyncio.run(main()) == 5
    assert log[-1] == "awaited inside=0"  # after the scope, as the warning said


def test_a_function_returning_a_compiled_coroutine_gets_the_scope_when_it_is_awaited() -> None:
    """A coroutine that is not a Python one (Cython's) is spanned as a Python one is."""
    log: list[str] = []

    class Compiled(collections.abc.Coroutine[Any, Any, int]):
        def __init__(self) -> None:
            self._inner = self._run()

        async def _run(self) -> int:
            log.append(f"body inside={inside(log)}")
            return 3

        def send(self, value: Any) -> Any:
            return self._inner.send(value)

        def throw(self, *args: Any) -> Any:
            return self._inner.throw(*args)

        def close(self) -> None:
            self._inner.close()

        def __await__(self) -> Any:
            return self._inner.__await__()

    def compiled_call() -> Compiled:
        return Compiled()

    decorated = Recorder(log)(compiled_call)
    assert asyncio.run(decorated()) == 3
    assert "body inside=1" in log
    assert inside(log) == 0


def test_staticmethod_and_classmethod_objects_can_be_decorated() -> None:
    log: list[str] = []

    class Trainer:
        @Recorder(log)
        @staticmethod
        def step(x: int) -> int:
            log.append(f"step inside={inside(log)}")
            return x * 2

        @Recorder(log)
        @classmethod
        def make(cls, x: int) -> tuple[type, int]:
            log.append(f"make inside={inside(log)}")
            return cls, x

    assert Trainer.step(3) == 6
    assert Trainer().step(4) == 8  # no instance is bound
    assert Trainer.make(1) == (Trainer, 1)
    assert Trainer().make(2) == (Trainer, 2)
    assert log.count("step inside=1") == 2
    assert log.count("make inside=1") == 2
    assert inside(log) == 0


@pytest.mark.parametrize(
    "calls_super", [(True, True), (True, False), (False, True), (False, False)]
)
def test_a_subclass_overriding_enter_and_exit_keeps_the_scope_balanced(
    calls_super: tuple[bool, bool],
) -> None:
    log: list[str] = []
    enter_super, exit_super = calls_super

    @Recorder(log)
    class Manager:
        def __enter__(self) -> Any:
            log.append("base enter")
            return self

        def __exit__(self, *exc: object) -> None:
            log.append("base exit")

    class Sub(Manager):
        def __enter__(self) -> Any:
            log.append(f"sub enter inside={inside(log)}")
            return super().__enter__() if enter_super else self

        def __exit__(self, *exc: object) -> None:
            log.append("sub exit")
            if exit_super:
                super().__exit__(*exc)

    for _ in range(2):
        with Sub():
            assert inside(log) == 1  # entered once, however the chain runs
        assert inside(log) == 0
    with pytest.raises(KeyError), Sub():
        raise KeyError("body")
    assert inside(log) == 0
    with Manager():  # the base class alone still works
        assert inside(log) == 1
    assert inside(log) == 0
    assert "sub enter inside=1" in log  # the scope is on before the subclass's own code


def test_a_subclass_of_a_decorated_async_manager_stays_balanced() -> None:
    log: list[str] = []

    @Recorder(log)
    class Manager:
        async def __aenter__(self) -> Any:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    class Sub(Manager):
        async def __aenter__(self) -> Any:
            return await super().__aenter__()

        async def __aexit__(self, *exc: object) -> None:  # does not call super()
            return None

    async def main() -> None:
        async with Sub():
            assert inside(log) == 1
        assert inside(log) == 0

    asyncio.run(main())
