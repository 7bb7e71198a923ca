"""Every warning a user can trigger names the user's line, not one inside hybridmem.

One trigger per call site of ``warn_once``/``warn_user`` in the package; a test reads
the package's source and fails when a call site has no trigger here, so a new
warning cannot ship pointing at ``allocator/state.py`` (issue #22).
"""

from __future__ import annotations

import ast
import sys
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridmem as hm
from hybridmem import _env
from hybridmem.scopes import registry
from tests.conftest import FakeDevice, FakeTorch, patch_seam
from tests.helpers import PACKAGE, run_python

MiB = 1 << 20
Trigger = Callable[[pytest.MonkeyPatch, Any], None]  # Any: a FakeTorch, or None


def _disable_flag(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "maybe")
    monkeypatch.setattr(_env, "_last_raw", None)  # read again, whatever ran before
    with hm.expandable_segments(False):
        pass


def _generator_returned(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    @hm.expandable_segments(False)
    def make() -> object:
        return (i for i in range(2))

    make()


def _env_ignored(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    fake.last = "max_split_size_mb:512"
    hm.allocator_state()


def _env_misread(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:25.5")
    hm.allocator_state()


def _no_setter(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    fake.has_setter = False
    with hm.expandable_segments(True):
        pass


def _async_backend(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    fake.backend = "cudaMallocAsync"
    with hm.expandable_segments(True):
        pass


def _out_of_order(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    first, second = hm.expandable_segments(True), hm.allocator_settings(max_split_size_mb=256)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)


def _broken_plugin(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    point = metadata.EntryPoint("broken", "no_such_module:X", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        metadata,
        "entry_points",
        lambda group: [point] if group == registry.ENTRY_POINT_GROUP else [],
    )
    hm.list_backends()


def _bucket_fd_fallback(monkeypatch: pytest.MonkeyPatch, fake: None) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the answer of a machine without CUDA")
    hm.WeightBucket(1 << 20, transport="fd").close()


def _ipc_host_fallback(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    fake.backend = "cudaMallocAsync"
    with hm.ipc_safe():
        pass


def _leak(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    watch = hm.LeakWatch("sleep", window=3, slope_bytes=MiB)
    for cycle in range(3):
        watch.observe((1 << 30) + cycle * 8 * MiB)


def _no_room_for_one_segment(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    def no_room(nbytes: int, device: torch.device) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    fake.initialized, fake.devices[0] = True, FakeDevice()
    patch_seam(monkeypatch, "hold_block", no_room)
    with hm.one_segment(64 * MiB):
        pass


def _enter_without_exit(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    class Half:
        @hm.expandable_segments(False)
        def __enter__(self) -> None:
            pass


def _enter_wrapped_again(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    def logged(method: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *args: method(*args)

    class Manager:
        @logged
        @hm.expandable_segments(False)
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            pass

    with Manager():
        pass


def _suspend_in_a_world(monkeypatch: pytest.MonkeyPatch, nccl: Any) -> None:
    """``hm.suspend_communicators()`` on a one-rank gloo world the seam takes for NCCL's."""
    import tempfile

    import torch.distributed as dist

    from tests.nccl_standin import as_nccl

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/s", rank=0, world_size=1)
        try:
            as_nccl(monkeypatch, nccl, [dist.group.WORLD])
            with hm.suspend_communicators():
                pass
        finally:
            dist.destroy_process_group()


def _ranks_disagree(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    from hybridmem.scopes.communicators import SuspendCommunicators
    from tests.nccl_standin import StandInNccl

    said = {0: "ok", 1: "NCCL 2.28.9 has no ncclCommSuspend"}
    monkeypatch.setattr(SuspendCommunicators, "_meet", lambda self, *args: said)
    _suspend_in_a_world(monkeypatch, StandInNccl())


def _old_nccl(monkeypatch: pytest.MonkeyPatch, fake: FakeTorch) -> None:
    from tests.nccl_standin import StandInNccl

    _suspend_in_a_world(monkeypatch, StandInNccl(version=22809, has_suspend=False))


# (file, function) of each call site -> what a user does that reaches it.
TRIGGERS: dict[tuple[str, str], Trigger] = {
    ("_env.py", "parse_flag"): _disable_flag,
    ("_scope/functions.py", "wrapper"): _generator_returned,
    ("_scope/methods.py", "__set_name__"): _enter_without_exit,
    ("_scope/methods.py", "__call__"): _enter_wrapped_again,
    ("allocator/state.py", "_parse_env"): _env_ignored,
    ("allocator/state.py", "_parse_env#2"): _env_misread,
    ("allocator/state.py", "_check_can_apply"): _no_setter,
    ("allocator/state.py", "_check_can_apply#2"): _async_backend,
    ("allocator/state.py", "pop"): _out_of_order,
    ("scopes/registry.py", "_load_entry_points"): _broken_plugin,
    ("ipc/transports/choice.py", "choose_transport"): _bucket_fd_fallback,
    ("scopes/ipc_safe.py", "_enter"): _ipc_host_fallback,
    ("memory/one_segment.py", "_enter"): _no_room_for_one_segment,
    ("observe/leakwatch.py", "observe"): _leak,
    ("scopes/communicators.py", "_leave_alone"): _ranks_disagree,
    ("scopes/communicators.py", "_leave_alone#2"): _old_nccl,
    # observe/timeline.py _start_from_env runs at import: tested in a fresh process below
}
_AT_IMPORT = {("observe/timeline.py", "_start_from_env")}


def _call_sites() -> set[tuple[str, str]]:
    """(file, innermost function[#n]) of every warn_once / warn_user call in the package."""
    sites: set[tuple[str, str]] = set()
    package = PACKAGE
    for path in sorted(package.rglob("*.py")):
        if path.name == "_log.py":
            continue
        relative = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text())
        found: list[tuple[int, str]] = []
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("warn_once", "warn_user")
                ):
                    found.append((node.lineno, function.name))
        innermost: dict[int, str] = {}
        for line, name in found:  # ast.walk is outer-first: the last name is innermost
            innermost[line] = name
        counts: dict[str, int] = {}
        for _, name in sorted(innermost.items()):
            counts[name] = counts.get(name, 0) + 1
            sites.add((relative, name if counts[name] == 1 else f"{name}#{counts[name]}"))
    return sites


def test_every_warning_call_site_has_a_trigger_here() -> None:
    assert _call_sites() == set(TRIGGERS) | _AT_IMPORT


@pytest.mark.parametrize("site", sorted(TRIGGERS), ids=lambda site: "/".join(site))
def test_the_warning_names_the_users_line(
    site: tuple[str, str], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    # The bucket asks the real torch whether CUDA is there; the others a fake seam.
    fake = None if TRIGGERS[site] is _bucket_fd_fallback else request.getfixturevalue("fake")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TRIGGERS[site](monkeypatch, fake)
    ours = [w for w in caught if issubclass(w.category, hm.HybridMemWarning)]
    assert ours, f"{site} raised no HybridMemWarning"
    for warning in ours:
        assert Path(warning.filename) == Path(__file__), (
            f"{warning.message} points at {warning.filename}:{warning.lineno}"
        )


_IMPORT_SCRIPT = """\
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hybridmem as hm
    hm.record  # loads the timeline, which reads HYBRIDMEM_TIMELINE
print([(w.filename, w.lineno) for w in caught if "HYBRIDMEM_TIMELINE" in str(w.message)])
"""


def test_a_warning_at_import_names_the_line_that_imported(tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(_IMPORT_SCRIPT)
    (tmp_path / "a_file").write_text("")
    result = run_python(str(script), env={"HYBRIDMEM_TIMELINE": str(tmp_path / "a_file" / "t")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr([(str(script), 6)]), (result.stdout, sys.executable)
