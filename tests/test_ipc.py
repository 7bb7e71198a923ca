"""ipc_safe, ipc_shareable and allow_ptrace_from_any against the fake seam."""

from __future__ import annotations

import asyncio
import errno
import logging
import weakref
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

import hybridmem as hm
from hybridmem import _torch
from hybridmem._platform import linux as _linux
from hybridmem.ipc import capabilities
from hybridmem.ipc import shareable as ipc
from hybridmem.scopes.ipc_safe import note_probe
from tests.conftest import FakeTorch, patch_seam


def expandable_now() -> bool:
    return hm.allocator_state().expandable_segments


# --------------------------------------------------------------------------- #
# ipc_safe: the toggle contract
# --------------------------------------------------------------------------- #


def test_ipc_safe_turns_expandable_off_keeps_settings_and_restores(training: FakeTorch) -> None:
    with hm.ipc_safe() as scope:
        assert scope.transport == "cuda"
        assert training.torch_state["expandable_segments"] == "False"
        assert training.torch_state["max_split_size_mb"] == "256"
        assert training.torch_state["garbage_collection_threshold"] == "0.6"
        # cached expandable blocks were dropped before the switch
        assert training.events.index("empty_cache") < training.events.index(
            next(e for e in training.events if e.startswith("set:"))
        )
    assert training.torch_state["expandable_segments"] == "True"
    assert training.torch_state["max_split_size_mb"] == "256"


def test_ipc_safe_restores_on_error(training: FakeTorch) -> None:
    with pytest.raises(asyncio.CancelledError), hm.ipc_safe():
        raise asyncio.CancelledError
    assert expandable_now()
    assert training.torch_state["expandable_segments"] == "True"


def test_ipc_safe_nests(training: FakeTorch) -> None:
    with hm.ipc_safe():
        with hm.expandable_segments(True), hm.ipc_safe():
            assert not expandable_now()
        assert not expandable_now()
    assert expandable_now()


def test_ipc_safe_decorates_every_form(training: FakeTorch) -> None:
    seen: list[bool] = []

    @hm.ipc_safe()
    def fn() -> None:
        seen.append(expandable_now())

    @hm.ipc_safe()
    async def coro() -> None:
        await asyncio.sleep(0)
        seen.append(expandable_now())

    @hm.ipc_safe()
    def gen() -> Iterator[int]:
        seen.append(expandable_now())
        yield 1
        seen.append(expandable_now())

    @hm.ipc_safe()
    async def agen() -> AsyncIterator[int]:
        seen.append(expandable_now())
        yield 1

    @hm.ipc_safe()
    class Manager:
        def __enter__(self) -> Manager:
            seen.append(expandable_now())
            return self

        def __exit__(self, *exc: object) -> None:
            seen.append(expandable_now())

    fn()
    asyncio.run(coro())
    for _ in gen():
        seen.append(expandable_now())  # restored while the generator is suspended

    async def drain() -> None:
        async for _ in agen():
            seen.append(expandable_now())

    asyncio.run(drain())
    with Manager():
        seen.append(expandable_now())
    assert seen == [False, False, False, True, False, False, True, False, False, False]
    assert expandable_now()


