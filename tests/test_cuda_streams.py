"""Side streams made with the driver, not torch's pool (issue #25), checked without a GPU.

The driver is faked: a ``libcuda`` whose calls record what they were given. The real
cost (no 70 MiB stream pool) is measured on the GPU (tests/gpu/test_offload_gpu.py),
where a process that made, used and dropped such streams must also exit cleanly.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import pytest
import torch

from hybridmem import _torch
from hybridmem._platform import cuda_driver, cuda_streams
from hybridmem._torch import tensors as seam_tensors


class FakeDriver:
    """The driver calls a stream needs; each returns ``result`` (0: CUDA_SUCCESS)."""

    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.calls: list[tuple[str, Any]] = []

    def _record(self, name: str, value: Any = None) -> int:
        self.calls.append((name, value))
        return self.result if name == "cuStreamCreate" else 0

    def cuDeviceGet(self, out: Any, index: Any) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = index.value
        return self._record("cuDeviceGet", index.value)

    def cuDevicePrimaryCtxRetain(self, out: Any, dev: Any) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0
        return self._record("retain", dev.value)

    def cuDevicePrimaryCtxRelease_v2(self, dev: Any) -> int:
        return self._record("release", dev.value)

    def cuCtxPushCurrent_v2(self, context: Any) -> int:
        return self._record("push", context.value)

    def cuCtxPopCurrent_v2(self, out: Any) -> int:
        return self._record("pop")

    def cuStreamCreate(self, out: Any, flags: Any) -> int:
        if self.result == 0:
            ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x5EED
        return self._record("cuStreamCreate", flags.value)

    def cuStreamDestroy_v2(self, stream: Any) -> int:
        return self._record("cuStreamDestroy_v2", stream.value)

    def cuGetErrorName(self, code: int, out: Any) -> int:
        return 1  # no name: "CUresult N"


class _Bindable:
    """ctypes functions carry ``restype``; the fake's bound methods need a place for it."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.restype: Any = None

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()

    class Lib:
        def __getattr__(self, name: str) -> Any:
            return _Bindable(getattr(fake, name))

    monkeypatch.setattr(cuda_driver, "libcuda", lambda: Lib())
    monkeypatch.setattr(cuda_driver, "_bound", {})
    return fake


def test_a_stream_is_made_non_blocking_in_the_primary_context(driver: FakeDriver) -> None:
    handle = cuda_streams.create_stream(3)
    assert handle == 0x5EED
    names = [name for name, _ in driver.calls]
    # The device's primary context is current for the call, and let go after it.
    expected = ["cuDeviceGet", "retain", "push", "cuStreamCreate", "pop", "cuDeviceGet", "release"]
    assert names == expected
    assert ("cuStreamCreate", cuda_streams.STREAM_NON_BLOCKING) in driver.calls
    assert ("cuDeviceGet", 3) in driver.calls


def test_a_refusing_or_missing_driver_gives_none(
    driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver.result = 2  # CUDA_ERROR_OUT_OF_MEMORY
    assert cuda_streams.create_stream(0) is None
    assert driver.calls[-1][0] == "release"  # the context is let go on failure too
    monkeypatch.setattr(cuda_driver, "libcuda", lambda: None)
    monkeypatch.setattr(cuda_driver, "_bound", {})
    assert cuda_streams.create_stream(0) is None


def test_the_seam_wraps_a_driver_stream_and_reuses_a_released_one_never_destroying_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[tuple[int, torch.device]] = []
    created: list[int] = []

    class External:
        def __init__(self, handle: int, device: torch.device) -> None:
            made.append((handle, device))
            self.cuda_stream = handle
            self.device = device

    def create(index: int) -> int:
        created.append(index)
        return 0x5EED + len(created)

    monkeypatch.setattr(cuda_streams, "create_stream", create)
    monkeypatch.setattr(seam_tensors, "_EXTERNAL_STREAM", External)
    monkeypatch.setattr(seam_tensors, "_SPARE_STREAMS", {})
    monkeypatch.setattr(seam_tensors, "_LENT_STREAMS", set())
    pooled: list[Any] = []
    monkeypatch.setattr(seam_tensors, "_CUDA_STREAM", pooled.append)
    first = _torch.new_stream(torch.device("cuda", 1))
    second = _torch.new_stream(torch.device("cuda", 1))
    assert isinstance(first, External)
    assert made == [(0x5EEE, torch.device("cuda", 1)), (0x5EEF, torch.device("cuda", 1))]
    assert not pooled  # torch's pool is never touched
    # Dropping a wrapper releases nothing (no finalizer: one crashed a process at exit).
    del second
    gc.collect()
    assert seam_tensors._SPARE_STREAMS == {1: []}
    _torch.release_stream(first)
    _torch.release_stream(first)  # twice: handed out once
    _torch.release_stream("not ours")  # torch's own streams are left alone
    # The released stream serves the next caller: no new one is made.
    third = _torch.new_stream(torch.device("cuda", 1))
    assert third.cuda_stream == 0x5EEE
    assert created == [1, 1]
    # Another device gets a stream of its own.
    _torch.new_stream(torch.device("cuda", 0))
    assert created == [1, 1, 0]
    assert _torch.new_stream(torch.device("cpu")) is None


def test_the_seam_falls_back_to_torchs_pool_where_the_driver_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda_streams, "create_stream", lambda index: None)
    monkeypatch.setattr(seam_tensors, "_SPARE_STREAMS", {})
    pooled: list[Any] = []

    def pool(device: torch.device) -> str:
        pooled.append(device)
        return "pool"

    monkeypatch.setattr(seam_tensors, "_CUDA_STREAM", pool)
    assert _torch.new_stream(torch.device("cuda", 0)) == "pool"
    assert pooled == [torch.device("cuda", 0)]
