"""vLLM's sleep-mode allocator (``CuMemAllocator``), from vLLM or from its wheel's files.

vLLM's sleep mode is ``vllm/device_allocator/cumem.py`` over the C extension
``vllm/cumem_allocator.abi3.so``, which calls only the CUDA driver and Python's C API.
Where vLLM is installed, :func:`load_cumem` imports it. Where it is not (a GPU machine
with torch alone), it loads the wheel's own files under their own module names: the
wheel (``pip download --no-deps vllm==0.33.0``) or a folder holding

- ``vllm/cumem_allocator.abi3.so``,
- ``vllm/device_allocator/__init__.py``, ``cumem.py``, and ``alloc_conf.py`` where the
  release has it (0.31 and later: :data:`SINCE_0_31`),
- ``vllm/device_allocator/sleep_mode_backend.py`` where the release has it (the
  sleep-mode backends and their factory, with vLLM's ``cumem`` backend: 0.33's;
  :data:`BACKENDS_FILE`, never required),
- ``vllm/distributed/device_communicators/cuda_wrapper.py``,
- ``vllm/utils/system_utils.py`` (only ``find_loaded_library``, and
  ``find_loaded_libraries`` where the release has it (0.33), are taken from it,
  compiled alone),

with small stand-ins for the modules they import that would pull in the rest of vLLM:
``vllm.logger`` (the standard ``logging``), ``vllm.platforms`` (CUDA, not ROCm or
XPU), ``vllm.envs`` (``VLLM_CUDART_SO_PATH`` from the environment) and
``vllm.utils.torch_utils`` (``PIN_MEMORY = True``). Nothing of vLLM's is copied into
hybridmem: the code that runs is the wheel's.

Scope: process-global (it puts ``vllm`` and its submodules into ``sys.modules``); for
an engine process of the bench or a GPU test, never for a process that imports the
real vLLM afterwards.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import os
import sys
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "BACKENDS_FILE",
    "FILES",
    "SINCE_0_31",
    "extract",
    "first_missing",
    "load_cumem",
    "load_sleep_backends",
]

#: The wheel's files that run, by their path inside the wheel.
FILES = (
    "vllm/cumem_allocator.abi3.so",
    "vllm/device_allocator/__init__.py",
    "vllm/device_allocator/alloc_conf.py",
    "vllm/device_allocator/cumem.py",
    "vllm/distributed/device_communicators/cuda_wrapper.py",
    "vllm/utils/system_utils.py",
)
#: Files a release before 0.31 does not have (its pool toggles without them); checked
#: only where ``cumem.py`` imports them. vLLM 0.24 to 0.30 load with the rest (0.24,
#: 0.29 and 0.31 run on an H100; 0.22 imports a module with no stand-in here).
SINCE_0_31 = ("vllm/device_allocator/alloc_conf.py",)
#: vLLM's sleep-mode backends and their factory, copied where the wheel has the file.
BACKENDS_FILE = "vllm/device_allocator/sleep_mode_backend.py"
_FROM_SYSTEM_UTILS = ("find_loaded_libraries", "find_loaded_library")


def extract(wheel: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """Copy :data:`FILES` out of a vLLM wheel into ``folder``; return ``folder``.

    Args:
        wheel: a vLLM wheel (``pip download --no-deps vllm==0.33.0``).
        folder: where the files go (``folder/vllm/...``), created if missing.

    Raises:
        FileNotFoundError: ``wheel`` is missing.
        ValueError: ``wheel`` is not a vLLM wheel with these files (it names the first
            one missing).

    Example:
        >>> wheel = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
        >>> extract(wheel, "vllm-files")  # doctest: +SKIP
        PosixPath('vllm-files')
    """
    path, out = Path(wheel), Path(folder)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such wheel (pip download --no-deps vllm==0.33.0)")
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        for name in FILES:
            if name in SINCE_0_31 and name not in names:
                continue  # a release before 0.31: its cumem.py does not import it
            if name not in names:
                raise ValueError(
                    f"{path} has no {name}: not a vLLM wheel with the sleep-mode allocator "
                    "(vLLM 0.33.0's has it: pip download --no-deps vllm==0.33.0)"
                )
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
        if BACKENDS_FILE in names:
            (out / BACKENDS_FILE).write_bytes(archive.read(BACKENDS_FILE))
    return out


def first_missing(folder: str | os.PathLike[str]) -> str | None:
    """The first of :data:`FILES` that ``folder`` lacks (None: it holds them all).

    Example:
        >>> first_missing("/nowhere")
        'vllm/cumem_allocator.abi3.so'
    """
    root = Path(folder)
    cumem = root / "vllm/device_allocator/cumem.py"
    text = cumem.read_text() if cumem.is_file() else ""
    for name in FILES:
        if name in SINCE_0_31 and Path(name).stem not in text:
            continue  # not imported by this release's cumem.py
        if not (root / name).is_file():
            return name
    return None


def _installed() -> Any | None:
    """vLLM's own ``cumem`` module where vLLM is installed (None where it is not)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    return importlib.import_module("vllm.device_allocator.cumem")


