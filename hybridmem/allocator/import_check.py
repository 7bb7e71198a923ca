"""Whether ``import torch`` would abort this interpreter with its env, asked before it runs.

CUDA builds of torch 2.10 and newer abort the interpreter at ``import torch`` (an
assert in a static initialiser: SIGABRT, nothing to catch) when the allocator env has
a key without its value (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments``). Only a
check made before torch is imported can say so: this module reads the installed
torch's version from its distribution and the env with torch's rules
(:mod:`hybridmem.allocator.rules`), importing neither torch nor anything that does.
``hybridmem doctor`` and the package's face ask it before their first import of torch.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from hybridmem.allocator.rules import ALLOC_CONF, CUDA_ALLOC_CONF, TorchRules

__all__ = ["env_kills_torch", "installed_torch"]


def installed_torch() -> tuple[tuple[int, int], bool] | None:
    """The installed torch's ``(major, minor)`` and whether it is a CUDA build, unimported.

    From its distribution's metadata and files: a CUDA build ships ``libc10_cuda``.
    None when torch is not installed or its version cannot be read.
    """
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    parts = version.split("+")[0].split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    spec = importlib.util.find_spec("torch")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    cuda = any(any(Path(folder, "lib").glob("libc10_cuda*")) for folder in folders)
    return (int(parts[0]), int(parts[1])), cuda


def env_kills_torch(environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``import torch`` would abort this interpreter with this env, or None.

    Checked before anything imports torch (the doctor's own process and its probe's
    children would die with a C++ trace): CUDA builds of torch 2.10+ abort at import
    on an env string with a key and no value (``expandable_segments``).
    """
    found = installed_torch()
    if found is None:
        return None
    version, cuda = found
    rules = TorchRules(version, cuda, None)
    env = os.environ if environ is None else environ
    name, _ = rules.env_variable({n: env[n] for n in (CUDA_ALLOC_CONF, ALLOC_CONF) if n in env})
    if name is None or not rules.aborts_at_import(env[name]):
        return None
    return (
        f"{name}={env[name]!r}: {rules.label} (a CUDA build) aborts the interpreter at "
        "`import torch` with this value (a key without its value: INTERNAL ASSERT FAILED, "
        "Index out of bounds in ConfigTokenizer), before any error can be caught. Fix: give "
        f"every key a value (expandable_segments:True), or unset {name}"
    )
