"""docs/backends/verl.md's worker subclass: verl 0.9.1's own method, and it runs.

The block is held to ``ActorRolloutRefWorker.update_weights`` as verl's wheel defines it
(``verl/workers/engine_workers.py``, read with ``ast``: the module imports Ray, Megatron
and the rest of verl), then run against stand-ins for the two verl modules it imports: a
``register`` that, as verl's does, awaits the method only where it is a coroutine
function, and a base worker whose update toggles expandable segments as verl's does.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.util
import inspect
import json
import os
import sys
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.integrations.verl import allocator
from hybridmem.integrations.verl import install as install_module
from tests import verl_oracle
from tests.conftest import FakeTorch
from tests.helpers import REPO, run_python
from tests.test_docs import blocks

DOC = REPO / "docs" / "backends" / "verl.md"
WORKERS = "verl/workers/engine_workers.py"
#: verl 0.9.1's worker modules import what only its verl-core extra installs (uvicorn...)
INSTALL = 'pip install "verl[verl-core]==0.9.1"'
DECORATOR = "verl/single_controller/base/decorator.py"


def _verl_file(name: str) -> str:
    found = verl_oracle.verl_source()
    if found is None:
        if verl_oracle.required():
            pytest.fail(verl_oracle.missing_reason())
        pytest.skip(verl_oracle.missing_reason())
    where = found[1].split(":")[0]
    if where.endswith(".whl"):
        with zipfile.ZipFile(where) as wheel:
            return wheel.read(name).decode()
    return (Path(found[1]).parents[3] / name).read_text()


def _block() -> str:
    (code,) = [b.code for b in blocks(DOC) if "class HybridWorker(" in b.code]
    return code


def _method(source: str, cls: str, name: str) -> ast.AsyncFunctionDef | ast.FunctionDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found")


def _parameters(method: ast.AsyncFunctionDef | ast.FunctionDef) -> list[tuple[str, str, str]]:
    """Each parameter's name, annotation and default, as source text."""
    args = method.args.args
    defaults = [None] * (len(args) - len(method.args.defaults)) + list(method.args.defaults)
    return [
        (a.arg, ast.unparse(a.annotation) if a.annotation else "", ast.unparse(d) if d else "")
        for a, d in zip(args, defaults, strict=True)
    ]


def _registration(method: ast.AsyncFunctionDef | ast.FunctionDef) -> str:
    (call,) = [
        d
        for d in method.decorator_list
        if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "register"
    ]
    return ast.unparse(call)


def test_the_subclass_overrides_verls_method_as_verl_defines_it() -> None:
    ours = _method(_block(), "HybridWorker", "update_weights")
    theirs = _method(_verl_file(WORKERS), "ActorRolloutRefWorker", "update_weights")
    assert isinstance(theirs, ast.AsyncFunctionDef)
    assert isinstance(ours, ast.AsyncFunctionDef)
    assert _parameters(ours) == _parameters(theirs)
    assert _registration(ours) == _registration(theirs)
    assert _registration(ours) == ast.unparse(ours.decorator_list[0])  # outermost, as verl's
    # verl's register awaits a method only where it is a coroutine function: the
    # decorators under it must keep it one (checked on the running class below).
    assert "inspect.iscoroutinefunction(func)" in _verl_file(DECORATOR)


