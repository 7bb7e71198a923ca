"""What a test not marked ``gpu`` sees on a GPU host: no GPU, and nothing initialised.

The suite runs on GPU hosts too (``pytest -n auto`` there): a ``gpu`` test earlier in a
worker initialises CUDA for the worker's life, and the CPU tests after it must still
take their CPU paths. These tests play that history with torch's own flag
(``torch.cuda._initialized``, what a real initialisation sets) and check the hiding
and the check that names a hidden test reaching the driver.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem import _torch
from hybridmem._torch import device as _torch_device
from tests.conftest import _CUDA_INITIALIZED, check_cuda_still_hidden, hide_cuda


def _as_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an earlier ``gpu`` test leaves behind: a CUDA build, initialised for real."""
    monkeypatch.setattr(_torch_device, "_CUDA_BUILT", True)
    monkeypatch.setattr(torch.cuda, "_initialized", True)
    # torch's own function (this test's fixture has hidden the attribute on a CUDA build)
    monkeypatch.setattr(_torch_device, "_IS_INITIALIZED", _CUDA_INITIALIZED)


def test_a_hidden_test_sees_cuda_uninitialised_after_a_gpu_test_initialised_it() -> None:
    with pytest.MonkeyPatch.context() as earlier:
        _as_initialised(earlier)
        assert _torch.cuda_initialized()  # the worker's real state, unhidden
        with pytest.MonkeyPatch.context() as hidden:
            hide_cuda(hidden)
            assert not _torch.cuda_initialized()
            assert _torch.current_device() is None  # not a driver call that fails
            assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            assert not torch.cuda.is_available()
            assert torch.cuda.device_count() == 0
        assert _torch.cuda_initialized()  # the hiding undone, the real state back


def test_hiding_cannot_let_cuda_initialise() -> None:
    with pytest.MonkeyPatch.context() as earlier:
        earlier.setattr(_torch_device, "_CUDA_BUILT", True)
        earlier.setattr(_torch_device, "cuda_built", lambda: True)
        earlier.setattr(_torch, "cuda_built", lambda: True)
        with pytest.MonkeyPatch.context() as hidden:
            hide_cuda(hidden)
            with pytest.raises(RuntimeError, match="hidden from this test"):
                torch.cuda.init()  # type: ignore[no-untyped-call]


def test_a_hidden_test_that_initialises_cuda_fails_by_name() -> None:
    with pytest.raises(pytest.fail.Exception, match="test_x initialised CUDA though"):
        check_cuda_still_hidden(False, True, "tests/test_a.py::test_x")
    check_cuda_still_hidden(False, False, "tests/test_a.py::test_x")
    check_cuda_still_hidden(True, True, "tests/test_a.py::test_x")  # an earlier test's
