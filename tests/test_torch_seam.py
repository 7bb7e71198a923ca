"""The torch seam: version guards, setter selection, error mapping."""

from __future__ import annotations

import types
import warnings
from typing import Any

import pytest
import torch

from hybridmem import AllocatorSettingsError, _torch
from hybridmem._torch import settings as torch_settings
from hybridmem._torch import version as torch_version_module
from hybridmem._torch.write_watch import WriteWatch


def test_version_parsing() -> None:
    assert torch_version_module._parse_version("2.11.0+cu130") == (2, 11)
    assert torch_version_module._parse_version("2.4.1") == (2, 4)
    assert torch_version_module._parse_version("2.13.0a0+git123") == (2, 13)
    assert _torch.torch_version() >= (2, 4)
    assert _torch.torch_version_string() == torch.__version__


def _fake_c(monkeypatch: pytest.MonkeyPatch, **attrs: object) -> types.SimpleNamespace:
    fake_c = types.SimpleNamespace(**attrs)
    monkeypatch.setattr(torch, "_C", fake_c)
    return fake_c


def test_new_setter_is_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _fake_c(monkeypatch, _accelerator_setAllocatorSettings=calls.append)
    assert _torch.settings_setter_name() == "torch._C._accelerator_setAllocatorSettings"
    assert _torch.set_allocator_settings("expandable_segments:True") is True
    assert calls == ["expandable_segments:True"]


@pytest.mark.parametrize("torch_error", [ValueError, RuntimeError])
def test_both_torch_errors_map_to_one(
    monkeypatch: pytest.MonkeyPatch, torch_error: type[Exception]
) -> None:
    def reject(text: str) -> None:
        raise torch_error("Expected 'True' or 'False'\nmore torch text")

    _fake_c(monkeypatch, _accelerator_setAllocatorSettings=reject)
    with pytest.raises(AllocatorSettingsError, match=r"expandable_segments:maybe.*Expected 'True'"):
        _torch.set_allocator_settings("expandable_segments:maybe")


def test_old_setter_without_leaking_its_future_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def old(text: str) -> None:
        warnings.warn("deprecated", FutureWarning, stacklevel=2)
        calls.append(text)

    _fake_c(monkeypatch, _cuda_cudaCachingAllocator_set_allocator_settings=old)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", old)
    monkeypatch.setattr(torch_settings, "_OLD_NAME_WARNS", True)  # a 2.10+ build without the new
    assert _torch.settings_setter_name() == "torch.cuda.memory._set_allocator_settings"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _torch.set_allocator_settings("expandable_segments:False") is True
    assert calls == ["expandable_segments:False"]


def test_old_cpu_build_without_binding_has_no_setter(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_c(monkeypatch)
    monkeypatch.setattr(torch_settings, "torch_version", lambda: (2, 6))
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda text: None)
    assert _torch.settings_setter_name() is None
    assert _torch.set_allocator_settings("expandable_segments:False") is False


def test_getter_only_where_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_settings, "_GETTER_FN", None)
    assert _torch.last_allocator_settings() is None
    monkeypatch.setattr(torch_settings, "_GETTER_FN", lambda: "expandable_segments:True")
    assert _torch.last_allocator_settings() == "expandable_segments:True"


