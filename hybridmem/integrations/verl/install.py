"""Swap hybridmem's drop-ins into verl, in this process: one call, verl's code unchanged.

:func:`install` replaces, in verl 0.9's modules:

- ``BucketedWeightSender`` and ``BucketedWeightReceiver``
  (``verl.workers.rollout.vllm_rollout.bucketed_weight_transfer``, and every module
  that imported them by name: ``vllm_rollout.vllm_rollout``) by
  :mod:`hybridmem.integrations.verl.transfer`'s;
- ``set_expandable_segments`` (``verl.utils.device``, and ``verl.workers.engine_workers``,
  which imported it by name) by
  :func:`~hybridmem.integrations.verl.allocator.set_expandable_segments`;
- ``ActorRolloutRefWorker.update_weights`` (``verl.workers.engine_workers``) by itself
  wrapped in :func:`~hybridmem.integrations.verl.allocator.restored_on_failure`, and,
  with ``HYBRIDMEM_VERL_SUSPEND_COMMUNICATORS=1``, in
  :func:`~hybridmem.integrations.verl.communicators.suspends_through_rollout` (the
  trainer's NCCL communicators suspended from the KV wake to the next collective);
- SGLang's ``update_weights`` as verl's SGLang rollout imported it
  (``sgl_update_weights`` in ``verl.workers.rollout.sglang_rollout.sglang_rollout``)
  by :func:`hybridmem.integrations.sglang.update_weights`, which sends SGLang's own
  ``flattened_bucket`` payload (SGLang's module itself is left alone).

Modules verl has not imported yet are patched when it imports them (an import hook
that runs after each of them loads), so the call may come before or after verl's
imports. Each name replaced is logged at INFO on the ``hybridmem`` logger; where verl
is not installed, or ``import verl`` fails (its dependencies missing), a WARNING says
so with the import error: the drop-ins are not in place, and :func:`installed` stays
false until something is replaced. Both processes of a transfer need it: the trainer's
(the sender) and the vLLM worker's (the receiver). vLLM runs hybridmem's plugin in
every process it starts, which calls :func:`install` there when ``HYBRIDMEM_VERL=1``;
for verl's Ray workers, Ray's ``runtime_env`` can run it in each
(``worker_process_setup_hook``), or the worker's code calls it. Never by surprise:
nothing is patched unless asked.

Scope: process-global; idempotent; thread-safe.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from types import ModuleType
from typing import Any

from hybridmem._log import logger

__all__ = [
    "ENV",
    "INSTALL_LINE",
    "asks",
    "install",
    "install_from_env",
    "install_line",
    "installed",
    "uninstall",
    "verl_version",
]

#: Set to ``1`` in processes vLLM starts (its plugin then calls :func:`install`).
ENV = "HYBRIDMEM_VERL"

_TRANSFER = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
_ROLLOUT = "verl.workers.rollout.vllm_rollout.vllm_rollout"
_DEVICE = "verl.utils.device"
_WORKERS = "verl.workers.engine_workers"
_SGLANG_ROLLOUT = "verl.workers.rollout.sglang_rollout.sglang_rollout"
_TARGETS = (_TRANSFER, _ROLLOUT, _DEVICE, _WORKERS, _SGLANG_ROLLOUT)
_WATCHED = ("verl", *_TARGETS)  # verl's own import is watched for failure, not patched

_lock = threading.Lock()
_originals: dict[tuple[str, str], Any] = {}  # (module, name) -> what verl had
_hook: _PatchOnImport | None = None


def _ours(module_name: str) -> dict[str, Any]:
    """The names replaced in ``module_name`` (those it has), and by what."""
    if module_name == _SGLANG_ROLLOUT:
        from hybridmem.integrations import sglang

        return {"sgl_update_weights": sglang.update_weights}
    from hybridmem.integrations.verl import allocator, transfer

    return {
        "BucketedWeightSender": transfer.BucketedWeightSender,
        "BucketedWeightReceiver": transfer.BucketedWeightReceiver,
        "set_expandable_segments": allocator.set_expandable_segments,
    }


def _patch(module: ModuleType) -> list[str]:
    """Replace verl's names in ``module`` by ours (those it has); what was replaced."""
    done: list[str] = []
    for name, replacement in _ours(module.__name__).items():
        current = getattr(module, name, None)
        if current is None or current is replacement:
            continue
        _originals.setdefault((module.__name__, name), current)
        setattr(module, name, replacement)
        done.append(f"{module.__name__}.{name}")
    worker = getattr(module, "ActorRolloutRefWorker", None) if module.__name__ == _WORKERS else None
    if worker is not None and "update_weights" in vars(worker):
        from hybridmem.integrations.verl import communicators
        from hybridmem.integrations.verl.allocator import restored_on_failure

        method = vars(worker)["update_weights"]
        wrapped = restored_on_failure(method)
        if asks(os.environ.get(communicators.ENV)):
            wrapped = communicators.suspends_through_rollout(wrapped)
        if wrapped is not method:
            _originals.setdefault((module.__name__, "ActorRolloutRefWorker.update_weights"), method)
            worker.update_weights = wrapped
            done.append(f"{_WORKERS}.ActorRolloutRefWorker.update_weights")
    for name in done:
        logger.info("verl drop-in: %s replaced by hybridmem's", name)
    return done


