"""What ``hybridmem doctor`` knows about torch_memory_saver (SGLang's memory saver).

torch_memory_saver (TMS) keeps an engine's weights and KV cache in *regions* that
``pause()`` frees and ``resume()`` maps again. It has two hook modes:

- ``preload`` (SGLang's default): ``LD_PRELOAD`` of its
  ``torch_memory_saver_hook_mode_preload*.so`` intercepts ``cudaMalloc``/``cudaFree``.
  A region allocated while expandable segments are on goes through ``cuMemCreate``
  instead, which the hook never sees: ``pause()`` frees none of it (measured on an
  H200 with torch 2.11: 0 of 1280 MiB).
- ``torch``: a pluggable allocator behind a ``torch.cuda.MemPool``; the pool ignores
  the expandable-segments setting.

Independently of the mode, TMS refuses to start when ``PYTORCH_CUDA_ALLOC_CONF``
contains ``expandable_segments:True`` (``RuntimeError: TorchMemorySaver is disabled
for the current process because expandable_segments is not supported yet``), and a
spawned engine inherits the variable. Nothing here imports TMS (it imports numpy
and initialises CUDA hooks): the facts come from package metadata and the
environment.

Scope: reads the process environment; no side effects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

__all__ = ["PRELOAD_MARKER", "MemorySaverFacts", "memory_saver_facts"]

#: What every preload library of TMS has in its file name.
PRELOAD_MARKER = "torch_memory_saver_hook_mode_preload"
_REFUSED_SETTING = "expandable_segments:True"  # TMS's literal check (0.0.x)


@dataclass(frozen=True)
class MemorySaverFacts:
    """torch_memory_saver here: version, hook mode, and what blocks it.

    Attributes:
        version: the installed version (None: not installed).
        hook_mode: ``"preload"`` when ``LD_PRELOAD`` names its preload library,
            else ``"torch"`` (the only mode that works without it).
        preload_library: the library ``LD_PRELOAD`` names (None without).
        preload_library_exists: whether that file exists.
        refuses_to_start: ``PYTORCH_CUDA_ALLOC_CONF`` has ``expandable_segments:True``,
            which TMS refuses at its first use, in this process and its children.
        regions_not_pausable: in preload mode, expandable segments are in effect
            (by torch's rules, any variable), so regions allocated now are not freed
            by ``pause()``.
        problems: what blocks SGLang's memory saver, each with the fix.
        notes: what is worth knowing but not blocking.
    """

    version: str | None
    hook_mode: str
    preload_library: str | None
    preload_library_exists: bool
    refuses_to_start: bool
    regions_not_pausable: bool
    problems: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return {
            "version": self.version,
            "hook_mode": self.hook_mode,
            "preload_library": self.preload_library,
            "preload_library_exists": self.preload_library_exists,
            "refuses_to_start": self.refuses_to_start,
            "regions_not_pausable": self.regions_not_pausable,
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


def _installed_version() -> str | None:
    for name in ("torch-memory-saver", "torch_memory_saver"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def memory_saver_facts(
    *,
    expandable_effective: bool,
    env: Mapping[str, str] | None = None,
    version: str | None = None,
) -> MemorySaverFacts | None:
    """Return what blocks torch_memory_saver here, or None when it is not installed.

    Args:
        expandable_effective: whether expandable segments are in effect for torch
            at start-up, by torch's rules for this version (the doctor's allocator
            section knows which variable wins).
        env: the environment to read (default: this process's).
        version: the installed version (default: read from package metadata).

    Example:
        >>> facts = memory_saver_facts(expandable_effective=False)   # doctest: +SKIP
        >>> facts.hook_mode if facts else "not installed"            # doctest: +SKIP
        'preload'
    """
    environ = os.environ if env is None else env
    version = version if version is not None else _installed_version()
    if version is None:
        return None
    preloads = [p for p in environ.get("LD_PRELOAD", "").split(":") if PRELOAD_MARKER in p]
    library = preloads[0] if preloads else None
    mode = "preload" if library else "torch"
    refuses = _REFUSED_SETTING in environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "")
    unpausable = mode == "preload" and expandable_effective and not refuses
    problems: list[str] = []
    notes: list[str] = []
    if refuses:
        problems.append(
            f"torch_memory_saver {version}: PYTORCH_CUDA_ALLOC_CONF has "
            "expandable_segments:True, so it refuses to start here and in every engine "
            "process started from here (RuntimeError 'TorchMemorySaver is disabled ... "
            "expandable_segments is not supported yet'): SGLang's memory saver cannot "
            "run. Take it out of the env and turn expandable segments on for training "
            "only: hm.phase('train', backend='sglang')"
        )
    if unpausable:
        problems.append(
            f"torch_memory_saver {version} in preload mode with expandable segments in "
            "effect (PYTORCH_ALLOC_CONF): regions allocated now land in expandable "
            "segments, which pause() does not free (measured on an H200: 0 of 1280 MiB), "
            "so release_memory_occupation frees nothing. Take expandable_segments out of "
            "the env; allocate regions inside hm.phase('wake_up', backend='sglang')"
        )
    if len(preloads) > 1:
        problems.append(
            f"LD_PRELOAD names {len(preloads)} torch_memory_saver libraries; it asserts "
            "exactly one: keep one"
        )
    exists = bool(library) and Path(str(library)).is_file()
    if library and not exists:
        problems.append(
            f"LD_PRELOAD names {library}, which does not exist: the dynamic loader "
            "ignores it and torch_memory_saver's preload mode fails at its first region"
        )
    if mode == "torch":
        notes.append(
            f"torch_memory_saver {version}: no preload library in LD_PRELOAD, so only "
            "hook_mode='torch' works in this process (SGLang's default is preload: "
            "it sets LD_PRELOAD for its own scheduler processes)"
        )
    return MemorySaverFacts(
        version=version,
        hook_mode=mode,
        preload_library=library,
        preload_library_exists=exists,
        refuses_to_start=refuses,
        regions_not_pausable=unpausable,
        problems=tuple(problems),
        notes=tuple(notes),
    )
