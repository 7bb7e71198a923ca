"""PoolSleep: vLLM's pool slept and woken by hybridmem (a fake pool with vLLM 0.33's records).

The fake pool (:mod:`tests.fake_vllm_pool`) keeps vLLM's records and stands in for its
C extension and for ``CuMemAllocator.wake_up``, to check that what hybridmem's sleep
keeps, vLLM's own wake brings back.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem import _torch
from hybridmem._errors import EngineAsleepError, SleepPoolError
from hybridmem.integrations.vllm import sleep_pool
from hybridmem.integrations.vllm.sleep_pool import PoolSleep, kept_tags
from hybridmem.integrations.vllm.sleep_state import refuse_while_asleep
from hybridmem.scopes.garbage import GarbageGate
from tests.fake_vllm_pool import GARBAGE, FakePool, OldRecord, break_copies, fake_device


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> FakePool:
    fake = FakePool()
    fake.make(0x1000, 4096, "weights", 1)
    fake.make(0x9000, 8192, "weights", 2)
    fake.make(0x20000, 65536, "kv_cache", 3)
    fake.make(0x40000, 1024, "runtime", 4)
    fake.make(0x50000, 2048, "cudagraph", 5)
    fake.make(0x60000, 512, "workspace", 6)
    fake.pinned = fake_device(monkeypatch, fake)  # type: ignore[attr-defined]
    fake.free = 1 << 40  # type: ignore[attr-defined]
    monkeypatch.setattr(_torch, "mem_get_info", lambda index: (fake.free, 1 << 40))  # type: ignore[attr-defined]
    fake.releases = []  # type: ignore[attr-defined]

    def released(device: Any, **kwargs: Any) -> None:
        fake.releases.append(("full", device))  # type: ignore[attr-defined]

    def gate(self: Any, device: Any, key: str) -> None:
        fake.releases.append(("gate", device))  # type: ignore[attr-defined]

    monkeypatch.setattr(sleep_pool, "release_cache", released)
    monkeypatch.setattr(GarbageGate, "release", gate)
    return fake


def sleeper(pool: FakePool) -> PoolSleep:
    return PoolSleep(
        pool, create_and_map=pool.create_and_map, unmap_and_release=pool.unmap_and_release
    )


def filled(pool: FakePool, address: int, value: int) -> bool:
    return bool((pool.memory[address] == value).all())


KEPT_ALWAYS = ((0x40000, 4), (0x50000, 5))


def test_level_1_keeps_the_weights_runtime_and_graphs_byte_for_byte_pinned_once(
    pool: FakePool,
) -> None:
    s = sleeper(pool)
    assert s.reserve(1) == 4096 + 8192 + 1024 + 2048  # at load: exactly the kept tags
    for _ in range(100):
        report = s.suspend(1)
        assert report.pinned == 0  # nothing pinned in a sleep
        assert report.copied == 4096 + 8192 + 1024 + 2048
        assert all(d.is_asleep for d in pool.pointer_to_data.values())
        assert filled(pool, 0x1000, GARBAGE)  # the device memory is gone ...
        s.resume(["weights"])
        assert filled(pool, 0x1000, 1)
        assert filled(pool, 0x9000, 2)
        assert pool.pointer_to_data[0x20000].is_asleep  # the KV cache waits for its wake
        for address, value in KEPT_ALWAYS:  # any wake maps what is not deferrable
            assert filled(pool, address, value)
        s.resume(["kv_cache"])
        assert filled(pool, 0x20000, GARBAGE)  # discarded: fresh memory
        assert all(d.cpu_backup_tensor is None for d in pool.pointer_to_data.values())
    assert s.host_bytes == 4096 + 8192 + 1024 + 2048  # flat over 100 cycles
    assert pool.pinned == [s.host_bytes]  # type: ignore[attr-defined]  # one pinning


def test_reserve_makes_the_first_copy_into_each_place_it_pins_and_only_that(
    pool: FakePool,
) -> None:
    s = sleeper(pool)
    s.reserve(1)  # the first copy into fresh pages is the slow one: made at load
    assert sorted(pool.viewed) == [0x1000, 0x9000, 0x40000, 0x50000]
    assert filled(pool, 0x1000, 1)  # a read: the engine's memory is as it was
    pool.viewed.clear()
    assert s.reserve(1) == 0
    assert pool.viewed == []  # nothing new pinned, nothing copied
    pool.make(0x70000, 4096, "weights", 7)  # an allocation made since
    assert s.reserve(1) == 4096
    assert pool.viewed == [0x70000]  # only the new place gets its first copy
    pool.viewed.clear()
    s.suspend(1)
    assert sorted(pool.viewed) == [0x1000, 0x9000, 0x40000, 0x50000, 0x70000]  # once each
    s.resume(None)
    assert filled(pool, 0x70000, 7)


def test_reserve_while_asleep_copies_nothing_over_what_is_kept(pool: FakePool) -> None:
    s = sleeper(pool)
    s.suspend(1)  # pins in the sleep: its places hold the weights now
    pool.make(0x70000, 4096, "weights", 7)
    pool.viewed.clear()
    s.reserve(1)
    assert pool.viewed == [0x70000]  # the sleeping ones' places keep their bytes
    s.resume(None)
    assert filled(pool, 0x1000, 1)
    assert filled(pool, 0x9000, 2)


def test_level_2_discards_the_weights_and_keeps_runtime_and_graphs(pool: FakePool) -> None:
    s = sleeper(pool)
    s.suspend(2)
    assert pool.pointer_to_data[0x1000].cpu_backup_tensor is None
    assert pool.pointer_to_data[0x40000].cpu_backup_tensor is not None
    s.resume(None)
    assert filled(pool, 0x1000, GARBAGE)
    assert filled(pool, 0x20000, GARBAGE)
    for address, value in KEPT_ALWAYS:
        assert filled(pool, address, value)
    assert s.host_bytes == 1024 + 2048  # pinned in the sleep: nothing was reserved


def test_a_sleep_that_pins_says_so_once_with_the_fix(
    pool: FakePool, caplog: pytest.LogCaptureFixture
) -> None:
    from hybridmem import _log

    _log.reset_once()
    s = sleeper(pool)
    with caplog.at_level("INFO", logger="hybridmem"):
        s.suspend(1)
        s.resume(None)
        s.suspend(1)
    said = [r.getMessage() for r in caplog.records if "this sleep pinned" in r.getMessage()]
    assert len(said) == 1
    assert "reserve_sleep_backup" in said[0]


def test_vllms_own_wake_brings_back_what_hybridmems_sleep_kept(pool: FakePool) -> None:
    s = sleeper(pool)
    s.reserve(1)
    s.suspend(1)
    pool.wake_up(None)  # vLLM's CuMemAllocator.wake_up, not hybridmem's
    assert filled(pool, 0x1000, 1)
    assert filled(pool, 0x9000, 2)
    assert s.state() == "RUNNING"  # read from the records: vLLM's wake counts
    s.suspend(1)  # the places are reused
    assert pool.pinned == [s.host_bytes]  # type: ignore[attr-defined]


def test_state_is_exact_through_out_of_order_calls(pool: FakePool) -> None:
    s = sleeper(pool)
    assert s.state() == "RUNNING"
    s.resume(["weights"])  # nothing asleep: nothing to do
    assert s.state() == "RUNNING"
    assert not any(c.startswith("map") for c in pool.calls)
    s.suspend(1)
    calls = len(pool.calls)
    s.suspend(1)  # again: what sleeps stays as it is
    assert s.state() == "SUSPENDED"
    assert len(pool.calls) == calls
    s.resume(["kv_cache"])  # the KV cache before the weights
    assert s.state() == "SUSPENDED"
    assert pool.pointer_to_data[0x1000].is_asleep
    assert not pool.pointer_to_data[0x20000].is_asleep
    s.resume(["weights"])
    assert s.state() == "RUNNING"
    s.discard(("kv_cache",))
    assert s.state() == "SUSPENDED"
    assert pool.pointer_to_data[0x20000].cpu_backup_tensor is None
    s.discard(("kv_cache",))  # already discarded: nothing
    s.resume(None)
    assert s.state() == "RUNNING"


def test_a_sleep_at_another_level_keeps_what_sleeps_as_it_is(
    pool: FakePool, caplog: pytest.LogCaptureFixture
) -> None:
    s = sleeper(pool)
    s.suspend(2)
    with caplog.at_level("WARNING", logger="hybridmem"):
        s.suspend(1)
    assert "cannot change what already sleeps" in caplog.text
    assert pool.pointer_to_data[0x1000].cpu_backup_tensor is None  # still discarded


def test_a_failed_copy_leaves_the_pool_awake_and_untouched(
    pool: FakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = sleeper(pool)
    break_copies(monkeypatch)
    with pytest.raises(SleepPoolError, match=r"nothing was unmapped.*Asleep now: nothing"):
        s.suspend(1)
    assert not any(c.startswith("unmap") for c in pool.calls)
    assert s.state() == "RUNNING"


def test_a_failed_first_copy_at_reserve_says_so_and_the_next_reserve_copies_again(
    pool: FakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = sleeper(pool)
    with monkeypatch.context() as broken:
        break_copies(broken)
        with pytest.raises(SleepPoolError, match=r"first copy .* failed.*Asleep now: nothing"):
            s.reserve(1)
    assert s.host_bytes == 4096 + 8192 + 1024 + 2048  # pinned, and stays so
    assert s.state() == "RUNNING"
    pool.viewed.clear()
    assert s.reserve(1) == 0  # nothing more to pin ...
    assert sorted(pool.viewed) == [0x1000, 0x9000, 0x40000, 0x50000]  # ... the copy again
    s.suspend(1)
    s.resume(None)
    assert filled(pool, 0x9000, 2)


def test_a_failed_unmap_says_what_sleeps_and_a_wake_brings_the_kept_back(pool: FakePool) -> None:
    s = sleeper(pool)
    pool.fail_unmap_at = 2
    with pytest.raises(
        SleepPoolError, match=r"after unmapping 1 of 6.*weights 4\.00 KiB \(kept"
    ) as info:
        s.suspend(1)
    assert info.value.asleep == {"weights": 4096}
    assert info.value.kept == {"weights": 4096}
    assert s.state() == "SUSPENDED"
    pool.fail_unmap_at = None
    s.resume(None)
    assert filled(pool, 0x1000, 1)
    assert filled(pool, 0x9000, 2)
    assert s.state() == "RUNNING"


def test_a_failed_map_raises_what_sleeps_and_the_next_wake_finishes(pool: FakePool) -> None:
    s = sleeper(pool)
    s.reserve(1)
    s.suspend(1)
    pool.fail_map = ["CUDA Error: invalid device context at cumem_allocator.cpp:98"]
    with pytest.raises(SleepPoolError, match=r"the wake failed.*invalid device context") as info:
        s.resume(["weights"])
    assert info.value.kept["weights"] == 4096 + 8192  # both still kept
    assert s.state() == "SUSPENDED"
    s.resume(["weights"])
    assert filled(pool, 0x1000, 1)
    assert filled(pool, 0x9000, 2)


def test_a_mapping_that_fails_part_way_leaves_what_it_mapped_with_its_bytes(
    pool: FakePool,
) -> None:
    s = sleeper(pool)
    s.reserve(1)
    s.suspend(1)
    real = pool.create_and_map
    calls = [0]

    def second_fails(handle: tuple[int, int, int, int]) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("CUDA Error: injected")
        real(handle)

    s._map = second_fails
    with pytest.raises(SleepPoolError, match="the wake failed: CUDA Error: injected"):
        s.resume(None)
    first = pool.pointer_to_data[0x1000]
    assert not first.is_asleep
    assert filled(pool, 0x1000, 1)  # mapped before the failure: its bytes are back
    assert first.cpu_backup_tensor is None
    assert pool.pointer_to_data[0x9000].is_asleep  # the failed one still sleeps, kept
    s._map = real
    s.resume(None)
    assert filled(pool, 0x9000, 2)
    for address, value in KEPT_ALWAYS:
        assert filled(pool, address, value)


def test_a_wake_releases_the_cache_only_when_the_device_lacks_the_memory(pool: FakePool) -> None:
    s = sleeper(pool)
    s.suspend(2)
    assert pool.releases == [("gate", 0)]  # type: ignore[attr-defined]  # after a sleep: the gate
    s.resume(["weights"])
    assert pool.releases == [("gate", 0)]  # type: ignore[attr-defined]  # enough free memory
    s.suspend(2)
    pool.free = 100  # type: ignore[attr-defined]
    s.resume(["kv_cache"])
    assert pool.releases[-1] == ("full", 0)  # type: ignore[attr-defined]
    assert s.last is not None
    assert s.last.released


def test_a_mapping_refused_for_memory_gets_one_release_and_one_more_try(pool: FakePool) -> None:
    s = sleeper(pool)
    s.suspend(2)
    pool.fail_map = ["CUDA Error: out of memory at cumem_allocator.cpp:98"]
    s.resume(None)
    assert pool.releases[-1] == ("full", 0)  # type: ignore[attr-defined]
    assert s.state() == "RUNNING"
    s.suspend(2)
    pool.fail_map = ["CUDA Error: out of memory"] * 2
    with pytest.raises(SleepPoolError, match="out of memory"):
        s.resume(None)


def test_misuse_is_refused_with_what_to_pass(pool: FakePool) -> None:
    s = sleeper(pool)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match=r"sleep level must be 1 .* or 2"):
            s.suspend(level)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got the string 'weights': \['weights'\]"):
        s.resume("weights")
    with pytest.raises(TypeError, match="tags must be a sequence of tag names"):
        s.discard("kv_cache")
    with pytest.raises(TypeError, match=r"expected vLLM's CuMemAllocator.*got object"):
        PoolSleep(object(), create_and_map=print, unmap_and_release=print)
    with pytest.raises(TypeError, match=r"create_and_map must be vLLM's cumem\.create_and_map"):
        PoolSleep(pool, create_and_map=None, unmap_and_release=print)  # type: ignore[arg-type]
    s.reserve(1)
    s.suspend(1)
    with pytest.raises(RuntimeError, match="in host memory only: wake it"):
        s.close()
    s.resume(None)
    s.close()
    assert s.host_bytes == 0


def test_a_pool_without_the_asleep_flag_is_refused(pool: FakePool) -> None:
    pool.pointer_to_data = {0x1000: OldRecord((0, 4096, 0x1000, 0), "weights")}  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"before 0\.25"):
        sleeper(pool)


@pytest.fixture
def installed(pool: FakePool) -> Iterator[None]:
    """The fake pool where vLLM keeps its allocator, as the weight-transfer backend reads it."""
    module = types.ModuleType("vllm.device_allocator.cumem")
    module.CuMemAllocator = types.SimpleNamespace(instance=pool)  # type: ignore[attr-defined]
    before = sys.modules.get("vllm.device_allocator.cumem")
    sys.modules["vllm.device_allocator.cumem"] = module
    yield
    if before is None:
        del sys.modules["vllm.device_allocator.cumem"]
    else:
        sys.modules["vllm.device_allocator.cumem"] = before


def test_a_weight_update_while_the_weights_sleep_is_refused_and_after_their_wake_taken(
    pool: FakePool, installed: None
) -> None:
    s = sleeper(pool)
    s.suspend(2)
    with pytest.raises(EngineAsleepError, match="weight update came while vLLM's 'weights'"):
        refuse_while_asleep("weights", "a weight update")
    s.resume(["weights"])  # verl: weights, sync, then the KV cache
    refuse_while_asleep("weights", "a weight update")
    assert s.state() == "SUSPENDED"


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.one_of(
            st.tuples(st.just("suspend"), st.sampled_from([1, 2])),
            st.tuples(
                st.just("resume"),
                st.sampled_from([None, ("weights",), ("kv_cache",), ("runtime",)]),
            ),
            st.tuples(st.just("discard"), st.sampled_from([("kv_cache",), ("weights",)])),
        ),
        max_size=12,
    )
)
def test_random_lifecycles_keep_state_and_kept_bytes_exact(
    calls: list[tuple[str, Any]],
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        pool = FakePool()
        pool.make(0x1000, 4096, "weights", 1)
        pool.make(0x20000, 8192, "kv_cache", 3)
        pool.make(0x40000, 1024, "runtime", 4)
        fake_device(mp, pool)
        mp.setattr(_torch, "mem_get_info", lambda index: (1 << 40, 1 << 40))
        mp.setattr(GarbageGate, "release", lambda self, d, k: None)
        s = sleeper(pool)
        # what each allocation holds when awake, as a model: its value, or None (fresh)
        model: dict[int, int | None] = {0x1000: 1, 0x20000: 3, 0x40000: 4}
        asleep: dict[int, str] = {}  # address -> "kept" | "gone"
        tags = {0x1000: "weights", 0x20000: "kv_cache", 0x40000: "runtime"}
        for call, arg in calls:
            if call == "suspend":
                keep = kept_tags(arg)
                s.suspend(arg)
                for a in model:
                    if a not in asleep:
                        asleep[a] = "kept" if tags[a] in keep else "gone"
            elif call == "discard":
                s.discard(arg)
                for a in model:
                    if tags[a] in arg and a not in asleep:
                        asleep[a] = "gone"
            else:
                s.resume(None if arg is None else list(arg))
                for a in list(asleep):
                    woken = arg is None or tags[a] in arg or tags[a] not in ("weights", "kv_cache")
                    if woken and asleep.pop(a) == "gone":
                        model[a] = None
            assert s.state() == ("SUSPENDED" if asleep else "RUNNING")
            for a, value in model.items():
                data = pool.pointer_to_data[a]
                assert data.is_asleep == (a in asleep)
                assert (data.cpu_backup_tensor is not None) == (asleep.get(a) == "kept")
                if a not in asleep and value is not None:
                    assert filled(pool, a, value)
        s.resume(None)
