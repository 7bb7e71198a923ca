"""Where renamed, moved and removed names went, so an old spelling says so.

CHANGELOG.md's rename tables are the record; this module is what the package
answers with. ``tests/test_moved.py`` walks every table row and checks that the
old spelling fails with a message naming the new one, so a rename cannot skip it.

Nothing here imports torch: ``hm.<old name>`` must answer on any machine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType, ModuleType

__all__ = ["MOVED", "MOVED_MODULES", "install_module_finder", "moved_attribute_error"]

# Old dotted path (module + attribute) -> the spelling that replaces it.
MOVED: Mapping[str, str] = MappingProxyType(
    {
        # renamed on the face (issue #13); the card's name came back in issue #22
        "hybridmem.allocator_config": "hm.allocator_state()",
        "hybridmem.configure_allocator": "hm.set_allocator_defaults()",
        "hybridmem.cache_released": "hm.aggressive_cache_release()",
        "hybridmem.events": "hm.get_timeline().events()",
        # left the face: reachable from their module, for typing (issue #13)
        "hybridmem.AllocatorConfig": "hybridmem.allocator.AllocatorState",
        "hybridmem.AllocatorSettings": "hybridmem.allocator.AllocatorSettings",
        "hybridmem.AllocatorState": "hybridmem.allocator.AllocatorState",
        "hybridmem.ExpandableSegments": "hybridmem.allocator.ExpandableSegments",
        "hybridmem.Setting": "hybridmem.allocator.Setting",
        "hybridmem.CacheRelease": "hybridmem.memory.release.CacheRelease",
        "hybridmem.ReleaseReport": "hybridmem.memory.release.ReleaseReport",
        "hybridmem.DeviceRelease": "hybridmem.memory.release.DeviceRelease",
        "hybridmem.Offloaded": "hybridmem.memory.offload_scope.Offloaded",
        "hybridmem.OffloadReport": "hybridmem.memory.offload.OffloadReport",
        "hybridmem.IpcSafe": "hybridmem.ipc.shareable.IpcSafe",
        "hybridmem.IpcCapabilities": "hybridmem.ipc.capabilities.IpcCapabilities",
        "hybridmem.SyncReport": "hybridmem.ipc.bucket.SyncReport",
        "hybridmem.BucketHandle": "hybridmem.ipc.bucket.BucketHandle",
        "hybridmem.Phase": "hybridmem.engine.phases.Phase",
        "hybridmem.PHASES": "hybridmem.engine.backends.PHASES",
        "hybridmem.RankStatus": "hybridmem.engine.ranks.RankStatus",
        "hybridmem.RankSync": "hybridmem.engine.ranks.RankSync",
        "hybridmem.StageReport": "hybridmem.engine.reports.StageReport",
        "hybridmem.SwitchReport": "hybridmem.engine.reports.SwitchReport",
        "hybridmem.MemoryInfo": "hybridmem.observe.memory.MemoryInfo",
        "hybridmem.Event": "hybridmem.observe.timeline.Event",
        "hybridmem.Recording": "hybridmem.observe.timeline.Recording",
        "hybridmem.Timeline": "hybridmem.observe.timeline.Timeline",
        # removed: nothing replaces them one for one
        "hybridmem.ScopedContext": (
            "removed: subclassing the base of every primitive was never supported; "
            "compose the primitives instead"
        ),
        "hybridmem.Channel": "removed: a channel is any object with send() and recv()",
        # the bench's reading of results, apart from running it (issue #13)
        "hybridmem.bench.run.TABLE_KEYS": "hybridmem.bench.report.TABLE_KEYS",
        "hybridmem.bench.run.TARGETS": "hybridmem.bench.report.TARGETS",
        "hybridmem.bench.run.noise": "hybridmem.bench.report.noise",
    }
)

# Old module -> the module that holds its contents now (issue #13).
MOVED_MODULES: Mapping[str, str] = MappingProxyType(
    {
        "hybridmem.cache": "hybridmem.memory.release",
        "hybridmem.offload": "hybridmem.memory.offload",
        "hybridmem.capabilities": "hybridmem.ipc.capabilities",
        "hybridmem.bucket": "hybridmem.ipc.bucket",
        "hybridmem.receiver": "hybridmem.ipc.receiver",
        "hybridmem.backends": "hybridmem.engine.backends",
        "hybridmem.backends.engines": "hybridmem.engine.backends.adapters",
        "hybridmem.phases": "hybridmem.engine.phases",
        "hybridmem.switch": "hybridmem.engine.switch",
        "hybridmem.telemetry": "hybridmem.observe.memory",
        "hybridmem.timeline": "hybridmem.observe.timeline",
        "hybridmem.leakwatch": "hybridmem.observe.leakwatch",
        "hybridmem.plot": "hybridmem.observe.plot",
    }
)


def _spelling(path: str) -> str:
    """``hybridmem.x`` as a user of the face writes it (``hm.x``); deeper paths as they are."""
    module, _, name = path.rpartition(".")
    return f"hm.{name}" if module == "hybridmem" else path


def _message(old: str, new: str) -> str:
    old_spelling = _spelling(old)
    if new.startswith("removed: "):
        return f"{old_spelling} was removed from hybridmem: {new.removeprefix('removed: ')}"
    if new.startswith("hm."):
        return f"{old_spelling} was renamed: use {new} (CHANGELOG.md, 'Renamed')"
    module, _, name = new.rpartition(".")
    return (
        f"{old_spelling} moved: use {new} (from {module} import {name}); CHANGELOG.md "
        "lists every move"
    )


def _module_moves(module: str) -> str:
    """Where ``module`` went, and its moved submodules too (``import a.b.c`` asks for ``a.b``)."""
    moves = [f"moved to {MOVED_MODULES[module]}"]
    moves += [
        f"{old} moved to {MOVED_MODULES[old]}"
        for old in sorted(MOVED_MODULES)
        if old.startswith(module + ".")
    ]
    return "; ".join(moves) + " (CHANGELOG.md lists every move)"


def moved_attribute_error(module: str, name: str) -> AttributeError:
    """The error for ``module.name``: where it went when it moved, else the plain one.

    A moved name's error carries no ``name``/``obj`` for Python's "Did you mean"
    hint, which would suggest a wrong, similar-looking name (``allocator_config``
    is not ``allocator_settings``); an unknown name keeps the hint.
    """
    path = f"{module}.{name}"
    new = MOVED.get(path)
    if new is None and path in MOVED_MODULES:
        message = f"module {path} {_module_moves(path)}"
    elif new is not None:
        message = _message(path, new)
    else:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    error = AttributeError(message)
    # A set `obj` stops CPython from attaching the context that drives the hint.
    error.obj = None
    return error


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answer ``import hybridmem.<moved module>`` with where it went.

    It sits last on ``sys.meta_path``, so it is asked only about modules that no
    other finder found.
    """

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: {_module_moves(fullname)}", name=fullname
        )


_FINDER = _MovedModuleFinder()


def install_module_finder() -> None:
    """Put the finder of moved modules at the end of ``sys.meta_path``, once."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_FINDER)