#: What a verl 0.9 worker needs installed: verl's own dependencies do not include what
#: its worker modules import (uvicorn, fastapi, zmq...); its ``verl-core`` extra does.
INSTALL_LINE = 'pip install "verl[verl-core]"'


def verl_version() -> str | None:
    """The installed verl's version, from its metadata (verl is not imported), or None."""
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return None


def install_line(version: str | None = None) -> str:
    """:data:`INSTALL_LINE` pinned to ``version`` (default: the verl installed here, if any)."""
    version = version or verl_version()
    return INSTALL_LINE if version is None else f'pip install "verl[verl-core]=={version}"'


def asks(value: str | None) -> bool:
    """Whether ``value`` (of ``HYBRIDMEM_VERL``) asks for the drop-in: ``1``, spaces aside."""
    return (value or "").strip() == "1"


def _not_in_place(module: str, exc: BaseException) -> None:
    """Warn that importing ``module`` (verl or one it patches) failed: not patched."""
    fix = (
        f"install verl with its verl-core extra in this process ({install_line()}), which "
        "its workers need"
        if isinstance(exc, ImportError)
        else "an error of verl's own: the drop-in goes in when the import succeeds"
    )
    logger.warning(
        "verl drop-in not in place: import %s failed (%s: %s); %s (or leave %s unset)",
        module,
        type(exc).__name__,
        exc,
        fix,
        ENV,
    )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patch each of verl's target modules right after it is first imported."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                execute: Callable[[ModuleType], None] | None = getattr(loader, "exec_module", None)
                if execute is None:
                    return None

                def exec_module(module: ModuleType, execute: Any = execute) -> None:
                    try:
                        execute(module)
                    except BaseException as exc:
                        if _hook is not None:
                            _not_in_place(module.__name__, exc)
                        raise
                    with _lock:
                        if _hook is not None and module.__name__ in _TARGETS:
                            _patch(module)

                _as_import_machinery(exec_module)
                spec.loader = _Loader(loader, exec_module)
                found: importlib.machinery.ModuleSpec = spec
                return found
        return None


