"""The write watch (torch 2.10 - 2.11): the last settings string, noted where it is written."""

from __future__ import annotations

import functools
import logging
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest

from hybridmem._torch.write_watch import WriteWatch


class Torch:
    """torch's setter on its module, and what its snapshot says."""

    def __init__(self, last: str | None = "") -> None:
        self.calls: list[object] = []
        self.last = last
        self.snapshots = 0
        self.module = types.SimpleNamespace(setter=self.setter)

    def setter(self, text: object) -> None:
        if not isinstance(text, str):
            raise TypeError("setter(): incompatible function arguments")
        if "bad" in text:
            self.last = text
            raise ValueError(f"refused {text}")
        self.calls.append(text)
        self.last = text

    def read(self) -> str | None:
        self.snapshots += 1
        return self.last

    def watch(self) -> WriteWatch:
        return WriteWatch(self.module, "setter", self.read)


def test_reads_cost_no_snapshot_once_started_and_every_caller_by_name_is_seen() -> None:
    torch = Torch(last="max_split_size_mb:256")
    watch = torch.watch()
    assert not watch.started
    assert watch.last() == "max_split_size_mb:256"
    assert watch.started
    assert watch.watching
    for text in ("expandable_segments:True", "expandable_segments:False"):
        torch.module.setter(text)  # looked up at call time, as vLLM and verl do
        assert watch.last() == text
    assert torch.calls == ["expandable_segments:True", "expandable_segments:False"]
    assert torch.snapshots == 2  # when it started: before and after the wrapper went in


def test_what_torch_raises_passes_through_and_a_refused_string_is_noted() -> None:
    torch = Torch()
    watch = torch.watch()
    watch.last()
    with pytest.raises(ValueError, match="refused bad:1"):
        torch.module.setter("bad:1")
    assert watch.last() == "bad:1"  # torch notes a string before it parses it
    with pytest.raises(TypeError, match="incompatible function arguments"):
        torch.module.setter(3)
    assert watch.last() == "bad:1"  # not a string: torch never read it


def test_the_wrapper_says_what_it_wraps() -> None:
    torch = Torch()
    watch = torch.watch()
    watch.last()
    wrapper = torch.module.setter
    assert wrapper.__wrapped__ == torch.setter
    assert wrapper.__name__ == "setter"


def test_nothing_readable_yet_means_no_watch_and_a_later_read_starts_it() -> None:
    torch = Torch(last=None)  # the snapshot cannot say (CUDA not initialised)
    watch = torch.watch()
    assert watch.last() is None
    assert not watch.started
    assert torch.module.setter == torch.setter
    torch.last = ""
    assert watch.last() == ""
    assert watch.watching


def _bound_in_a_module(setter: Callable[[str], None]) -> types.ModuleType:
    module = types.ModuleType("early_importer")
    module.set_settings = setter  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize(
    ("bind", "said"),
    [
        (lambda f: {"f": f}, "a dict ('f')"),
        (lambda f: functools.partial(f, "x"), "partial"),
        (lambda f: lambda text: f(text), "cell"),
        (lambda f: [f], "list"),
    ],
    ids=["dict value", "partial", "closure", "list"],
)
def test_a_reference_bound_before_the_watch_keeps_reads_on_the_snapshot(
    bind: Callable[[Any], object], said: str
) -> None:
    torch = Torch()
    held = bind(torch.module.setter)  # a caller that will not look the name up
    watch = torch.watch()
    assert watch.last() == ""
    assert not watch.watching
    assert said in watch.captured
    assert torch.module.setter == torch.setter  # torch's setter left as it is
    torch.setter("expandable_segments:True")  # the early reference's write...
    assert watch.last() == "expandable_segments:True"  # ...seen, by the snapshot
    assert torch.snapshots == 2
    del held


def test_a_module_that_imported_the_setter_is_named_in_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    torch = Torch()
    module = _bound_in_a_module(torch.module.setter)
    sys.modules["early_importer"] = module
    try:
        watch = torch.watch()
        watch.last()
        watch.last()
        assert watch.captured == ("early_importer.set_settings",)
    finally:
        del sys.modules["early_importer"]
    (said,) = [r.getMessage() for r in caplog.records if r.name == "hybridmem"]
    assert said.startswith(
        "allocator settings: setter is also held by early_importer.set_settings, which "
        "would write without being seen; hybridmem reads the allocator snapshot"
    )


def test_a_key_of_a_dict_and_a_local_of_a_running_call_do_not_bypass() -> None:
    torch = Torch()
    rules = {torch.module.setter: "skip"}  # torch.compile's rule maps hold it as a key
    local = torch.module.setter  # this test's own frame
    watch = torch.watch()
    watch.last()
    assert watch.watching, watch.captured
    del rules, local


