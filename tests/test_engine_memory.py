"""The bench engine's memory: torch_memory_saver regions (a fake TMS here) or by hand."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridmem.bench import anatomy, engine_memory
from hybridmem.bench.engine_memory import (
    KV_ALIGN,
    HandmadeMemory,
    SaverMemory,
    VllmSleepMemory,
    kv_pieces,
    kv_unit,
    make_engine_memory,
    preload_env,
    resolve,
)
from tests.conftest import patch_seam

MiB = 1 << 20
SHAPES = {"w": ((4, 4), "float32"), "b": ((4,), "bfloat16")}


class FakeSaver:
    """torch_memory_saver's API: regions by tag, pause/resume, a hook mode."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.hook_mode = "preload"
        self.tag: str | None = None

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        self.calls.append(f"region:{tag}")
        self.tag = tag
        try:
            yield
        finally:
            self.tag = None

    def pause(self, tag: str) -> None:
        self.calls.append(f"pause:{tag}")

    def resume(self, tag: str) -> None:
        self.calls.append(f"resume:{tag}")


class FakeCuda:
    """Device memory counters on the CPU: what torch.cuda reports."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0


@pytest.fixture
def cpu_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Tensors made on the CPU, counted as device memory (2 MiB segments)."""
    counters = FakeCuda()
    real_empty = torch.empty

    def empty(*shape: Any, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        if str(device) == "meta":  # sizes without memory: nothing counted
            return real_empty(*shape, dtype=dtype, device="meta")
        tensor = real_empty(*shape, dtype=dtype)
        counters.allocated += tensor.nbytes
        counters.reserved += -(-tensor.nbytes // (2 * MiB)) * 2 * MiB
        return tensor

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: counters.allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: counters.reserved)
    return counters


@pytest.fixture
def saver(monkeypatch: pytest.MonkeyPatch) -> FakeSaver:
    fake = FakeSaver()
    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    return fake


def test_handmade_frees_on_sleep_and_makes_again_on_wake(cpu_cuda: FakeCuda) -> None:
    memory = HandmadeMemory(SHAPES, 3 * (1 << 30), 0)
    assert memory.wake(["weights"]) == 0
    assert memory.weights is not None
    assert memory.weights["b"].dtype == torch.bfloat16
    assert memory.wake(["kv_cache"]) == 3 << 30  # whole GiB
    memory.sleep()
    assert memory.weights is None
    assert memory.kv is None
    assert memory.name == "handmade"


def test_saver_allocates_regions_once_then_pauses_and_resumes_by_tag(
    cpu_cuda: FakeCuda, saver: FakeSaver
) -> None:
    memory = SaverMemory(SHAPES, 1 << 30, 0, hook_mode="preload")
    assert memory.name == "torch_memory_saver (preload)"
    memory.wake(["weights"])
    assert memory.wake(["kv_cache"]) == 1 << 30
    weights, kv = memory.weights, memory.kv
    assert kv is not None
    assert saver.calls == ["region:weights", "region:kv_cache"]
    held_awake = memory.held()
    memory.sleep()
    assert saver.calls[-2:] == ["pause:kv_cache", "pause:weights"]  # SGLang's order
    # torch still counts paused regions; what is held is what is outside them: nothing
    assert (cpu_cuda.allocated, cpu_cuda.reserved) == held_awake
    assert memory.held() == (0, 0)
    memory.wake(["weights"])
    assert saver.calls[-1] == "resume:weights"
    assert memory.weights is weights  # the same tensors, at the same addresses
    assert memory.held()[0] == held_awake[0] - kv.nbytes
    memory.wake(["kv_cache"])
    assert saver.calls[-1] == "resume:kv_cache"
    assert memory.kv is kv
    assert memory.held() == held_awake
    memory.sleep()
    memory.sleep()  # twice: nothing paused twice
    assert saver.calls.count("pause:kv_cache") == 2


def test_torch_hook_mode_is_set_before_first_use(cpu_cuda: FakeCuda, saver: FakeSaver) -> None:
    memory = make_engine_memory("tms-torch", SHAPES, 1 << 30, 0)
    assert isinstance(memory, SaverMemory)
    assert saver.hook_mode == "torch"
    assert memory.name == "torch_memory_saver (torch)"
    assert isinstance(make_engine_memory("handmade", SHAPES, 0, 0), HandmadeMemory)
    with pytest.raises(ValueError, match="unknown engine memory"):
        make_engine_memory("sglang", SHAPES, 0, 0)


class FakeCuMem:
    """vLLM's ``CuMemAllocator`` as the bench engine drives it: pool by tag, sleep, wake."""

    instance: FakeCuMem | None = None

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.tag: str | None = None

    @classmethod
    def get_instance(cls) -> FakeCuMem:
        if cls.instance is None:
            cls.instance = cls()
        return cls.instance

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        self.calls.append(f"pool:{tag}")
        self.tag = tag
        try:
            yield
        finally:
            self.tag = None

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        self.calls.append(f"sleep:{offload_tags!r}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up:{tags!r}")


@pytest.fixture
def cumem(monkeypatch: pytest.MonkeyPatch) -> FakeCuMem:
    from hybridmem.integrations.vllm import sleep_files

    FakeCuMem.instance = None
    module = types.SimpleNamespace(CuMemAllocator=FakeCuMem, cumem_available=True)
    sources: list[object] = []

    def load(source: object = None) -> object:
        sources.append(source)
        return module

    monkeypatch.setattr(sleep_files, "load_cumem", load)
    monkeypatch.setenv("HYBRIDMEM_VLLM_FILES", "/files")
    allocator = FakeCuMem.get_instance()
    allocator.sources = sources  # type: ignore[attr-defined]
    return allocator


def test_the_vllm_engines_sleep_backend_is_checked_and_needs_the_factory_file(
    cpu_cuda: FakeCuda, cumem: FakeCuMem, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDMEM_BENCH_SLEEP_BACKEND", "criu")
    with pytest.raises(ValueError, match="backends are cumem, hybridmem"):
        make_engine_memory("vllm", SHAPES, 1 << 30, 0)
    monkeypatch.setenv("HYBRIDMEM_BENCH_SLEEP_BACKEND", "hybridmem")
    with pytest.raises(FileNotFoundError, match=r"sleep_mode_backend\.py: missing"):
        make_engine_memory("vllm", SHAPES, 1 << 30, 0)  # the files lack vLLM's factory


@pytest.mark.parametrize(("kind", "offload"), [("vllm", "()"), ("vllm-l1", "('weights',)")])
def test_vllm_engine_sleeps_its_pool_as_verl_asks_at_each_level(
    kind: str, offload: str, cpu_cuda: FakeCuda, cumem: FakeCuMem
) -> None:
    memory = make_engine_memory(kind, SHAPES, 1 << 30, 0)
    assert isinstance(memory, VllmSleepMemory)
    assert cumem.sources == ["/files"]  # type: ignore[attr-defined]
    assert memory.name == f"vllm sleep level {2 if kind == 'vllm' else 1} (cumem backend)"
    memory.wake(["weights"])
    assert memory.wake(["kv_cache"]) == 1 << 30
    weights, kv = memory.weights, memory.kv
    assert kv is not None
    assert cumem.calls == ["pool:weights", "pool:kv_cache"]
    held_awake = memory.held()
    memory.sleep()
    # the whole pool in one call, as vLLM's worker does: level 2 keeps nothing
    assert cumem.calls[-1] == f"sleep:{offload}"
    assert memory.held() == (0, 0)
    memory.sleep()  # asleep already: vLLM is not asked again
    assert cumem.calls.count(f"sleep:{offload}") == 1
    # verl's order: weights, the sync, then the KV cache; the same tensors again
    memory.wake(["weights"])
    assert cumem.calls[-1] == "wake_up:['weights']"
    assert memory.weights is weights
    assert memory.held()[0] == held_awake[0] - kv.nbytes
    assert memory.wake(["kv_cache"]) == 1 << 30
    assert cumem.calls[-1] == "wake_up:['kv_cache']"
    assert memory.kv is kv
    assert memory.held() == held_awake


def test_vllm_engine_refuses_a_level_vllm_has_no_pool_for(
    cpu_cuda: FakeCuda, cumem: FakeCuMem
) -> None:
    with pytest.raises(ValueError, match="level must be 1 or 2, got 0"):
        VllmSleepMemory(SHAPES, 0, 0, level=0)


def test_vllm_engine_needs_vllms_files_and_says_where_to_get_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hybridmem.integrations.vllm.sleep_files import FILES

    monkeypatch.delenv("HYBRIDMEM_VLLM_FILES", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no vLLM here
    with pytest.raises(RuntimeError, match=r"engine 'vllm': vLLM is not installed here.*--vllm"):
        resolve("vllm")
    monkeypatch.setenv("HYBRIDMEM_VLLM_FILES", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="nowhere: no such wheel or folder"):
        resolve("vllm-l1")
    monkeypatch.setenv("HYBRIDMEM_VLLM_FILES", str(tmp_path))
    with pytest.raises(RuntimeError, match=f"lacks {FILES[0]}"):
        resolve("vllm")
    for name in FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    assert resolve("vllm") == "vllm"
    assert resolve("vllm-l1") == "vllm-l1"
    wheel = tmp_path / "vllm-0.33.0.whl"
    wheel.write_bytes(b"")
    monkeypatch.setenv("HYBRIDMEM_VLLM_FILES", str(wheel))  # a wheel: checked when loaded
    assert resolve("vllm") == "vllm"


def test_resolve_picks_tms_only_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_memory, "available", lambda: False)
    assert resolve("auto") == "handmade"
    with pytest.raises(RuntimeError, match="pip install torch-memory-saver"):
        resolve("tms")
    monkeypatch.setattr(engine_memory, "available", lambda: True)
    monkeypatch.setattr(engine_memory, "preload_library", lambda: "/x/lib.so")
    assert resolve("auto") == "tms"
    assert resolve("tms-torch") == "tms-torch"
    with pytest.raises(ValueError, match="engine must be one of"):
        resolve("fast")


def test_preload_env_is_set_for_the_child_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_memory, "preload_library", lambda: "/x/tms_preload.so")
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    with preload_env("tms"):
        assert os.environ["LD_PRELOAD"] == "/x/tms_preload.so:/other.so"
    assert os.environ["LD_PRELOAD"] == "/other.so"
    monkeypatch.delenv("LD_PRELOAD")
    with preload_env("tms"):
        assert os.environ["LD_PRELOAD"] == "/x/tms_preload.so"
    assert "LD_PRELOAD" not in os.environ
    with preload_env("tms-torch"):  # torch mode needs no preload
        assert "LD_PRELOAD" not in os.environ
    monkeypatch.setattr(engine_memory, "preload_library", lambda: None)
    with pytest.raises(RuntimeError, match="preload library was not found"), preload_env("tms"):
        pass


def test_a_preloaded_process_starts_its_engine_with_the_library_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # TMS asserts that LD_PRELOAD names its library exactly once: the tms trainer
    # strategy runs preloaded, and its engine process inherits that environment.
    library = "/site/torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    monkeypatch.setattr(engine_memory, "preload_library", lambda: library)
    monkeypatch.setenv("LD_PRELOAD", f"{library}:/other.so")
    with preload_env("tms"):
        assert os.environ["LD_PRELOAD"] == f"{library}:/other.so"
    with preload_env("tms-torch"):  # another hook mode: the engine starts without it
        assert os.environ["LD_PRELOAD"] == "/other.so"
    with preload_env("handmade"):
        assert os.environ["LD_PRELOAD"] == "/other.so"
    assert os.environ["LD_PRELOAD"] == f"{library}:/other.so"
    assert engine_memory.preloaded({"LD_PRELOAD": library}) == {"LD_PRELOAD": library}
    assert engine_memory.not_preloaded({"LD_PRELOAD": library, "A": "1"}) == {"A": "1"}


def test_preload_library_matches_the_cuda_major(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "torch_memory_saver"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("preload_cu12", "preload_cu13"):
        (tmp_path / f"torch_memory_saver_hook_mode_{name}.abi3.so").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert str(engine_memory.preload_library()).endswith("preload_cu13.abi3.so")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert str(engine_memory.preload_library()).endswith("preload_cu12.abi3.so")


def test_anatomy_names_what_holds_a_cached_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    python_frame = {"filename": "/srv/train.py", "line": 12, "name": "build"}
    snapshot = {
        "segments": [
            {
                "total_size": 852 * MiB,
                "allocated_size": 32 * MiB,
                "is_expandable": False,
                "segment_type": "large",
                "stream": 0,
                "blocks": [
                    {
                        "state": "active_allocated",
                        "size": 32 * MiB,
                        "frames": [{"filename": "??", "line": 0, "name": "torch::unwind"}],
                    },
                    {"state": "inactive", "size": 820 * MiB},
                ],
            },
            {
                "total_size": 12 * MiB,
                "allocated_size": 11 * MiB,
                "segment_type": "large",
                "stream": 0,
                "blocks": [
                    {
                        "state": "active_allocated",
                        "size": 11 * MiB,
                        "frames": [
                            {"filename": "/x/torch/nn/module.py", "line": 1, "name": "to"},
                            python_frame,
                        ],
                    }
                ],
            },
            {"total_size": 2 * MiB, "allocated_size": 2 * MiB, "blocks": []},  # full: left out
        ]
    }
    patch_seam(monkeypatch, "snapshot", lambda: snapshot)
    found = anatomy.cache_anatomy()
    assert found["cached"] == 821 * MiB
    first, second = found["segments"]
    assert (first["kind"], first["total"], first["cached"], first["live_blocks"]) == (
        "classic",
        852 * MiB,
        820 * MiB,
        1,
    )
    assert first["holders"][0]["where"] == "??:0 torch::unwind"  # no Python frame: C++
    assert second["holders"][0]["where"] == "/srv/train.py:12 build"
    assert anatomy.where(None) == "unknown (memory history off)"
    patch_seam(monkeypatch, "snapshot", lambda: None)
    assert anatomy.cache_anatomy() == {}


class Packing:
    """hm.one_segment recorded: its sizes, and the region open when it was entered."""

    def __init__(self, saver: FakeSaver | None = None) -> None:
        self.saver = saver
        self.entries: list[tuple[str | None, list[str], list[str]]] = []

    def __call__(self, sizes: dict[str, torch.Tensor]) -> Any:
        packing = self

        class Scope:
            report = "one_segment: packed"

            def __enter__(self) -> Scope:
                tag = packing.saver.tag if packing.saver else None
                devices = sorted({str(t.device) for t in sizes.values()})
                packing.entries.append((tag, sorted(sizes), devices))
                return self

            def __exit__(self, *exc: object) -> None:
                return None

        return Scope()


def test_a_packed_saver_makes_its_weights_in_one_segment_inside_their_region(
    cpu_cuda: FakeCuda, saver: FakeSaver, monkeypatch: pytest.MonkeyPatch
) -> None:
    packing = Packing(saver)
    monkeypatch.setattr(engine_memory, "one_segment", packing)
    memory = SaverMemory(SHAPES, 1 << 30, 0, hook_mode="preload")
    memory.pack = True
    memory.wake(["weights", "kv_cache"])
    # Sized by meta tensors of the weights' shapes, entered inside the weights' region.
    assert packing.entries == [("weights", ["b", "w"], ["meta"])]
    assert memory.pack_report == "one_segment: packed"
    memory.sleep()
    memory.wake(["weights"])  # resumed, not made again
    assert len(packing.entries) == 1


@pytest.mark.parametrize("pack", [False, True])
def test_a_handmade_engine_packs_each_making_only_when_asked(
    pack: bool, cpu_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    packing = Packing()
    monkeypatch.setattr(engine_memory, "one_segment", packing)
    memory = HandmadeMemory(SHAPES, 1 << 30, 0)
    memory.pack = pack
    memory.wake(["weights"])
    memory.sleep()
    memory.wake(["weights"])
    assert len(packing.entries) == (2 if pack else 0)
    assert memory.weights is not None
    assert memory.weights["w"].shape == (4, 4)


def test_the_engine_packs_on_request_and_reports_it(cpu_cuda: FakeCuda) -> None:
    from hybridmem.bench.engine import _Engine

    memory = HandmadeMemory(SHAPES, 1 << 30, 0)
    engine = _Engine(memory, conn=None, device=0)  # type: ignore[arg-type]
    assert engine.run("pack_weights", []) == ("ok",)
    assert memory.pack
    memory.pack_report = "compact: packed"
    assert engine.run("pack_report", []) == ("ok", "compact: packed")


LAYERED = {
    "model.layers.0.w": ((4, 4), "float32"),
    "model.layers.0.b": ((4,), "float32"),
    "model.layers.1.w": ((4, 4), "float32"),
    "model.layers.10.w": ((4, 4), "float32"),
    "lm_head.weight": ((4, 4), "float32"),
}


def test_kv_pieces_are_two_per_named_layer() -> None:
    assert kv_pieces(LAYERED) == 6  # layers 0, 1 and 10: a K and a V tensor each
    assert kv_pieces(SHAPES) == 1  # no layer named: one tensor, as before


def test_the_kv_cache_is_made_of_one_tensor_per_layer_and_kind(cpu_cuda: FakeCuda) -> None:
    memory = HandmadeMemory(LAYERED, 3 << 30, 0)
    assert memory.wake(["kv_cache"]) == 6 * (512 << 20)
    assert [part.nbytes for part in memory.kv_parts] == [512 << 20] * 6
    assert memory.kv is memory.kv_parts[0]  # what generation writes
    assert all(part.nbytes % KV_ALIGN == 0 for part in memory.kv_parts)
    memory.sleep()
    assert memory.kv is None
    assert memory.kv_parts == []


def test_an_uneven_kv_cache_is_cut_to_whole_pages(cpu_cuda: FakeCuda) -> None:
    memory = HandmadeMemory(LAYERED, 1 << 30, 0)
    made = memory.wake(["kv_cache"])
    assert made == 6 * ((1 << 30) // 6 // KV_ALIGN * KV_ALIGN)
    assert made <= 1 << 30
    assert sum(part.nbytes for part in memory.kv_parts) == made


def test_a_kv_cache_of_whole_units_is_made_to_the_byte(cpu_cuda: FakeCuda) -> None:
    unit = kv_unit(LAYERED)
    assert unit == 6 * KV_ALIGN  # a page per piece
    target = 90 * unit  # 1080 MiB: not a whole GiB
    memory = HandmadeMemory(LAYERED, target, 0)
    assert memory.wake(["kv_cache"]) == target
    assert [part.nbytes for part in memory.kv_parts] == [target // 6] * 6
    memory.sleep()
    memory = HandmadeMemory(LAYERED, target + 7 * MiB, 0)  # cut to whole units
    assert memory.wake(["kv_cache"]) == target


def test_an_oom_in_any_piece_makes_the_whole_cache_1_gib_smaller(
    cpu_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = torch.empty  # cpu_cuda's
    calls: list[int] = []

    def empty(*shape: Any, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        calls.append(shape[0])
        if len(calls) == 3:  # the third piece of the first try: the device is full
            raise torch.OutOfMemoryError("CUDA out of memory")
        return made(*shape, dtype=dtype, device=device)

    monkeypatch.setattr(torch, "empty", empty)
    memory = HandmadeMemory(LAYERED, 3 << 30, 0)
    obtained = memory.wake(["kv_cache"])
    each = (2 << 30) // 6 // KV_ALIGN * KV_ALIGN
    assert obtained == 6 * each == memory.kv_bytes  # 2 GiB in six pieces, not 3 GiB
    assert len(memory.kv_parts) == 6
    assert calls[:3] == [(3 << 30) // 6 // KV_ALIGN * KV_ALIGN] * 3


def test_a_cache_that_fits_nowhere_is_none(
    cpu_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*shape: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", full)
    memory = HandmadeMemory(LAYERED, 2 << 30, 0)
    assert memory.wake(["kv_cache"]) == 0
    assert memory.kv is None
    assert memory.kv_parts == []