def test_without_the_getter_torch_2_10_to_2_11_see_writes_where_they_are_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.10 - 2.11: the string in force read once from the snapshot, then noted at
    torch's setter for every caller that looks it up; older torch says nothing."""
    calls: list[str] = []

    def setter(text: str) -> None:
        if "bad" in text:
            raise ValueError("torch refuses it")
        calls.append(text)

    fake_c = _fake_c(monkeypatch, _accelerator_setAllocatorSettings=setter)
    snapshots: list[int] = []

    def snapshot() -> dict[str, Any]:
        snapshots.append(1)
        return {"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}}

    watch = WriteWatch(fake_c, torch_settings.NEW_SETTER, torch_settings._snapshot_settings_string)
    monkeypatch.setattr(torch_settings, "_GETTER_FN", None)
    monkeypatch.setattr(torch_settings, "_WATCHED", True)
    monkeypatch.setattr(torch_settings, "_WATCH", watch)
    monkeypatch.setattr(torch_settings, "snapshot", snapshot)
    monkeypatch.setattr(torch_settings, "cuda_initialized", lambda: False)
    assert _torch.last_allocator_settings() is None  # no CUDA yet: no snapshot, no string
    assert _torch.sees_settings_writes() is False
    assert not _torch.settings_writes_watched()
    monkeypatch.setattr(torch_settings, "cuda_initialized", lambda: True)
    assert _torch.sees_settings_writes() is True
    assert _torch.last_allocator_settings() == "expandable_segments:False"  # the string in force
    assert _torch.settings_writes_watched()
    assert fake_c._accelerator_setAllocatorSettings is not setter  # the watch is in place
    # hybridmem's own write and another library's (looked up by name, as vLLM and verl do)
    assert _torch.set_allocator_settings("expandable_segments:True") is True
    assert _torch.last_allocator_settings() == "expandable_segments:True"
    fake_c._accelerator_setAllocatorSettings("max_split_size_mb:64")
    assert _torch.last_allocator_settings() == "max_split_size_mb:64"
    assert calls == ["expandable_segments:True", "max_split_size_mb:64"]
    # torch notes a string before parsing it: a refused one is the last string too
    with pytest.raises(AllocatorSettingsError, match="torch refuses it"):
        _torch.set_allocator_settings("bad:1")
    assert _torch.last_allocator_settings() == "bad:1"
    assert len(snapshots) == 2  # when the watch started (before and after): never on the hot path
    _torch.stop_watching_settings_writes()
    assert fake_c._accelerator_setAllocatorSettings is setter  # torch's own back
    monkeypatch.setattr(torch_settings, "_WATCHED", False)  # torch <= 2.9: nothing to read
    assert _torch.last_allocator_settings() is None


def test_where_the_watch_cannot_start_every_read_is_a_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reference to torch's setter bound before the watch started bypasses it: snapshots."""
    calls: list[str] = []
    fake_c = _fake_c(monkeypatch, _accelerator_setAllocatorSettings=calls.append)
    bound_early = {"set_settings": fake_c._accelerator_setAllocatorSettings}  # a module's import
    state = {"last": ""}

    def snapshot() -> dict[str, Any]:
        return {"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": state["last"]}}

    watch = WriteWatch(fake_c, torch_settings.NEW_SETTER, torch_settings._snapshot_settings_string)
    for name, value in (
        ("_GETTER_FN", None), ("_WATCHED", True), ("_WATCH", watch), ("snapshot", snapshot),
        ("cuda_initialized", lambda: True),
    ):  # fmt: skip
        monkeypatch.setattr(torch_settings, name, value)
    assert _torch.last_allocator_settings() == ""
    assert not _torch.settings_writes_watched()
    assert watch.captured == ("a dict ('set_settings')",)
    bound_early["set_settings"]("expandable_segments:True")
    state["last"] = "expandable_segments:True"  # what torch's snapshot now says
    assert _torch.last_allocator_settings() == "expandable_segments:True"  # seen all the same
    assert _torch.sees_settings_writes() is True


def test_torch_refusals_of_every_kind_become_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch raises ValueError, RuntimeError (INTERNAL ASSERT) or IndexError (out_of_range)."""
    from hybridmem import AllocatorSettingsError

    for error in (ValueError("bad"), RuntimeError("INTERNAL ASSERT FAILED"), IndexError("stoull")):

        def refuse(text: str, error: Exception = error) -> None:
            raise error

        monkeypatch.setattr(torch_settings, "_new_setter", lambda refuse=refuse: refuse)
        with pytest.raises(AllocatorSettingsError, match="torch rejected the allocator settings"):
            _torch.set_allocator_settings("x:1")
        monkeypatch.setattr(torch_settings, "_GETTER_FN", lambda refuse=refuse: refuse(""))
        with pytest.raises(AllocatorSettingsError, match="torch refuses the allocator settings"):
            _torch.last_allocator_settings()


def test_cpu_build_state_never_touches_cuda() -> None:
    if _torch.cuda_available():
        pytest.skip("CPU-only check")
    assert not _torch.cuda_initialized()
    assert _torch.initialized_devices() == []
    assert _torch.current_device() is None
    assert not _torch.has_context(0)
    assert _torch.memory_stats(0) == {}
    assert _torch.snapshot() is None
    assert _torch.snapshot_allocator_settings() is None
    _torch.empty_cache()
    _torch.ipc_collect()
    assert not _torch.cuda_initialized()


def _nested_stats() -> dict[str, Any]:
    """Counters shaped as torch's allocator reports them (torch 2.x)."""

    def pools(current: int) -> dict[str, dict[str, int]]:
        one = {"current": current, "peak": 2 * current, "allocated": 3 * current, "freed": 1}
        return {"all": one, "small_pool": dict(one, current=1), "large_pool": dict(one, peak=7)}

    return {
        "allocated_bytes": pools(5 << 20),
        "reserved_bytes": pools(8 << 20),
        "active_bytes": pools(5 << 20),
        "inactive_split_bytes": pools(1 << 20),
        "requested_bytes": pools(4 << 20),
        "segment": pools(3),
        "oversize_allocations": {"current": 0, "peak": 1, "allocated": 2, "freed": 2},
        "num_alloc_retries": 0,
        "num_ooms": 1,
        "max_split_size": -1,
    }


