"""install() puts the drop-ins in verl's place, before or after verl imports them, and back.

verl's modules are stand-ins written to a temporary folder under verl's own module
names (verl and its dependencies are not installed here): the patching is what is
tested, the drop-ins' equivalence with verl's code is tests/test_verl_transfer.py's.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.integrations import sglang
from hybridmem.integrations.verl import allocator, install, transfer
from tests.conftest import FakeTorch

MODULES = {
    "verl/__init__.py": "",
    "verl/utils/__init__.py": "",
    "verl/utils/device.py": """
        calls = []
        def set_expandable_segments(enable):
            calls.append(enable)
    """,
    "verl/workers/__init__.py": "",
    "verl/workers/engine_workers.py": """
        from verl.utils.device import set_expandable_segments
        class ActorRolloutRefWorker:
            async def update_weights(self, global_steps=None, mode="auto"):
                set_expandable_segments(False)
                raise RuntimeError("the engine did not wake")
    """,
    "verl/workers/rollout/__init__.py": "",
    "verl/workers/rollout/vllm_rollout/__init__.py": "",
    "verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py": """
        class BucketedWeightSender: ...
        class BucketedWeightReceiver: ...
    """,
    "verl/workers/rollout/vllm_rollout/vllm_rollout.py": """
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import (
            BucketedWeightSender,
        )
    """,
    "verl/workers/rollout/sglang_rollout/__init__.py": "",
    "verl/workers/rollout/sglang_rollout/sglang_rollout.py": """
        async def sgl_update_weights(engine, params_batch, device_mesh_key, device_mesh):
            ...
        async def update_weights(self, weights):
            ...
    """,
}


@pytest.fixture
def fake_verl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name, text in MODULES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    install.uninstall()
    for name in list(sys.modules):
        if name == "verl" or name.startswith("verl."):
            del sys.modules[name]


def test_modules_imported_after_install_are_patched_as_they_load(fake_verl: Path) -> None:
    assert install.install() == []  # nothing of verl imported yet
    rollout = importlib.import_module("verl.workers.rollout.vllm_rollout.vllm_rollout")
    bucketed = sys.modules["verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"]
    assert rollout.BucketedWeightSender is transfer.BucketedWeightSender
    assert bucketed.BucketedWeightReceiver is transfer.BucketedWeightReceiver
    device = importlib.import_module("verl.utils.device")
    workers = importlib.import_module("verl.workers.engine_workers")
    assert device.set_expandable_segments is allocator.set_expandable_segments
    assert workers.set_expandable_segments is allocator.set_expandable_segments
    assert workers.ActorRolloutRefWorker.update_weights.__hybridmem_restored__
    sglang_rollout = importlib.import_module("verl.workers.rollout.sglang_rollout.sglang_rollout")
    assert sglang_rollout.sgl_update_weights is sglang.update_weights
    assert not hasattr(sglang_rollout.update_weights, "__hybridmem_restored__")


def test_the_sglang_route_is_swapped_and_put_back(fake_verl: Path) -> None:
    module = importlib.import_module("verl.workers.rollout.sglang_rollout.sglang_rollout")
    theirs, own_method = module.sgl_update_weights, module.update_weights
    replaced = install.install()
    assert replaced == ["verl.workers.rollout.sglang_rollout.sglang_rollout.sgl_update_weights"]
    assert module.sgl_update_weights is sglang.update_weights
    assert module.update_weights is own_method  # only the name verl imported from SGLang
    install.uninstall()
    assert module.sgl_update_weights is theirs


def test_modules_imported_before_are_patched_at_once_and_uninstall_restores(
    fake_verl: Path,
) -> None:
    rollout = importlib.import_module("verl.workers.rollout.vllm_rollout.vllm_rollout")
    theirs = rollout.BucketedWeightSender
    replaced = install.install()
    assert "verl.workers.rollout.vllm_rollout.vllm_rollout.BucketedWeightSender" in replaced
    assert install.install() == []  # idempotent
    assert install.installed()
    install.uninstall()
    assert rollout.BucketedWeightSender is theirs
    assert not install.installed()


def test_a_failed_update_restores_the_mode_and_says_so(
    fake_verl: Path, training: FakeTorch
) -> None:
    install.install()
    workers = importlib.import_module("verl.workers.engine_workers")
    assert hm.allocator_state().expandable_segments
    with pytest.raises(RuntimeError, match="did not wake") as failed:
        asyncio.run(workers.ActorRolloutRefWorker().update_weights())
    assert hm.allocator_state().expandable_segments  # back on, as before the call
    notes = getattr(failed.value, "__notes__", [""])
    assert sys.version_info < (3, 11) or "expandable_segments is back to True" in notes[0]
    assert "empty_cache" in training.events


def test_the_toggle_keeps_every_other_setting(training: FakeTorch) -> None:
    allocator.set_expandable_segments(False)
    state = hm.allocator_state()
    assert not state.expandable_segments
    assert state["max_split_size_mb"] == "256"  # the user's, from the env
    assert state["garbage_collection_threshold"] == "0.6"
    assert "max_split_size_mb:256" in training.set_strings()[-1]  # what torch was given
    allocator.set_expandable_segments(True)
    assert hm.allocator_state().expandable_segments
    with pytest.raises(TypeError, match="enable must be True or False"):
        allocator.set_expandable_segments("yes")  # type: ignore[arg-type]


def test_an_explicit_env_false_is_never_enabled(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridmem.scopes.allocator import _reset_state_for_tests

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    _reset_state_for_tests()
    allocator.set_expandable_segments(True)
    assert not hm.allocator_state().expandable_segments


def test_the_env_installs_only_when_asked(fake_verl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(install.ENV, raising=False)
    assert not install.install_from_env()
    importlib.import_module("verl.utils.device")
    assert not install.installed()  # not asked: verl's own
    monkeypatch.setenv(install.ENV, "1")
    assert install.install_from_env()
    assert install.installed()


def _said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == "hybridmem"]


def test_each_name_replaced_is_one_info_line(
    fake_verl: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    importlib.import_module("verl.utils.device")
    now = install.install()
    assert now == ["verl.utils.device.set_expandable_segments"]
    # patched as it loads (it imported the device's name already replaced: not again)
    importlib.import_module("verl.workers.engine_workers")
    infos = _said(caplog, logging.INFO)
    assert infos == [
        "verl drop-in: verl.utils.device.set_expandable_segments replaced by hybridmem's",
        "verl drop-in: verl.workers.engine_workers.ActorRolloutRefWorker.update_weights "
        "replaced by hybridmem's",
    ]
    assert not _said(caplog, logging.WARNING)
    assert install.installed()


def test_verl_not_installed_is_a_warning_and_nothing_installed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real(name, *a)
    )
    try:
        assert install.install() == []
        (warning,) = _said(caplog, logging.WARNING)
        assert warning.startswith("verl drop-in not in place: verl is not installed")
        assert "No module named 'verl'" in warning
        assert not install.installed()
    finally:
        install.uninstall()


def test_verl_that_fails_to_import_is_a_warning_with_its_error(
    fake_verl: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    (fake_verl / "verl" / "__init__.py").write_text("import ray_not_installed_here\n")
    assert install.install() == []
    assert _said(caplog, logging.INFO) == [
        "verl drop-in: verl is not imported yet; its modules are patched as they load"
    ]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer")
    (warning,) = _said(caplog, logging.WARNING)
    assert warning.startswith(
        "verl drop-in not in place: import verl failed (ModuleNotFoundError: No module "
        "named 'ray_not_installed_here')"
    )
    assert not install.installed()


def test_a_worker_module_that_misses_verl_core_names_the_install_line(
    fake_verl: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """verl 0.9.1 without its verl-core extra: `No module named 'uvicorn'` from its workers."""
    (fake_verl / "verl" / "workers" / "engine_workers.py").write_text("import uvicorn_not_here\n")
    install.install()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("verl.workers.engine_workers")
    (warning,) = _said(caplog, logging.WARNING)
    assert warning.startswith(
        "verl drop-in not in place: import verl.workers.engine_workers failed "
        "(ModuleNotFoundError: No module named 'uvicorn_not_here')"
    )
    assert install.install_line() in warning
    assert install.install_line().startswith('pip install "verl[verl-core]')


def test_an_error_of_verls_own_is_not_blamed_on_its_extra(
    fake_verl: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (fake_verl / "verl" / "workers" / "engine_workers.py").write_text("raise KeyError('cfg')\n")
    install.install()
    with pytest.raises(KeyError):
        importlib.import_module("verl.workers.engine_workers")
    (warning,) = _said(caplog, logging.WARNING)
    assert "an error of verl's own" in warning
    assert "verl-core" not in warning


@pytest.mark.parametrize("error", ["import uvicorn_not_here", "raise RuntimeError('verl')"])
def test_verls_import_errors_keep_their_frames_through_the_hook(
    fake_verl: Path, error: str
) -> None:
    """The hook's frames go with the import machinery's: the traceback verl's alone gives."""
    (fake_verl / "verl" / "workers" / "engine_workers.py").write_text(f"x = 1\n{error}\n")

    def frames() -> list[tuple[str, str]]:
        for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
            del sys.modules[name]
        try:  # an import statement: the one Python trims the machinery's frames from
            exec(compile("import verl.workers.engine_workers", "<user>", "exec"), {})
        except (ImportError, RuntimeError) as exc:
            return [(f.filename, f.name) for f in traceback.extract_tb(exc.__traceback__)]
        raise AssertionError("the import did not fail")

    without = frames()
    install.install()
    with_hook = frames()
    assert with_hook == without
    assert not any(file.endswith("verl/install.py") or "importlib" in file for file, _ in with_hook)
    assert with_hook[-1][0].endswith("engine_workers.py")