def _extension_module(torch: Torch) -> types.ModuleType:
    module = types.ModuleType("fake_C")
    module.setter = torch.setter  # type: ignore[attr-defined]
    torch.module = module  # type: ignore[assignment]
    return module


def test_the_interpreters_init_copy_of_the_namespace_does_not_bypass() -> None:
    torch = Torch()
    module = _extension_module(torch)
    init_copy = dict(module.__dict__)  # as CPython keeps for a single-phase-init module
    watch = torch.watch()
    watch.last()
    assert watch.watching, watch.captured
    assert init_copy["setter"] == torch.setter


@pytest.mark.parametrize(
    "hold",
    [lambda d: [d], lambda d: types.SimpleNamespace(namespace=d)],
    ids=["list", "object"],
)
def test_a_namespace_copy_something_holds_keeps_reads_on_the_snapshot(
    hold: Callable[[dict[str, Any]], object],
) -> None:
    torch = Torch()
    module = _extension_module(torch)
    held = hold(dict(module.__dict__))  # reachable: someone could call through it
    watch = torch.watch()
    watch.last()
    assert not watch.watching
    assert watch.captured == ("a dict ('setter')",)
    del held


def test_a_dict_named_otherwise_is_never_taken_for_the_init_copy() -> None:
    torch = Torch()
    module = _extension_module(torch)
    other = {"__name__": "elsewhere", "setter": module.setter}
    watch = torch.watch()
    watch.last()
    assert not watch.watching
    assert watch.captured == ("a dict ('setter')",)
    del other


def test_stop_puts_torch_setter_back_but_never_over_someone_elses() -> None:
    torch = Torch()
    watch = torch.watch()
    watch.last()
    watch.stop()
    assert torch.module.setter == torch.setter
    assert not watch.started
    watch.last()  # started again
    mine = torch.module.setter

    def theirs(text: str) -> None:
        mine(text)

    torch.module.setter = theirs  # another library wrapped it after hybridmem
    watch.stop()
    assert torch.module.setter is theirs


def test_threads_racing_the_first_read_start_one_watch() -> None:
    torch = Torch()
    watch = torch.watch()
    barrier = threading.Barrier(8)
    seen: list[str | None] = []

    def read() -> None:
        barrier.wait()
        seen.append(watch.last())

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [""] * 8
    assert torch.module.setter.__wrapped__ == torch.setter  # wrapped once, not twice
    assert torch.snapshots == 2


_OUR_MODULES = """
import importlib, json, pkgutil, sys
import torch
import hybridmem
names = [m.name for m in pkgutil.walk_packages(hybridmem.__path__, "hybridmem.")]
names += ["tests.conftest", "tests.gpu.vllm_sleep_scenarios", "tests.gpu.settings_scenarios"]
for name in names:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # an optional package (vLLM, SGLang) that is not here
from hybridmem._torch.write_watch import WriteWatch
watch = WriteWatch(torch._C, "_accelerator_setAllocatorSettings", lambda: "")
watch.last()
print(json.dumps({"watching": watch.watching, "captured": list(watch.captured)}))
watch.stop()
"""


def test_no_module_of_ours_holds_torchs_setter_where_the_watch_would_find_it() -> None:
    """hybridmem, the test helpers and the GPU scenarios: none keeps the watch from starting."""
    import json

    import torch

    from tests.helpers import run_python

    if not callable(getattr(torch._C, "_accelerator_setAllocatorSettings", None)):
        pytest.skip("needs torch 2.10 or newer (its allocator-settings setter)")
    result = run_python("-c", _OUR_MODULES)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts == {"watching": True, "captured": []}


def test_a_module_that_refuses_the_wrapper_keeps_reads_on_the_snapshot() -> None:
    torch = Torch()

    class Frozen:
        def __init__(self) -> None:
            object.__setattr__(self, "setter", torch.setter)

        def __setattr__(self, name: str, value: object) -> None:
            raise AttributeError(f"{name} is read-only")

    frozen = Frozen()
    watch = WriteWatch(frozen, "setter", torch.read)
    assert watch.last() == ""
    assert not watch.watching
    assert watch.captured == ()  # nothing held elsewhere: the module refused the wrapper
    torch.setter("expandable_segments:True")
    assert watch.last() == "expandable_segments:True"


def test_a_write_while_the_watch_starts_is_not_lost() -> None:
    """Another thread's write between the first read and the wrapper: read again after."""
    torch = Torch()
    reads: list[str | None] = []

    def read() -> str | None:
        reads.append(torch.last)
        if len(reads) == 1:
            torch.setter("expandable_segments:True")  # through torch's own, not yet watched
            return ""  # what the snapshot said before it
        return torch.last

    watch = WriteWatch(torch.module, "setter", read)
    assert watch.last() == "expandable_segments:True"
    assert watch.watching
