"""Where a rollout engine keeps its weights and KV cache: torch_memory_saver, vLLM's pool, by hand.

SGLang keeps both in torch_memory_saver (TMS) regions (tags ``weights`` and
``kv_cache``): allocated once, freed by ``pause()`` in ``release_memory_occupation``
and mapped again by ``resume()`` in ``resume_memory_occupation(tags)``, at the same
addresses. :class:`SaverMemory` does exactly that, in TMS's ``preload`` hook mode
(SGLang's default: the engine process starts with ``LD_PRELOAD`` of TMS's library,
see :func:`preload_env`) or its ``torch`` mode. :class:`HandmadeMemory` is the
fallback where TMS is missing: tensors freed and allocated again, the cache emptied.

vLLM keeps both in its sleep-mode pool (``CuMemAllocator``, tags ``weights`` and
``kv_cache``), the engine verl runs by default. :class:`VllmSleepMemory` runs vLLM's
own allocator code (installed vLLM, or its wheel's files named by
``HYBRIDMEM_VLLM_FILES``: :mod:`hybridmem.integrations.vllm.sleep_files`) the way verl
0.9.1 drives it: ``sleep`` at level 2 discards weights and KV cache (``vllm``), at
level 1 backs the weights up in host memory first (``vllm-l1``: LoRA adapters, MTP
drafters); each step wakes ``["weights"]``, syncs, then wakes ``["kv_cache"]``.

Any of them makes its weights the way engines do, one classic segment each, or packed
(``pack``, what the bench's ``hybridmem`` strategy asks for): back to back in one
segment, made inside :func:`hybridmem.one_segment`.

Both report what the engine holds *physically* (:meth:`EngineMemory.held`): torch
counts a paused region as reserved and allocated, though its memory is back on the
device; the trainer's hand-back figures need what is really held.

Scope: one engine process; not thread-safe (the engine serves one command at a time).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridmem.memory.one_segment import one_segment

__all__ = [
    "ENGINE_MEMORIES",
    "KV_ALIGN",
    "SLEEP_BACKENDS",
    "SLEEP_BACKEND_ENV",
    "VLLM_FILES_ENV",
    "EngineMemory",
    "HandmadeMemory",
    "SaverMemory",
    "VllmSleepMemory",
    "available",
    "kv_pieces",
    "kv_unit",
    "make_engine_memory",
    "memory_saver",
    "not_preloaded",
    "preload_env",
    "preload_library",
    "preloaded",
    "resolve",
    "vllm_files_problem",
]

#: What ``--engine`` accepts: TMS in either hook mode, vLLM's sleep-mode pool at sleep
#: level 2 (``vllm``) or 1 (``vllm-l1``), the hand-made engine, or ``auto`` (TMS in
#: preload mode when it is installed, else hand-made).
ENGINE_MEMORIES = ("auto", "tms", "tms-torch", "vllm", "vllm-l1", "handmade")
#: Where vLLM's allocator files are, where vLLM is not installed: its wheel, or a
#: folder of the files (:func:`hybridmem.integrations.vllm.sleep_files.extract`).
VLLM_FILES_ENV = "HYBRIDMEM_VLLM_FILES"
#: Which sleep-mode backend the bench's vLLM engine is slept through (``--sleep-backend``).
SLEEP_BACKEND_ENV = "HYBRIDMEM_BENCH_SLEEP_BACKEND"
#: The backends ``--sleep-backend`` takes: vLLM's default, and hybridmem's.
SLEEP_BACKENDS = ("cumem", "hybridmem")
GiB = 1 << 30
Shapes = Mapping[str, tuple[tuple[int, ...], str]]


def available() -> bool:
    """Whether torch_memory_saver is importable here (never imports it)."""
    return importlib.util.find_spec("torch_memory_saver") is not None


def memory_saver() -> Any:
    """TMS's process-wide ``torch_memory_saver`` object (imported on first use).

    torch_memory_saver is optional (the ``tms`` engine and strategy): imported by name,
    so that neither the package nor ``mypy --strict`` over it needs it installed.
    """
    return importlib.import_module("torch_memory_saver").torch_memory_saver


def preload_library() -> str | None:
    """TMS's preload library for this torch's CUDA major version (None: not installed).

    The wheel ships one per CUDA major (``..._preload_cu12``, ``..._preload_cu13``)
    beside the package folder; ``LD_PRELOAD`` must name exactly one.
    """
    spec = importlib.util.find_spec("torch_memory_saver")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))).parent
    major = (torch.version.cuda or "").split(".")[0]
    for pattern in (
        f"torch_memory_saver_hook_mode_preload_cu{major}.*.so",
        "torch_memory_saver_hook_mode_preload.*.so",
    ):
        found = sorted(folder.glob(pattern))
        if found:
            return str(found[0])
    return None


def vllm_files_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why vLLM's sleep-mode allocator cannot load here (None: it can; nothing imported).

    From ``HYBRIDMEM_VLLM_FILES`` (a vLLM wheel, or a folder of its allocator's files)
    where it is set, else from an installed vLLM.

    Example:
        >>> vllm_files_problem({"HYBRIDMEM_VLLM_FILES": "/nowhere"}).split(": ")[1]
        'no such wheel or folder (pip download --no-deps vllm==0.33.0)'
    """
    from hybridmem.integrations.vllm.sleep_files import first_missing

    env = os.environ if env is None else env
    source = env.get(VLLM_FILES_ENV)
    if source is None:
        if importlib.util.find_spec("vllm") is None:
            return (
                f"vLLM is not installed here: set {VLLM_FILES_ENV} to a vLLM wheel or a folder "
                "of its allocator's files (pip download --no-deps vllm==0.33.0; "
                "docs/backends/vllm.md says how), or pass --vllm-files"
            )
        return None
    path = Path(source)
    if path.is_file():
        return None  # a wheel: load_cumem extracts and checks it
    if not path.is_dir():
        return (
            f"{VLLM_FILES_ENV}={source}: no such wheel or folder "
            "(pip download --no-deps vllm==0.33.0)"
        )
    missing = first_missing(path)
    if missing is not None:
        return (
            f"{VLLM_FILES_ENV}={source} lacks {missing}: "
            "hybridmem.integrations.vllm.sleep_files.extract(wheel, folder) puts vLLM's files there"
        )
    return None