def _package(name: str, path: Path | None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path is not None else []
    module.__package__ = name
    sys.modules[name] = module
    return module


def _stand_ins(root: Path) -> None:
    """The modules vLLM's allocator files import that would pull in the rest of vLLM."""
    vllm = _package("vllm", root / "vllm")
    logger_module = types.ModuleType("vllm.logger")
    logger_module.init_logger = logging.getLogger  # type: ignore[attr-defined]
    sys.modules["vllm.logger"] = logger_module

    class _Cuda:
        device_type = "cuda"

        def is_cuda_alike(self) -> bool:
            return True

        def is_cuda(self) -> bool:
            return True

        def is_rocm(self) -> bool:
            return False

        def is_xpu(self) -> bool:
            return False

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _Cuda()  # type: ignore[attr-defined]
    sys.modules["vllm.platforms"] = platforms
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_CUDART_SO_PATH = os.environ.get("VLLM_CUDART_SO_PATH")  # type: ignore[attr-defined]
    sys.modules["vllm.envs"] = envs
    vllm.envs = envs  # type: ignore[attr-defined]
    utils = _package("vllm.utils", None)
    torch_utils = types.ModuleType("vllm.utils.torch_utils")
    torch_utils.PIN_MEMORY = True  # type: ignore[attr-defined]
    sys.modules["vllm.utils.torch_utils"] = torch_utils
    system_utils = types.ModuleType("vllm.utils.system_utils")
    source = (root / "vllm/utils/system_utils.py").read_text()
    wanted: list[ast.FunctionDef] = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name in _FROM_SYSTEM_UTILS
    ]
    if "find_loaded_library" not in {node.name for node in wanted}:
        raise ValueError(
            f"{root}/vllm/utils/system_utils.py lacks find_loaded_library: not vLLM's "
            "file (0.25 to 0.33 have it; 0.33 builds it on find_loaded_libraries)"
        )
    body: list[ast.stmt] = list(wanted)
    code = compile(
        ast.Module(body=body, type_ignores=[]), str(root / "vllm/utils/system_utils.py"), "exec"
    )
    exec(code, system_utils.__dict__)
    sys.modules["vllm.utils.system_utils"] = system_utils
    utils.system_utils = system_utils  # type: ignore[attr-defined]
    utils.torch_utils = torch_utils  # type: ignore[attr-defined]
    _package("vllm.distributed", root / "vllm/distributed")
    _package(
        "vllm.distributed.device_communicators", root / "vllm/distributed/device_communicators"
    )


def _folder(source: str | os.PathLike[str], complete: Callable[[Path], bool]) -> Path:
    """``source`` as a folder of files: a wheel's files are extracted next to it
    (``<wheel>.files/``), again when an earlier extraction is not ``complete``."""
    root = Path(source)
    if not root.is_file():
        return root
    folder = root.with_name(root.name + ".files")
    if not complete(folder):
        extract(root, folder)
    return folder


