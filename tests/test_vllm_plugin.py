"""The vLLM entry point against stand-in vLLMs: each backend registered where its factory is.

A real vLLM's factories are checked in CI's vllm job (tests/vllm/); here the stand-ins
say what a vLLM without one of them gets: the other backend, and one line per process
naming the release that has it.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hybridmem import _log
from hybridmem.integrations.vllm import plugin


class Factory:
    """vLLM's factories' registration (``register_backend`` / ``register_engine``)."""

    def __init__(self) -> None:
        self.registry: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module: str, cls: str) -> None:
        if name in self.registry:
            raise ValueError(f"'{name}' is already registered.")
        self.registry[name] = (module, cls)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., dict[str, Factory]]]:
    """A stand-in ``vllm`` with the factories asked for."""
    monkeypatch.setenv("HYBRIDMEM_VERL", "")
    _log.reset_once()

    def make(sleep: bool, transfer: bool) -> dict[str, Factory]:
        made: dict[str, Factory] = {}
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
        for name in ("vllm.device_allocator", "vllm.distributed"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        if sleep:
            made["sleep"] = Factory()
            module = types.ModuleType("vllm.device_allocator.sleep_mode_backend")
            module.SleepModeBackendFactory = types.SimpleNamespace(  # type: ignore[attr-defined]
                register_backend=made["sleep"].register
            )
            module.SleepModeBackend = types.SimpleNamespace(  # type: ignore[attr-defined]
                state=None, discard=None, resume=None
            )
            monkeypatch.setitem(sys.modules, module.__name__, module)
        else:  # a vLLM before its backends: the import fails
            monkeypatch.setitem(sys.modules, "vllm.device_allocator.sleep_mode_backend", None)
        if transfer:
            made["engine"], made["trainer"] = Factory(), Factory()
            module = types.ModuleType("vllm.distributed.weight_transfer.factory")
            module.WeightTransferEngineFactory = types.SimpleNamespace(  # type: ignore[attr-defined]
                register_engine=made["engine"].register
            )
            module.WeightTransferTrainerFactory = types.SimpleNamespace(  # type: ignore[attr-defined]
                register_engine=made["trainer"].register
            )
            monkeypatch.setitem(
                sys.modules, "vllm.distributed.weight_transfer", types.ModuleType("w")
            )
            monkeypatch.setitem(sys.modules, module.__name__, module)
        else:
            monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", None)
        return made

    yield make
    _log.reset_once()


def _lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def test_both_factories_get_their_backend_once(stand_in: Any) -> None:
    made = stand_in(sleep=True, transfer=True)
    assert plugin.register() is True
    assert made["sleep"].registry == {
        "hybridmem": ("hybridmem.integrations.vllm.sleep_backend", "HybridmemSleepModeBackend")
    }
    assert made["engine"].registry["hybridmem"][1] == "HybridmemWeightTransferEngine"
    assert made["trainer"].registry["hybridmem"][1] == "HybridmemTrainerWeightTransferEngine"
    assert plugin.register() is False  # vLLM may load its plugins twice in a process


def test_a_vllm_without_the_sleep_factory_gets_the_rest_and_one_line(
    stand_in: Any, caplog: pytest.LogCaptureFixture
) -> None:
    made = stand_in(sleep=False, transfer=True)
    with caplog.at_level(logging.INFO, logger="hybridmem"):
        assert plugin.register() is True
        plugin.register()
    assert "hybridmem" in made["engine"].registry
    said = _lines(caplog, "sleep-mode backend needs vLLM 0.33")
    assert len(said) == 1
    assert "--sleep-mode-backend hybridmem is not available" in said[0]


def test_a_vllm_with_only_the_sleep_factory_gets_it_and_one_line(
    stand_in: Any, caplog: pytest.LogCaptureFixture
) -> None:
    made = stand_in(sleep=True, transfer=False)
    with caplog.at_level(logging.INFO, logger="hybridmem"):
        assert plugin.register() is True
        assert plugin.register() is False
    assert "hybridmem" in made["sleep"].registry
    assert len(_lines(caplog, "weight-transfer backend needs vLLM 0.32 or later")) == 1


def test_a_factory_of_another_shape_is_left_alone_with_one_line(
    stand_in: Any, caplog: pytest.LogCaptureFixture
) -> None:
    made = stand_in(sleep=True, transfer=True)
    backends = sys.modules["vllm.device_allocator.sleep_mode_backend"]
    del backends.SleepModeBackend.discard  # an earlier interface
    with caplog.at_level(logging.INFO, logger="hybridmem"):
        assert plugin.register() is True  # the weight-transfer backend still
    assert made["sleep"].registry == {}
    assert len(_lines(caplog, "has another: --sleep-mode-backend hybridmem is not")) == 1
    backends.SleepModeBackend.discard = None
    backends.SleepModeBackendFactory.register_backend = lambda name: None  # other arguments
    _log.reset_once()
    with caplog.at_level(logging.INFO, logger="hybridmem"):
        plugin.register()
    assert len(_lines(caplog, "refused it")) == 1