def _register(
    dispatch_mode: Any = None, execute_mode: Any = None, blocking: bool = True
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """verl's register, as far as the method's shape goes: sync or async by the method."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        @functools.wraps(func)
        async def async_inner(*args: Any, **kwargs: Any) -> Any:
            return await func(*args, **kwargs)

        wrapper: Any = async_inner if inspect.iscoroutinefunction(func) else inner
        wrapper.registered = {"dispatch_mode": dispatch_mode, "blocking": blocking}
        registered: Callable[..., Any] = wrapper
        return registered

    return decorator


class _BaseWorker:
    """verl's worker as the override sees it: its update toggles, and may fail."""

    def __init__(self) -> None:
        self.fail = False
        self.seen: list[str] = []

    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        events = self.seen
        allocator.set_expandable_segments(False)  # verl's toggle, as install() leaves it
        events.append(f"update {global_steps} {mode}")
        if self.fail:
            raise RuntimeError("the rollout did not wake")
        allocator.set_expandable_segments(True)
        return {"steps": global_steps}


@pytest.fixture
def stand_in_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    names: dict[str, dict[str, Any]] = {
        "verl": {},
        "verl.single_controller": {},
        "verl.single_controller.base": {},
        "verl.single_controller.base.decorator": {
            "register": _register,
            "Dispatch": types.SimpleNamespace(ONE_TO_ALL="ONE_TO_ALL"),
        },
        "verl.workers": {},
        "verl.workers.engine_workers": {"ActorRolloutRefWorker": _BaseWorker},
    }
    for name, attributes in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)


def _worker_class() -> Any:
    namespace: dict[str, Any] = {"__name__": "verl_worker_docs"}
    exec(compile(_block(), f"{DOC}:HybridWorker", "exec"), namespace)
    return namespace["HybridWorker"]


def test_the_subclass_runs_and_a_failed_update_restores_the_allocator(
    stand_in_verl: None, training: FakeTorch
) -> None:
    worker_class = _worker_class()
    method = worker_class.update_weights
    assert inspect.iscoroutinefunction(method)  # verl's register awaits it
    assert method.registered == {"dispatch_mode": "ONE_TO_ALL", "blocking": False}
    worker = worker_class()
    worker.seen = training.events
    assert asyncio.run(worker.update_weights(global_steps=7)) == {"steps": 7}
    update = training.events.index("update 7 auto")
    assert "empty_cache" in training.events[:update]  # released before the update ran
    assert hm.allocator_state().expandable_segments
    worker.fail = True
    with pytest.raises(RuntimeError, match="did not wake"):
        asyncio.run(worker.update_weights(global_steps=8, mode="naive"))
    assert hm.allocator_state().expandable_segments  # back on, though the update turned it off
    failed = training.events.index("update 8 naive")
    assert "empty_cache" in training.events[failed:]  # the failed stages' cache released
    assert hm.allocator_state()["max_split_size_mb"] == "256"  # the user's, kept


# --------------------------------------------------------------------------- #
# On verl itself, installed as the docs say (CI's verl job)
# --------------------------------------------------------------------------- #

_ON_VERL = """
import inspect, json, sys
exec(compile(sys.stdin.read(), "docs/backends/verl.md:HybridWorker", "exec"), globals())
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
method = HybridWorker.update_weights
attrs = getattr(method, MAGIC_ATTR)
print(json.dumps({
    "coroutine": inspect.iscoroutinefunction(method),
    "one_to_all": attrs["dispatch_mode"] is Dispatch.ONE_TO_ALL,
    "blocking": attrs["blocking"],
    "base": HybridWorker.__mro__[1].__module__,
}))
"""


def test_the_block_defines_the_worker_on_verls_own_modules() -> None:
    """With verl installed as docs/backends/verl.md says, the snippet imports and registers."""
    if importlib.util.find_spec("verl") is None:
        if os.environ.get("HYBRIDMEM_REQUIRE_VERL_INSTALLED") == "1":
            pytest.fail(f"verl is not installed (HYBRIDMEM_REQUIRE_VERL_INSTALLED=1): {INSTALL}")
        pytest.skip(f"needs verl 0.9.1 installed with its verl-core extra: {INSTALL}")
    result = run_python("-c", _ON_VERL, input=_block())
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts == {
        "coroutine": True,  # verl's register awaits it
        "one_to_all": True,
        "blocking": False,
        "base": "verl.workers.engine_workers",
    }


def test_the_docs_and_the_warning_name_the_same_install_line() -> None:
    text = DOC.read_text()
    assert INSTALL in text
    assert install_module.INSTALL_LINE in text