def load_cumem(source: str | os.PathLike[str] | None = None) -> Any:
    """Return vLLM's ``vllm.device_allocator.cumem`` module (``CuMemAllocator`` in it).

    Args:
        source: None: vLLM as installed. A vLLM wheel, or a folder holding
            :data:`FILES` (``folder/vllm/...``, e.g. made by :func:`extract`): those
            files, loaded under their own names with stand-ins for the rest of vLLM.
            A wheel's files are extracted next to it (``<wheel>.files/``) once.

    Returns:
        The module; ``module.CuMemAllocator.get_instance()`` is vLLM's allocator and
        ``module.cumem_available`` says whether its C extension loaded.

    Raises:
        ModuleNotFoundError: ``source`` is None and vLLM is not installed.
        FileNotFoundError: ``source`` is neither a wheel nor a folder with
            :data:`FILES` (the message names the first file missing).
        RuntimeError: another ``vllm`` is already imported in this process.

    Scope: process-global (``sys.modules``); load it once per process.

    Example:
        >>> cumem = load_cumem("vllm-files")  # doctest: +SKIP
        >>> allocator = cumem.CuMemAllocator.get_instance()  # doctest: +SKIP
        >>> with allocator.use_memory_pool(tag="weights"):  # doctest: +SKIP
        ...     w = torch.empty(1 << 20, device="cuda")
    """
    if source is None:
        module = _installed()
        if module is None:
            raise ModuleNotFoundError(
                "vLLM is not installed here: pass its wheel or a folder of its files "
                "(pip download --no-deps vllm==0.33.0)"
            )
        return module
    root = _folder(source, lambda folder: first_missing(folder) is None)
    missing = first_missing(root)
    if missing is not None:
        raise FileNotFoundError(
            f"{root / missing}: missing; {root} must hold vLLM's files {', '.join(FILES)} "
            "(hybridmem.integrations.vllm.sleep_files.extract(wheel, folder) puts them there)"
        )
    loaded = sys.modules.get("vllm")
    if loaded is not None:
        if getattr(loaded, "__path__", None) == [str(root / "vllm")]:
            return importlib.import_module("vllm.device_allocator.cumem")
        raise RuntimeError(
            f"a vllm package is already imported here ({getattr(loaded, '__path__', loaded)}); "
            "load vLLM's allocator files in a fresh process"
        )
    _stand_ins(root)
    return importlib.import_module("vllm.device_allocator.cumem")


def load_sleep_backends(source: str | os.PathLike[str] | None = None) -> Any:
    """Return vLLM's ``vllm.device_allocator.sleep_mode_backend`` module, with its allocator.

    Args:
        source: as for :func:`load_cumem`. A wheel's files are extracted again when
            an earlier extraction left out :data:`BACKENDS_FILE`.

    Returns:
        The module: ``SleepModeBackendFactory``, ``SleepModeBackend``, vLLM's
        ``CuMemBackend``.

    Raises:
        FileNotFoundError: the files have no :data:`BACKENDS_FILE` (a release before
            the pluggable backends, or a folder extracted without it).

    Scope: process-global, as :func:`load_cumem`.

    Example:
        >>> backends = load_sleep_backends("vllm-files")  # doctest: +SKIP
        >>> backends.SleepModeBackendFactory.get_backend_class("cumem")  # doctest: +SKIP
        <class 'vllm.device_allocator.sleep_mode_backend.CuMemBackend'>
    """
    if source is not None:
        root = _folder(source, lambda folder: (folder / BACKENDS_FILE).is_file())
        if not (root / BACKENDS_FILE).is_file():
            raise FileNotFoundError(
                f"{root / BACKENDS_FILE}: missing; vLLM 0.33's wheel has it "
                "(extract(wheel, folder) copies it where the wheel has it)"
            )
        source = root
    load_cumem(source)
    return importlib.import_module("vllm.device_allocator.sleep_mode_backend")
