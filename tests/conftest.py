"""Shared fixtures: a clean hybridmem state per test and a fake torch seam."""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import pytest
import torch
from hypothesis import settings

from hybridmem import _log, _torch
from hybridmem._torch import device as _torch_device
from hybridmem.allocator.grammar import parse_settings
from hybridmem.allocator.rules import TorchRules, default_state
from hybridmem.ipc import _launch as _probe_launch
from hybridmem.ipc import capabilities
from hybridmem.ipc import shareable as ipc
from hybridmem.observe import timeline
from hybridmem.scopes import registry as backends
from hybridmem.scopes.allocator import _reset_state_for_tests

# How long one example takes on a loaded machine is no verdict (a first example that
# imports or warms up once ran 725 ms against hypothesis's 200 ms default): no deadline
# for any property test, whether its @settings names one or not.
settings.register_profile("hybridmem", deadline=None)
settings.load_profile("hybridmem")

_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "HYBRIDMEM_DISABLE")


# torch's own module, bound at import (tests may swap torch._C); its setter is looked
# up at each call, as every writer does: a reference to the function itself, held from
# import on, would keep torch 2.10 - 2.11's write watch from starting in this process.
_REAL_C = torch._C


def _reset_real_torch_settings() -> None:
    setter = getattr(_REAL_C, "_accelerator_setAllocatorSettings", None)
    if callable(setter):
        # The CPU build keeps the parsed settings too: put its state back to
        # torch's defaults, then leave "" as the last string (what a fresh
        # process without env variables reports).
        reset = "expandable_segments:False,pinned_use_background_threads:False"
        if _torch.torch_version() >= (2, 11):
            reset += ",large_segment_size_mb:20"
        setter(reset)
        setter("")


def _as_started_with_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real torch's getter reports the env a test sets, until the first write.

    This process's torch read its env long ago (and was reset to ""); a test that sets
    ``PYTORCH_CUDA_ALLOC_CONF`` stands for a process started with it, whose torch reports
    that string until someone writes another. Without this, hybridmem would rightly see
    "" as a write made outside it. A test's fake seam replaces both.
    """
    getter, setter = _torch.last_allocator_settings, _torch.set_allocator_settings
    written: list[str] = []

    def last() -> str | None:
        value = getter()
        if value != "" or written:
            return value
        rules = TorchRules(_torch.torch_version(), _torch.cuda_built())
        name, _ = rules.env_variable(os.environ)
        return os.environ[name] if name is not None else value

    def write(text: str) -> bool:
        written.append(text)
        return setter(text)

    patch_seam(monkeypatch, "last_allocator_settings", last)
    patch_seam(monkeypatch, "set_allocator_settings", write)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU tests where no CUDA device is visible (CI), with the reason shown."""
    has_gpu = _torch.cuda_available()
    count = _torch.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


# torch's own answer, bound before any test hides CUDA (the hiding replaces the attribute).
_CUDA_INITIALIZED = cast(Callable[[], bool], torch.cuda.is_initialized)


def hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like a machine without a GPU until ``monkeypatch`` undoes it.

    ``torch.cuda.is_available()`` and ``device_count()`` say none; CUDA cannot
    initialise (as in CI's CUDA build without a driver); ``torch.cuda.is_initialized()``
    and the seam's ``cuda_initialized()`` say it is not, even where a ``gpu`` test earlier
    in this worker initialised it for real (it stays so for the worker's life); the
    processes started meanwhile get ``CUDA_VISIBLE_DEVICES=""``.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    if _torch.cuda_built():  # a CPU build refuses CUDA already, its own way
        monkeypatch.setattr(torch.cuda, "_lazy_init", _no_driver)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(_torch_device, "_IS_INITIALIZED", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def check_cuda_still_hidden(was_initialized: bool, initialized: bool, test: str) -> None:
    """Fail ``test`` if CUDA became initialised for real while it was hidden from it.

    Such a test reached the driver past the hiding (a function of torch's that bound
    ``_lazy_init`` at import, a thread it left running): it is not judging the CPU path.
    """
    if initialized and not was_initialized:
        pytest.fail(
            f"{test} initialised CUDA though it is not marked gpu (CUDA was hidden from "
            "it): mark it gpu, or find the call that reached the driver past the hiding "
            "(tests/conftest.py hide_cuda)",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def as_on_a_cpu_machine(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A test not marked ``gpu`` sees no GPU, wherever it runs (CI has none; a GPU host does).

    Such a test judges the CPU path (a fake seam, CPU tensors, "no GPU" messages); on a
    GPU host the real device would take it elsewhere ("'w' is on cpu but this bucket is
    for cuda:0"): :func:`hide_cuda`. This process's own driver read its devices at
    collection (``pytest_collection_modifyitems``), so the ``gpu`` tests after it still
    find theirs. A hidden test that initialises CUDA all the same fails, named.
    """
    if any(request.node.get_closest_marker(mark) for mark in ("gpu", "multi_gpu")):
        yield
        return
    was_initialized = _CUDA_INITIALIZED()
    hide_cuda(monkeypatch)
    yield
    check_cuda_still_hidden(was_initialized, _CUDA_INITIALIZED(), request.node.nodeid)


def _no_driver() -> None:
    """What a CUDA build of torch raises where no GPU is (CI's ``newest`` job)."""
    raise RuntimeError(
        "Found no NVIDIA driver on your system (hidden from this test: it is not marked gpu)"
    )


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts with no allocator env, no kill switch, no hybridmem state."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    if not _CUDA_INITIALIZED():  # for real: a hidden test is always told "no"
        _reset_real_torch_settings()
        _as_started_with_the_env(monkeypatch)
    _reset_state_for_tests()
    _log.reset_once()
    capabilities._reset_for_tests()
    _probe_launch.discard_pending()
    ipc._reset_for_tests()
    backends.reset_registry()
    timeline._reset_for_tests()
    monkeypatch.delenv("HYBRIDMEM_BACKEND", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    yield
    _probe_launch.discard_pending()
    timeline._reset_for_tests()
    _reset_state_for_tests()
    if not _CUDA_INITIALIZED():  # for real: a hidden test's answer is always "no"
        _reset_real_torch_settings()


def patch_seam(monkeypatch: pytest.MonkeyPatch, name: str, value: object) -> None:
    """Replace a seam function on the face and wherever a seam module bound it.

    Callers outside the seam call through the face (``_torch.name``); seam modules
    that use each other's functions bound them at import, so those are patched too.
    Every seam module is imported first: one imported lazily while a patch is in
    force would bind the fake for the rest of the session (``pin_host_tensor`` kept a
    fake ``cuda_available`` after a FakeTorch test, and later tests reached CUDA).
    """
    for module_name in sorted(set(_torch._LAZY.values())):
        importlib.import_module(module_name)
    original = getattr(_torch, name)
    monkeypatch.setattr(_torch, name, value)
    for module in (sys.modules[m] for m in list(sys.modules) if m.startswith("hybridmem._torch.")):
        if getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, value)


def fail_resizes(
    monkeypatch: pytest.MonkeyPatch,
    *,
    frees: tuple[int, ...] = (),
    allocations: tuple[int, ...] = (),
) -> Any:
    """Make the numbered frees and allocations (from 1) of storages fail; return the real one.

    Wraps whatever ``_torch.resize_storage`` is now (a fixture's recording fake too).
    """
    real = _torch.resize_storage
    calls = {"frees": 0, "allocations": 0}

    def flaky(storage: torch.UntypedStorage, nbytes: int) -> None:
        kind = "allocations" if nbytes else "frees"
        calls[kind] += 1
        if calls[kind] in (allocations if nbytes else frees):
            raise RuntimeError(f"injected: the driver refused ({kind})")
        real(storage, nbytes)

    patch_seam(monkeypatch, "resize_storage", flaky)
    return real


@dataclass
class FakeDevice:
    allocated: int = 0
    reserved: int = 0
    total: int = 80 << 30
    other: int = 1 << 30  # context and other processes

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.other


@dataclass
class FakeTorch:
    """A stand-in for the seam: records calls in order and fakes memory."""

    events: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    last: str | None = None  # None: what torch reports before any change (the env string)
    initialized: bool = False
    current: int = 0
    devices: dict[int, FakeDevice] = field(default_factory=dict)
    backend: str = "native"
    has_setter: bool = True
    reject: set[str] = field(default_factory=set)
    reject_next: int = 0  # refuse the next N strings, whatever they are
    gc_results: list[int] = field(default_factory=list)
    gc_frees: list[int] = field(default_factory=list)
    torch_state: dict[str, str] = field(default_factory=dict)  # simulated torch config
    # The fake is a CUDA build of torch 2.13, whatever torch runs the tests (CI's jobs
    # run 2.4.1 to the newest): a test of other rules says which version it means.
    version: tuple[int, int] = (2, 13)
    half_apply: bool = True  # a rejected string leaves its first item applied, as torch does
    env_read: bool = False  # torch_state holds the env string (read on first use, as torch)
    private_pools: list[tuple[int, int]] = field(default_factory=list)  # (address, size)
    allocator_snapshot: dict[str, Any] | None = None  # what the seam's snapshot() returns
    sees: bool = True  # whether the seam can see strings set outside hybridmem (2.12+)
    # torch 2.10 - 2.11's way of seeing writes: every caller reaches torch's setter by
    # its name on ``owner`` (as ``torch._C._accelerator_setAllocatorSettings``), and
    # hybridmem reads what the watch noted there (see :meth:`watch_writes`)
    owner: Any = None
    watch: Any = None

    @property
    def rules(self) -> TorchRules:
        return TorchRules(self.version)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        patches: dict[str, Any] = {
            "set_allocator_settings": self.set_allocator_settings,
            "last_allocator_settings": self.last_allocator_settings,
            "sees_settings_writes": lambda: self.sees,
            "settings_setter_name": lambda: "fake.setter" if self.has_setter else None,
            "torch_version": lambda: self.version,
            "runtime_allocator_backend": lambda: self.backend,
            "cuda_initialized": lambda: self.initialized,
            "cuda_built": lambda: True,
            "cuda_available": lambda: True,
            "device_count": lambda: max(len(self.devices), 1),
            "current_device": lambda: self.current if self.initialized else None,
            "has_context": lambda i: self.initialized and i in self.devices,
            "initialized_devices": lambda: sorted(self.devices) if self.initialized else [],
            "synchronize": lambda i: self.events.append(f"sync:{i}"),
            "empty_cache": self.empty_cache,
            "ipc_collect": lambda: self.events.append("ipc_collect"),
            "clear_blas_workspaces": lambda: True,
            "memory_stats": self.memory_stats,
            "mem_get_info": self.mem_get_info,
            "private_pool_ranges": lambda i: list(self.private_pools),
            "snapshot": lambda: self.allocator_snapshot,
        }
        for name, value in patches.items():
            patch_seam(monkeypatch, name, value)
        monkeypatch.setattr(gc, "collect", self.gc_collect)

    def watch_writes(self) -> None:
        """See writes as hybridmem does on torch 2.10 - 2.11: by the name every caller uses.

        Writers (hybridmem's seam and the stand-ins) then call ``owner.setter``, which is
        torch's (this fake's) until hybridmem's first read starts the watch, and the
        watch's wrapper from then on; hybridmem reads what the watch noted.
        """
        from hybridmem._torch.write_watch import WriteWatch

        self.owner = types.SimpleNamespace(setter=self.torch_setter)
        self.watch = WriteWatch(self.owner, "setter", self.true_last)

    def true_last(self) -> str | None:
        """The last string torch parsed, as its snapshot says (the watch's first read)."""
        if not self.sees:
            return None
        if self.last is not None:
            return self.last
        name, _ = self.rules.env_variable(os.environ)
        return os.environ[name] if name is not None else ""

    def torch_setter(self, text: str) -> None:
        """torch's binding: refuses with ValueError (the seam maps it)."""
        from hybridmem import AllocatorSettingsError

        try:
            self.apply(text)
        except AllocatorSettingsError as exc:
            raise ValueError(str(exc)) from None

    def set_allocator_settings(self, text: str) -> bool:
        """The seam's setter: torch's, reached by its name where writes are watched."""
        if self.owner is None or not self.has_setter:
            return self.apply(text)
        from hybridmem import AllocatorSettingsError

        try:
            self.owner.setter(text)
        except ValueError as exc:
            raise AllocatorSettingsError(str(exc)) from None
        return True

    def apply(self, text: str) -> bool:
        """What torch's setter does, by the model of its parser (and ``reject`` on top)."""
        if not self.has_setter:
            return False
        from hybridmem import AllocatorSettingsError

        self.read_env()
        outcome = self.rules.run(text)
        items = list(outcome.items)
        rejected = text in self.reject or self.reject_next > 0
        self.reject_next = max(self.reject_next - 1, 0)
        refused = rejected or not outcome.accepted
        if rejected and self.half_apply:
            items = items[:1]  # torch had read part of the string when it stopped
        elif refused:
            items = items[: max(len(items) - 1, 0)]
        self.last = text
        for key in self.rules.reset_keys:
            self.torch_state.pop(key, None)
        for key, value in items:
            self.torch_state[key] = value
        if refused:
            self.events.append(f"refused:{text}")
            raise AllocatorSettingsError(f"torch rejected the allocator settings {text!r}: fake")
        self.events.append(f"set:{text}")
        self.applied.append(text)
        return True

    def meaning(self) -> dict[str, object]:
        """What ``torch_state`` means to torch (defaults filled in; text-independent)."""
        text = ",".join(f"{k}:{v}" for k, v in self.torch_state.items())
        return self.rules.run(text).state

    def read_env(self) -> None:
        """Load the env string torch reads into ``torch_state`` (once, like torch)."""
        if self.env_read:
            return
        self.env_read = True
        name, _ = self.rules.env_variable(os.environ)
        if name is not None and not self.torch_state:
            outcome = self.rules.run(os.environ[name])
            self.torch_state.update(dict(outcome.items))

    def last_allocator_settings(self) -> str | None:
        if self.watch is not None and self.sees:
            last: str | None = self.watch.last()
            return last
        return self.true_last()

    def empty_cache(self) -> None:
        self.events.append("empty_cache")
        for dev in self.devices.values():
            dev.reserved = dev.allocated

    def gc_collect(self, generation: int = 2) -> int:
        self.events.append("gc" if generation >= 2 else f"gc:{generation}")
        found = self.gc_results.pop(0) if self.gc_results else 0
        freed = self.gc_frees.pop(0) if self.gc_frees else 0
        for dev in self.devices.values():
            dev.allocated -= min(freed, dev.allocated)
        return found

    def memory_stats(self, index: int) -> dict[str, Any]:
        dev = self.devices[index]
        return {
            "allocated_bytes.all.current": dev.allocated,
            "reserved_bytes.all.current": dev.reserved,
            "active_bytes.all.current": dev.allocated,
            "inactive_split_bytes.all.current": (dev.reserved - dev.allocated) // 4,
            "allocated_bytes.all.peak": dev.allocated * 2,
            "reserved_bytes.all.peak": dev.reserved * 2,
        }

    def mem_get_info(self, index: int) -> tuple[int, int]:
        dev = self.devices[index]
        return dev.free, dev.total

    def set_strings(self) -> list[str]:
        return [e[4:] for e in self.events if e.startswith("set:")]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    """A fake torch seam with no CUDA initialised (set ``fake.initialized``)."""
    fake_torch = FakeTorch()
    fake_torch.install(monkeypatch)
    return fake_torch


def on_a_gpu(fake: FakeTorch) -> FakeTorch:
    """``fake`` with CUDA initialised on device 0: 80 GiB, 2 GiB allocated, 10 reserved.

    For a process outside pytest's fixtures too (a rank of ``tests/gloo_planned.py``).
    """
    fake.initialized = True
    fake.devices[0] = FakeDevice(allocated=2 << 30, reserved=10 << 30)
    return fake


@pytest.fixture
def fake_gpu(fake: FakeTorch) -> FakeTorch:
    """The fake seam with CUDA initialised on device 0 (:func:`on_a_gpu`)."""
    return on_a_gpu(fake)


#: What `training` puts in the env: expandable segments on, and settings of the user's own.
TRAINING_ENV = "expandable_segments:True,max_split_size_mb:256,garbage_collection_threshold:0.6"


@pytest.fixture
def training(fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    """A process that trains with expandable segments on, from the env."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", TRAINING_ENV)
    _reset_state_for_tests()  # as if the process had started with it
    return fake_gpu


def treat_cpu_as_device() -> list[int]:
    """Make the seam treat CPU tensors as device tensors and record pinning (any process)."""
    pinned: list[int] = []
    _torch.is_device_tensor = lambda t: t.device.type in ("cpu", "meta")  # type: ignore[assignment]

    def pin(tensor: torch.Tensor, *, mapped: bool = False) -> bool:
        pinned.append(tensor.numel())
        return True

    _torch.pin_host_tensor = pin
    _torch.unpin_host_tensor = lambda ptr: pinned.append(-1)  # type: ignore[assignment]
    return pinned


@pytest.fixture
def cpu_as_device(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Treat CPU tensors as device tensors; record pinning instead of calling CUDA."""
    for name in ("is_device_tensor", "pin_host_tensor", "unpin_host_tensor"):
        monkeypatch.setattr(_torch, name, getattr(_torch, name))  # restored after the test
    return treat_cpu_as_device()


def settings_of(text: str) -> dict[str, str]:
    """``{key: value}`` of a settings string, as the torch here reads it."""
    return parse_settings(text, TorchRules(_torch.torch_version()))


def fresh_state() -> dict[str, object]:
    """torch's default settings (this torch's version, a CUDA build)."""
    return default_state(_torch.torch_version())


@pytest.fixture
def cpu_mapping(cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pool's "device mapping" is the pool; each kernel copy's length is recorded."""
    copies: list[int] = []
    real = _torch.copy_by_kernel

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        copies.append(dst.numel())
        real(dst, src)

    monkeypatch.setattr(_torch, "host_device_view", lambda host, device: host)
    monkeypatch.setattr(_torch, "copy_by_kernel", copy)
    return copies


@pytest.fixture
def pipe() -> Iterator[tuple[Connection, Connection]]:
    """Both ends of a ``multiprocessing.Pipe()``, closed after the test."""
    a, b = mp.Pipe()
    yield a, b
    a.close()
    b.close()