class _Loader(importlib.abc.Loader):
    """A loader that runs another's ``exec_module`` and then patches the module."""

    def __init__(self, loader: Any, exec_module: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._exec = exec_module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        made: ModuleType | None = None if create is None else create(spec)
        return made

    def exec_module(self, module: ModuleType) -> None:
        self._exec(module)


def _as_import_machinery(function: Callable[..., Any]) -> None:
    """Have Python hide ``function``'s frames from import tracebacks, as it hides its own.

    An error raised while a module runs reaches its importer through the import
    machinery; CPython cuts that machinery's frames out of the traceback (``import.c``,
    ``remove_importlib_frames``: runs of frames from ``<frozen importlib._bootstrap*>``),
    so the importer sees its own line and the failing module's. The hook's two frames
    sit inside such a run and would break it, leaving five frames of machinery in every
    error verl's imports raise. Marked as the machinery's, they go with it.
    """
    function.__code__ = function.__code__.replace(co_filename=_MACHINERY)


_MACHINERY = "<frozen importlib._bootstrap_external>"
_as_import_machinery(_Loader.exec_module)


def install() -> list[str]:
    """Put hybridmem's drop-ins in verl's place in this process (see the module).

    Each name replaced, now or when its module loads, is logged at INFO. Where verl is
    not installed a WARNING says so now; where ``import verl`` fails later (its
    dependencies missing), a WARNING with the error says the drop-ins are not in place.

    Returns:
        What was replaced now, as ``module.name`` (empty when verl's modules are not
        imported yet: they are patched when they are).

    Example:
        >>> from hybridmem.integrations.verl.install import install, installed, uninstall
        >>> replaced = install()  # verl's modules imported so far; the others as they load
        >>> installed() == bool(replaced)  # true once something of verl is replaced
        True
        >>> uninstall()
    """
    global _hook
    with _lock:
        again = _hook is not None
        if _hook is None:
            _hook = _PatchOnImport()
            sys.meta_path.insert(0, _hook)
        done: list[str] = []
        for name in _TARGETS:
            module = sys.modules.get(name)
            if module is not None:
                done += _patch(module)
        if again and not done:
            replaced = sorted(f"{m}.{n}" for m, n in _originals)
            logger.info(
                "verl drop-in: install() called again; already in place (%s)",
                ", ".join(replaced) if replaced else "verl's modules are patched as they load",
            )
            return done
    if not done and not any(name in sys.modules for name in _WATCHED):
        if importlib.util.find_spec("verl") is None:
            logger.warning(
                "verl drop-in not in place: verl is not installed in this process (No "
                "module named 'verl'; %s); its modules are patched if they are imported "
                "later",
                INSTALL_LINE,
            )
        else:
            logger.info(
                "verl drop-in: verl is not imported yet; its modules are patched as they load"
            )
    return done


def installed() -> bool:
    """Whether any of verl's names is replaced by hybridmem's in this process now.

    False after :func:`install` until one of verl's modules it patches has loaded (and
    always where verl is not installed or fails to import); False after
    :func:`uninstall`.
    """
    with _lock:
        return bool(_originals)


def uninstall() -> None:
    """Put verl's own names back and stop patching imports."""
    global _hook
    with _lock:
        if _hook is not None and _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        was_installed = _hook is not None
        _hook = None
        back = []
        for (module_name, name), original in _originals.items():
            module = sys.modules.get(module_name)
            if module is None:
                continue
            if "." in name:
                owner, attr = name.split(".")
                setattr(getattr(module, owner), attr, original)
            else:
                setattr(module, name, original)
            back.append(f"{module_name}.{name}")
        _originals.clear()
    if back:
        logger.info("verl drop-in removed: verl's own %s put back", ", ".join(back))
    elif was_installed:
        logger.info("verl drop-in removed: nothing of verl had been replaced")


def install_from_env() -> bool:
    """:func:`install` if ``HYBRIDMEM_VERL=1`` (what the vLLM plugin calls); whether it did.

    Where the variable is not ``1``, one INFO line says so (and what it holds).
    """
    value = os.environ.get(ENV)
    if not asks(value):
        logger.info(
            "verl drop-in not installed: %s is %s (set %s=1 to install it)",
            ENV,
            "unset" if value is None else repr(value),
            ENV,
        )
        return False
    install()
    return True