def resolve(kind: str) -> str:
    """Turn ``auto`` into what will run here; check the others.

    Raises:
        ValueError: an unknown kind.
        RuntimeError: ``tms``/``tms-torch`` asked for where TMS is not installed;
            ``vllm``/``vllm-l1`` where vLLM's allocator cannot load
            (:func:`vllm_files_problem`).
    """
    if kind not in ENGINE_MEMORIES:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_MEMORIES)}, got {kind!r}")
    if kind == "auto":
        return "tms" if available() and preload_library() else "handmade"
    if kind.startswith("tms") and not available():
        raise RuntimeError(
            f"engine {kind!r} needs torch_memory_saver: pip install torch-memory-saver "
            "(or pass --engine handmade)"
        )
    if kind.startswith("vllm"):
        problem = vllm_files_problem()
        if problem is not None:
            raise RuntimeError(f"engine {kind!r}: {problem}")
    return kind


def _without_saver(preload: str, library: str | None) -> list[str]:
    """The ``LD_PRELOAD`` entries that are not torch_memory_saver's libraries."""
    return [p for p in preload.split(":") if p and p != library and "torch_memory_saver" not in p]


def preloaded(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with TMS's preload library first in ``LD_PRELOAD``, once.

    For a process started with this environment (``subprocess``'s ``env=``). TMS
    refuses to start when ``LD_PRELOAD`` names its library twice (a process that runs
    preloaded and starts another the same way), so any earlier entry is replaced.

    Raises:
        RuntimeError: the library was not found (torch_memory_saver not installed).
    """
    library = preload_library()
    if library is None:
        raise RuntimeError("torch_memory_saver's preload library was not found")
    rest = _without_saver(env.get("LD_PRELOAD", ""), library)
    return {**env, "LD_PRELOAD": ":".join([library, *rest])}


def not_preloaded(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without TMS's libraries in ``LD_PRELOAD`` (the variable unset if empty)."""
    rest = _without_saver(env.get("LD_PRELOAD", ""), preload_library())
    out = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    if rest:
        out["LD_PRELOAD"] = ":".join(rest)
    return out


@contextlib.contextmanager
def preload_env(kind: str) -> Iterator[None]:
    """``LD_PRELOAD`` for an engine process started inside: TMS's library for ``tms`` only.

    A ``spawn`` child execs a new interpreter with this process's environment, so the
    variable reaches it; this process is not affected (the loader read it at exec).
    Any other engine starts without TMS's library, also when this process has it
    (the ``tms`` trainer strategy runs preloaded).
    """
    before = os.environ.get("LD_PRELOAD")
    wanted = (preloaded if kind == "tms" else not_preloaded)(os.environ).get("LD_PRELOAD")
    if wanted == before:
        yield
        return
    if wanted is None:
        os.environ.pop("LD_PRELOAD", None)
    else:
        os.environ["LD_PRELOAD"] = wanted
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


#: The KV cache's tensors are sized in whole 2 MiB pages (the driver's granularity).
KV_ALIGN = 2 << 20


def kv_pieces(shapes: Shapes) -> int:
    """How many tensors the KV cache is made of: two per layer of the model, as SGLang.

    SGLang's ``MHATokenToKVPool`` makes a ``k_buffer`` and a ``v_buffer`` per layer
    (``sglang/srt/mem_cache/memory_pool.py``), so torch_memory_saver creates and maps
    that many allocations at each KV wake. A KV cache made as one tensor is one
    allocation, which the driver creates 20-50 times slower after a trainer's free
    (``benchmarks/results/h200-2026-12-03/kv_pieces_probe.txt``). Layers are counted
    from the weights' names (``...layers.N...``); none named: one tensor.

    Example:
        >>> one = ((4, 4), "float32")
        >>> kv_pieces({"model.layers.0.w": one, "model.layers.1.w": one})
        4
    """
    layers = {m.group(1) for name in shapes if (m := re.search(r"layers\.(\d+)\.", name))}
    return 2 * len(layers) if layers else 1


def kv_unit(shapes: Shapes) -> int:
    """The bytes the KV cache is made in multiples of: one :data:`KV_ALIGN` page per piece.

    A cache of whole units splits into :func:`kv_pieces` equal tensors of whole pages,
    so it is exactly its target (32 MiB steps for a model of 8 layers, not whole GiB).

    Example:
        >>> one = ((4, 4), "float32")
        >>> kv_unit({"model.layers.0.w": one, "model.layers.1.w": one}) >> 20
        8
    """
    return kv_pieces(shapes) * KV_ALIGN


class EngineMemory:
    """An engine's weights and KV cache: wake by tags, sleep, say what is held."""

    name = ""

    def __init__(self, shapes: Shapes, kv_target: int, device: int) -> None:
        self.shapes = dict(shapes)
        self.kv_target = kv_target
        self.device = device
        self.weights: dict[str, torch.Tensor] | None = None
        self.kv: torch.Tensor | None = None
        self.kv_parts: list[torch.Tensor] = []  # the KV cache's tensors (kv: the first)
        self.kv_bytes = 0
        #: the weights made from now on are packed (what a hybridmem user's engine
        #: does, with hm.one_segment): no rounding of the allocator per weight stays
        #: cached beside them, inside a torch_memory_saver region or not
        self.pack = False
        self.pack_report = ""  # the last packing's SegmentReport, as text

    def _new_weights(self) -> dict[str, torch.Tensor]:
        """The weights, one classic segment each (as engines make them), or packed."""
        if not self.pack:
            return self._made("cuda")
        packing = one_segment(self._made("meta"))
        with packing:
            weights = self._made("cuda")
        self.pack_report = str(packing.report)
        return weights

    def _made(self, device: str) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for name, (shape, dtype) in self.shapes.items()
        }

    def _new_kv(self, target: int) -> list[torch.Tensor]:
        """Up to ``target`` bytes in :func:`kv_pieces` tensors (1 GiB less on OOM; [] if none).

        The target is cut to whole :func:`kv_unit`: each piece is a whole number of
        :data:`KV_ALIGN` pages; a cache too small to cut into that many pages is one
        tensor.
        """
        unit = kv_unit(self.shapes)
        size = target // unit * unit
        pieces = kv_pieces(self.shapes)
        while size > 0:
            each = size // pieces // KV_ALIGN * KV_ALIGN
            count = pieces if each else 1
            try:
                return [
                    torch.empty(each or size, dtype=torch.uint8, device="cuda")
                    for _ in range(count)
                ]
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()  # the pieces made before the OOM went with the list
                size -= GiB
        return []

    def _keep_kv(self, parts: list[torch.Tensor]) -> int:
        """Hold ``parts`` as the KV cache (``kv``: the first, which generation writes)."""
        self.kv_parts = parts
        self.kv = parts[0] if parts else None
        self.kv_bytes = sum(part.nbytes for part in parts)
        return self.kv_bytes

    def wake(self, tags: list[str]) -> int:
        """Take memory back for ``tags``; return the KV cache's bytes (0: no KV wake)."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Give the device memory back."""
        raise NotImplementedError

    def held(self) -> tuple[int, int]:
        """``(allocated, reserved)`` bytes this engine holds on the device now."""
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


class HandmadeMemory(EngineMemory):
    """The fallback engine: tensors freed on sleep (and the cache emptied), made on wake."""

    name = "handmade"

    def wake(self, tags: list[str]) -> int:
        if "weights" in tags:
            self.weights = self._new_weights()
        if "kv_cache" in tags:
            return self._keep_kv(self._new_kv(self.kv_target))
        return 0

    def sleep(self) -> None:
        self.weights = None
        self._keep_kv([])
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class _TaggedMemory(EngineMemory):
    """Weights and KV cache made once in an engine's tagged regions, put to sleep by tag.

    The regions are made at the first wake of each tag (the KV cache as large as
    ``kv_target`` allows then, as engines size it at start-up) and woken at the same
    addresses after. torch keeps counting a sleeping region as allocated and reserved,
    though its memory is back on the device: :meth:`held` takes it out.
    """

    def __init__(self, shapes: Shapes, kv_target: int, device: int) -> None:
        super().__init__(shapes, kv_target, device)
        self._asleep: set[str] = set()
        # What torch counts for each region (it keeps counting a sleeping one).
        self._counted: dict[str, tuple[int, int]] = {}

    def _region(self, tag: str) -> contextlib.AbstractContextManager[Any]:
        """Where the engine allocates ``tag``'s tensors."""
        raise NotImplementedError

    def _wake_tag(self, tag: str) -> None:
        """Map ``tag``'s sleeping region again."""
        raise NotImplementedError

    def _sleep_tags(self, tags: list[str]) -> None:
        """Put the regions of ``tags`` (awake, in the engine's order) to sleep."""
        raise NotImplementedError

    def _in_region(self, tag: str, make: Any) -> Any:
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        with self._region(tag):
            made = make()
        torch.cuda.synchronize()
        self._counted[tag] = (
            torch.cuda.memory_allocated() - allocated,
            torch.cuda.memory_reserved() - reserved,
        )
        return made

    def wake(self, tags: list[str]) -> int:
        obtained = 0
        for tag in ("weights", "kv_cache"):
            if tag not in tags:
                continue
            if tag in self._asleep:
                self._wake_tag(tag)
                self._asleep.discard(tag)
            elif tag == "weights" and self.weights is None:
                self.weights = self._in_region("weights", self._new_weights)
            elif tag == "kv_cache" and self.kv is None:
                self._keep_kv(self._in_region("kv_cache", lambda: self._new_kv(self.kv_target)))
            if tag == "kv_cache":
                obtained = self.kv_bytes
        return obtained

    def sleep(self) -> None:
        torch.cuda.synchronize()
        awake: list[str] = [
            t for t in ("kv_cache", "weights") if t in self._counted and t not in self._asleep
        ]
        if awake:
            self._sleep_tags(awake)
            self._asleep.update(awake)
        torch.cuda.empty_cache()  # what the engine made outside its regions

    def held(self) -> tuple[int, int]:
        allocated, reserved = super().held()
        for tag in self._asleep:
            counted_allocated, counted_reserved = self._counted[tag]
            allocated -= counted_allocated
            reserved -= counted_reserved
        return allocated, reserved


class SaverMemory(_TaggedMemory):
    """SGLang's way: weights and KV cache in TMS regions, paused and resumed by tag.

    Weights have no CPU backup (SGLang's default): the trainer syncs them after every
    wake.
    """

    def __init__(self, shapes: Shapes, kv_target: int, device: int, *, hook_mode: str) -> None:
        super().__init__(shapes, kv_target, device)
        self.saver = memory_saver()
        if hook_mode == "torch":
            self.saver.hook_mode = "torch"
        self.name = f"torch_memory_saver ({hook_mode})"
        self.hook_mode = hook_mode

    def _region(self, tag: str) -> contextlib.AbstractContextManager[Any]:
        return self.saver.region(tag=tag)  # type: ignore[no-any-return]

    def _wake_tag(self, tag: str) -> None:
        self.saver.resume(tag)

    def _sleep_tags(self, tags: list[str]) -> None:
        for tag in tags:  # SGLang's order: the KV cache, then the weights
            self.saver.pause(tag)


class VllmSleepMemory(_TaggedMemory):
    """vLLM's way: weights and KV cache in its ``CuMemAllocator`` pool, by tag.

    vLLM's own code runs (:func:`~hybridmem.integrations.vllm.sleep_files.load_cumem`:
    installed vLLM, or the files ``HYBRIDMEM_VLLM_FILES`` names), slept and woken
    through a sleep-mode backend as vLLM 0.33's GPU worker calls it: ``suspend(level)``
    for its ``sleep``, ``resume([tag])`` for ``wake_up``, one tag at a time as verl
    0.9.1 asks. The backend is :data:`SLEEP_BACKEND_ENV`'s: ``cumem`` (vLLM's own,
    from its ``sleep_mode_backend.py``; where the files lack it, the same
    ``CuMemAllocator.sleep``/``wake_up`` calls) or ``hybridmem``
    (:class:`~hybridmem.integrations.vllm.sleep_backend.HybridmemSleepModeBackend`,
    through vLLM's factory after hybridmem's plugin registered it; at level 1 its host
    memory is pinned when the weights are made, as ``reserve_sleep_backup`` at load).
    Level 2 discards both tags (the trainer syncs the weights after every wake), level
    1 keeps the weights in host memory.
    """

    def __init__(self, shapes: Shapes, kv_target: int, device: int, *, level: int) -> None:
        from hybridmem.integrations.vllm.plugin import register
        from hybridmem.integrations.vllm.sleep_files import load_cumem, load_sleep_backends

        super().__init__(shapes, kv_target, device)
        if level not in (1, 2):
            raise ValueError(f"vLLM sleep level must be 1 or 2, got {level!r}")
        backend = os.environ.get(SLEEP_BACKEND_ENV, "cumem")
        if backend not in SLEEP_BACKENDS:
            raise ValueError(
                f"{SLEEP_BACKEND_ENV}={backend!r}: the bench's vLLM sleep-mode backends are "
                f"{', '.join(SLEEP_BACKENDS)}"
            )
        files = os.environ.get(VLLM_FILES_ENV)
        cumem = load_cumem(files)
        if not cumem.cumem_available:
            raise RuntimeError("vLLM's cumem_allocator extension did not load on this machine")
        self.allocator = cumem.CuMemAllocator.get_instance()
        self.level = level
        self.backend: Any = None  # None: files of a vLLM before its backends
        try:
            factory = load_sleep_backends(files).SleepModeBackendFactory
            register()
            self.backend = factory.get_backend_class(backend)()
        except FileNotFoundError:
            if backend == "hybridmem":
                raise
        self.sleep_backend = backend
        self._reserved = False
        self.name = f"vllm sleep level {level} ({backend} backend)"

    def _region(self, tag: str) -> contextlib.AbstractContextManager[Any]:
        return self.allocator.use_memory_pool(tag=tag)  # type: ignore[no-any-return]

    def wake(self, tags: list[str]) -> int:
        obtained = super().wake(tags)
        made = self.weights is not None  # pin for them now, as reserve_sleep_backup at load
        if self.sleep_backend == "hybridmem" and self.level == 1 and made and not self._reserved:
            self.backend.pool.reserve(1)
            self._reserved = True
        return obtained

    def _wake_tag(self, tag: str) -> None:
        if self.backend is None:
            self.allocator.wake_up([tag])
        else:
            self.backend.resume([tag])

    def _sleep_tags(self, tags: list[str]) -> None:
        # vLLM's worker sleeps the whole pool in one call; what is asleep stays so.
        if self.backend is None:
            self.allocator.sleep(offload_tags=("weights",) if self.level == 1 else ())
        else:
            self.backend.suspend(self.level)


def make_engine_memory(kind: str, shapes: Shapes, kv_target: int, device: int) -> EngineMemory:
    """The engine memory for a resolved ``kind`` (see :func:`resolve`)."""
    if kind == "handmade":
        return HandmadeMemory(shapes, kv_target, device)
    if kind in ("tms", "tms-torch"):
        mode = "torch" if kind == "tms-torch" else "preload"
        return SaverMemory(shapes, kv_target, device, hook_mode=mode)
    if kind in ("vllm", "vllm-l1"):
        return VllmSleepMemory(shapes, kv_target, device, level=1 if kind == "vllm-l1" else 2)
    raise ValueError(f"unknown engine memory {kind!r}")