def test_memory_stats_read_as_torch_names_them_without_the_pool_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Torch's own flattening is the judge: every value it gives for all pools, the same."""
    nested = _nested_stats()
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device: nested)
    monkeypatch.setattr(_torch.device, "cuda_initialized", lambda: True)
    theirs = dict(torch.cuda.memory_stats(0))
    ours = _torch.memory_stats(0)
    pools = {"small_pool", "large_pool"}
    wanted = {k: v for k, v in theirs.items() if not pools & set(k.split("."))}
    assert ours == wanted
    assert ours["allocated_bytes.all.current"] == 5 << 20
    assert ours["oversize_allocations.peak"] == 1
    assert len(theirs) > len(ours)  # the pools' halves, left out


def test_memory_stats_without_the_nested_reading_falls_back_to_torchs_flat_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch.cuda.memory, "memory_stats_as_nested_dict")
    monkeypatch.setattr(_torch.device, "cuda_initialized", lambda: True)
    flat = {"allocated_bytes.all.current": 3}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda index: flat)
    assert _torch.memory_stats(0) == {"allocated_bytes.all.current": 3}


def test_api_report_lists_every_guarded_api() -> None:
    report = _torch.api_report()
    assert set(report) >= {
        "torch._C._accelerator_setAllocatorSettings",
        "torch.cuda.memory._set_allocator_settings",
        "torch._C._accelerator_getAllocatorSettings",
        "torch._C._cuda_hasPrimaryContext",
    }
    assert all(isinstance(v, bool) for v in report.values())


def test_nonzero_static_and_its_fallback_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's nonzero_static where it exists; a cumsum + scatter where it does not."""
    from hybridmem._torch import tensors

    flags = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    cases = {3: [1, 2, 4], 4: [1, 2, 4, 7], 6: [1, 2, 4, 7, 0, 0], 0: []}
    for size, want in cases.items():
        assert _torch.nonzero_static(flags, size).tolist() == want

    def missing(*args: object, **kwargs: object) -> torch.Tensor:
        raise NotImplementedError("no kernel for this device")

    monkeypatch.setattr(torch, "nonzero_static", missing)
    monkeypatch.setattr(tensors, "_STATIC_NONZERO", {})
    for size, want in cases.items():
        assert _torch.nonzero_static(flags, size).tolist() == want
    assert tensors._STATIC_NONZERO == {"cpu": False}  # asked once, then remembered


def test_block_bytes_rounds_as_the_caching_allocator() -> None:
    from hybridmem._torch import blocks

    assert [blocks.block_bytes(n) for n in (0, 1, 512, 513, 1 << 20)] == [
        512,
        512,
        512,
        1024,
        1 << 20,
    ]


def test_private_pool_ranges_reads_the_snapshots_pool_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridmem._torch import blocks

    segments = [
        {"device": 0, "address": 4096, "total_size": 2 << 20, "segment_pool_id": (0, 0)},
        {"device": 0, "address": 1 << 30, "total_size": 20 << 20, "segment_pool_id": (1, 3)},
        {"device": 1, "address": 1 << 31, "total_size": 2 << 20, "segment_pool_id": [0, 7]},
        {"device": 0, "address": 1 << 32, "total_size": 2 << 20},  # an older snapshot
    ]
    monkeypatch.setattr(blocks, "snapshot", lambda: {"segments": segments})
    assert blocks.private_pool_ranges(0) == [(1 << 30, 20 << 20)]
    assert blocks.private_pool_ranges(1) == [(1 << 31, 2 << 20)]
    monkeypatch.setattr(blocks, "snapshot", lambda: None)  # CUDA not initialised
    assert blocks.private_pool_ranges(0) == []


def test_the_cuda_tensor_rebuild_takes_the_device_where_the_seam_puts_it() -> None:
    """``import_cuda_tensor`` replaces argument 6 of torch's rebuild: still the device?

    Checked on the installed torch (each CI job: the newest, the CPU build, the oldest),
    without a GPU: a torch that moved or added an argument would otherwise open a
    consumer's storage on a wrong device, or fail only on a GPU.
    """
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from hybridmem._torch import ipc

    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(names) == ipc._REBUILD_ARG_COUNT, names
    assert names[ipc._REBUILD_DEVICE_ARG] == "storage_device", names


def test_a_patched_seam_is_restored_in_every_seam_module_after_the_test() -> None:
    """No seam module is first imported while a fake is in force (it would keep the fake)."""
    import sys

    from hybridmem._torch import device
    from tests.conftest import patch_seam

    real = device.cuda_available
    with pytest.MonkeyPatch.context() as patched:
        patch_seam(patched, "cuda_available", lambda: True)
        assert all(name in sys.modules for name in set(_torch._LAZY.values()))
    for name in set(_torch._LAZY.values()):
        bound = getattr(sys.modules[name], "cuda_available", real)
        assert bound is real, name