def test_ipc_safe_kill_switch(training: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    with hm.ipc_safe():
        assert training.applied == []


# --------------------------------------------------------------------------- #
# ipc_safe: fallback
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("bad", ["never", "", "HOST"])
def test_bad_fallback_value(bad: str) -> None:
    with pytest.raises(ValueError, match="'auto', 'host', 'raise'"):
        hm.ipc_safe(fallback=bad)  # type: ignore[call-overload]


def test_bad_fallback_type() -> None:
    with pytest.raises(TypeError, match="fallback must be one of"):
        hm.ipc_safe(fallback=None)  # type: ignore[call-overload]


def test_async_backend_raise_leaves_allocator_alone(training: FakeTorch) -> None:
    training.backend = "cudaMallocAsync"
    with (
        pytest.raises(hm.IpcUnavailableError, match="cudaMallocAsync"),
        hm.ipc_safe(fallback="raise"),
    ):
        pass
    assert training.applied == []
    assert hm.allocator_state().scopes == ()


def test_async_backend_auto_warns_once_and_picks_host(training: FakeTorch) -> None:
    training.backend = "cudaMallocAsync"
    with pytest.warns(hm.HybridMemWarning) as record, hm.ipc_safe() as scope:
        assert scope.transport == "host"
    # one for the fallback, one from the allocator toggle that cannot act
    assert any("host shared memory" in str(w.message) for w in record)
    with hm.ipc_safe() as scope:  # no second warning (filterwarnings=error would raise)
        assert scope.transport == "host"


def test_host_fallback_is_always_host(training: FakeTorch) -> None:
    with hm.ipc_safe(fallback="host") as scope:
        assert scope.transport == "host"
        assert not expandable_now()


def test_no_setter_with_expandable_on_cannot_be_made_safe(training: FakeTorch) -> None:
    training.has_setter = False
    with (
        pytest.raises(hm.IpcUnavailableError, match="no allocator-settings setter"),
        hm.ipc_safe(fallback="raise"),
    ):
        pass


def test_cached_probe_failure_picks_host(
    training: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = capabilities._interpret(0, {"classic_ok": False, "classic_import_error": "boom"}, 0.1)
    note_probe(0, broken.classic_ipc, broken.reason)  # what ipc_capabilities() notes
    with pytest.raises(hm.IpcUnavailableError, match="boom"), hm.ipc_safe(fallback="raise"):
        pass
    scope = hm.ipc_safe()
    with pytest.warns(hm.HybridMemWarning, match="probe found CUDA IPC broken"):
        scope.__enter__()
    assert scope.transport == "host"
    scope.__exit__(None, None, None)


# --------------------------------------------------------------------------- #
# ipc_shareable
# --------------------------------------------------------------------------- #


class Segments:
    """Which tensors' storages count as classic; new ones follow the allocator mode.

    Keyed by address, and an address is forgotten when the tensor first seen there is
    collected: an allocator may hand the same address to the next tensor (the CPU's did,
    on a GPU host), which is then a new allocation in the mode of its time.
    """

    def __init__(self) -> None:
        self.kind: dict[int, bool | None] = {}
        self.next_lands_in_cached_expandable = 0
        self.queries = 0

    def query(self, tensor: torch.Tensor) -> bool | None:
        self.queries += 1
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self.kind:
            if self.next_lands_in_cached_expandable:
                self.next_lands_in_cached_expandable -= 1
                self.kind[ptr] = False
            else:
                self.kind[ptr] = not expandable_now()
            weakref.finalize(tensor, self.kind.pop, ptr, None)
        return self.kind[ptr]


@pytest.fixture
def segments(
    training: FakeTorch, cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> Segments:
    seg = Segments()
    monkeypatch.setattr(_torch, "is_legacy_ipc_capable", seg.query)
    return seg


def test_shareable_returns_classic_tensor_itself(segments: Segments, training: FakeTorch) -> None:
    with hm.expandable_segments(False):
        tensor = torch.arange(10.0)
        segments.query(tensor)
    applied = len(training.applied)
    assert hm.ipc_shareable(tensor) is tensor
    assert segments.queries == 2  # one driver query, nothing else
    assert len(training.applied) == applied


def test_shareable_copies_expandable_tensor_without_cache_release(
    segments: Segments, training: FakeTorch
) -> None:
    tensor = torch.arange(12.0).reshape(3, 4).requires_grad_(True)
    segments.query(tensor)  # allocated while expandable segments are on
    before = list(training.events)
    copy = hm.ipc_shareable(tensor)
    assert copy is not tensor
    assert torch.equal(copy, tensor.detach())
    assert copy.requires_grad
    assert copy.is_leaf
    assert segments.kind[copy.untyped_storage().data_ptr()] is True
    new = training.events[len(before) :]
    assert "empty_cache" not in new  # a cheap switch: no release was needed
    assert expandable_now()


@pytest.mark.parametrize("same_address", [False, True])
def test_shareable_retries_after_landing_in_cached_expandable_block(
    segments: Segments, training: FakeTorch, monkeypatch: pytest.MonkeyPatch, same_address: bool
) -> None:
    tensor = torch.ones(4)
    segments.query(tensor)
    if same_address:  # the retry's copy where the dropped one was, as allocators do
        arena = torch.empty(64)
        monkeypatch.setattr(ipc, "_safe_copy", lambda t: arena[: t.numel()].copy_(t))
    segments.next_lands_in_cached_expandable = 1
    copy = hm.ipc_shareable(tensor)
    assert segments.kind[copy.untyped_storage().data_ptr()] is True
    assert "empty_cache" in training.events


def test_shareable_gives_up_when_copies_keep_landing_wrong(
    segments: Segments, training: FakeTorch
) -> None:
    tensor = torch.ones(4)
    segments.query(tensor)
    segments.next_lands_in_cached_expandable = 2
    with pytest.raises(hm.IpcUnavailableError, match="host memory"):
        hm.ipc_shareable(tensor)
    assert expandable_now()


def test_shareable_without_driver_query_releases(
    training: FakeTorch, cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_torch, "is_legacy_ipc_capable", lambda t: None)
    tensor = torch.ones(4)
    copy = hm.ipc_shareable(tensor)
    assert copy is not tensor
    assert "empty_cache" in training.events  # unknown kind: release to be sure


def test_shareable_cpu_tensor_and_bad_input(training: FakeTorch) -> None:
    tensor = torch.ones(3)  # a real CPU tensor: shared through host memory by torch
    assert hm.ipc_shareable(tensor) is tensor
    with pytest.raises(TypeError, match=r"takes a torch\.Tensor"):
        hm.ipc_shareable([tensor])  # type: ignore[arg-type]


def test_shareable_under_async_backend(segments: Segments, training: FakeTorch) -> None:
    training.backend = "cudaMallocAsync"
    tensor = torch.ones(4)
    segments.kind[tensor.untyped_storage().data_ptr()] = False
    with pytest.raises(hm.IpcUnavailableError, match="cudaMallocAsync"):
        hm.ipc_shareable(tensor)


# --------------------------------------------------------------------------- #
# allow_ptrace_from_any
# --------------------------------------------------------------------------- #


def test_ptrace_opt_in_applies_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(_linux, "yama_ptrace_scope", lambda: 1)
    monkeypatch.setattr(_linux, "set_ptracer_any", lambda: calls.append(1))
    with caplog.at_level(logging.WARNING, logger="hybridmem"):
        assert hm.allow_ptrace_from_any()
        assert hm.allow_ptrace_from_any()
    assert calls == [1]
    assert "may now ptrace" in caplog.text


def test_ptrace_opt_in_without_yama(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_linux, "yama_ptrace_scope", lambda: None)
    assert not hm.allow_ptrace_from_any()


def test_ptrace_opt_in_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_linux, "yama_ptrace_scope", lambda: 3)
    monkeypatch.setattr(_linux, "set_ptracer_any", lambda: errno.EINVAL)
    with caplog.at_level(logging.WARNING, logger="hybridmem"):
        assert not hm.allow_ptrace_from_any()
    assert "EINVAL" in caplog.text
    assert not ipc._ptracer_set


def test_real_prctl_runs() -> None:
    if _linux.yama_ptrace_scope() is None:
        assert not hm.allow_ptrace_from_any()
    else:  # pragma: no cover - depends on the machine
        assert hm.allow_ptrace_from_any()


@pytest.mark.parametrize(
    ("built", "why"),
    [(False, "this torch is built without CUDA"), (True, "no CUDA device is visible")],
)
def test_ipc_safe_without_cuda_never_reports_cuda(
    training: FakeTorch, monkeypatch: pytest.MonkeyPatch, built: bool, why: str
) -> None:
    patch_seam(monkeypatch, "cuda_available", lambda: False)
    patch_seam(monkeypatch, "cuda_built", lambda: built)
    with pytest.raises(hm.IpcUnavailableError, match=why), hm.ipc_safe(fallback="raise"):
        pass
    assert hm.allocator_state().scopes == ()  # refused before anything changed
    # Without any CUDA device, host memory is all there is: taken without a warning
    # (HybridMemWarning is an error in this suite).
    with hm.ipc_safe() as scope:
        assert scope.transport == "host"