def test_every_call_says_what_it_did(
    fake_verl: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    monkeypatch.delenv(install.ENV, raising=False)
    assert not install.install_from_env()
    assert _said(caplog, logging.INFO) == [
        "verl drop-in not installed: HYBRIDMEM_VERL is unset (set HYBRIDMEM_VERL=1 to install it)"
    ]
    caplog.clear()
    monkeypatch.setenv(install.ENV, "yes")
    assert not install.install_from_env()
    assert "HYBRIDMEM_VERL is 'yes'" in _said(caplog, logging.INFO)[0]
    caplog.clear()
    importlib.import_module("verl.utils.device")
    assert install.install() == ["verl.utils.device.set_expandable_segments"]
    caplog.clear()
    assert install.install() == []
    assert _said(caplog, logging.INFO) == [
        "verl drop-in: install() called again; already in place "
        "(verl.utils.device.set_expandable_segments)"
    ]
    caplog.clear()
    install.uninstall()
    assert _said(caplog, logging.INFO) == [
        "verl drop-in removed: verl's own verl.utils.device.set_expandable_segments put back"
    ]


def test_a_subclass_keeping_restored_on_failure_over_the_drop_in_says_it_once(
    fake_verl: Path, training: FakeTorch, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/backends/verl.md's worker with @restored_on_failure kept, install() as well."""
    install.install()
    workers = importlib.import_module("verl.workers.engine_workers")

    class HybridWorker(workers.ActorRolloutRefWorker):  # type: ignore[misc, name-defined]
        @allocator.restored_on_failure
        async def update_weights(self, global_steps: Any = None, mode: str = "auto") -> Any:
            return await super().update_weights(global_steps=global_steps, mode=mode)

    def fail() -> None:
        async def run() -> Any:
            return await HybridWorker().update_weights()

        asyncio.run(run())

    with pytest.raises(RuntimeError, match="did not wake") as failed:
        fail()
    (warning,) = _said(caplog, logging.WARNING)
    assert warning.startswith("verl's update_weights failed (RuntimeError)")
    notes = getattr(failed.value, "__notes__", [])
    assert sys.version_info < (3, 11) or len(notes) == 1
    assert hm.allocator_state().expandable_segments  # restored, once
    # the next failure is restored and said again (the guard is per call)
    with pytest.raises(RuntimeError):
        fail()
    assert len(_said(caplog, logging.WARNING)) == 2


def test_the_communicators_wrapper_is_installed_only_when_asked(
    fake_verl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridmem.integrations.verl import communicators

    install.install()
    workers = importlib.import_module("verl.workers.engine_workers")
    method = vars(workers.ActorRolloutRefWorker)["update_weights"]
    assert not getattr(method, "__hybridmem_suspends__", False)  # off by default
    install.uninstall()
    monkeypatch.setenv(communicators.ENV, "1")
    install.install()
    method = vars(workers.ActorRolloutRefWorker)["update_weights"]
    assert getattr(method, "__hybridmem_suspends__", False)
    assert getattr(method, "__hybridmem_restored__", False)  # both, once each
    install.install()
    assert vars(workers.ActorRolloutRefWorker)["update_weights"] is method
