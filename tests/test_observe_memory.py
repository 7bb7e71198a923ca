"""memory_info: counters, device figures, derived values, no context creation."""

from __future__ import annotations

import pytest

import hybridmem as hm
from tests.conftest import FakeDevice, FakeTorch

GiB = 1 << 30


def test_memory_info_figures(fake_gpu: FakeTorch) -> None:
    info = hm.memory_info()
    assert info.available
    assert info.device == 0
    assert info.allocated == 2 * GiB
    assert info.reserved == 10 * GiB
    assert info.cached == 8 * GiB
    assert info.inactive_split == 2 * GiB
    assert info.fragmentation == pytest.approx(0.2)
    assert info.peak_allocated == 4 * GiB
    assert info.peak_reserved == 20 * GiB
    assert info.total == 80 * GiB
    assert info.free == 80 * GiB - 10 * GiB - GiB
    assert info.non_torch == GiB  # context + other processes
    data = info.as_dict()
    assert data["non_torch"] == GiB
    assert data["cached"] == 8 * GiB
    text = str(info)
    assert "cuda:0" in text
    assert "inactive split" in text
    assert "20.0% of reserved" in text


def test_current_device_is_the_default(fake_gpu: FakeTorch) -> None:
    fake_gpu.devices[1] = FakeDevice(allocated=GiB, reserved=GiB)
    fake_gpu.current = 1
    assert hm.memory_info().device == 1
    assert hm.memory_info(0).device == 0
    assert hm.memory_info("cuda:1").reserved == GiB


def test_uninitialised_is_reported_not_created(fake: FakeTorch) -> None:
    info = hm.memory_info()
    assert not info.available
    assert info.free is None
    assert info.non_torch is None
    assert info.fragmentation == 0.0
    assert "not initialised" in str(info)
    assert hm.memory_info(0).device == 0
    assert fake.events == []


@pytest.mark.parametrize("device", ["all", -1, "cpu", 2.0])
def test_bad_device(fake_gpu: FakeTorch, device: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        hm.memory_info(device)  # type: ignore[arg-type]


def test_real_cpu_build_reports_unavailable() -> None:
    info = hm.memory_info()
    assert info.available is False
    assert info.device is None
