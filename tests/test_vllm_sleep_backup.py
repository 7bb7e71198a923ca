"""PoolBackup: vLLM's pool's tagged memory kept in host memory pinned once (a fake pool here).

The fake pool (:mod:`tests.fake_vllm_pool`) keeps vLLM 0.33's records; its "device"
memory is host tensors by address, which a sleep fills with garbage (discarded) and a
wake leaves as it is (vLLM maps fresh memory).
"""

from __future__ import annotations

import pytest

from hybridmem.integrations.vllm.sleep_backup import PoolBackup
from tests.fake_vllm_pool import GARBAGE, FakePool, OldRecord, break_copies, fake_device


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> FakePool:
    fake = FakePool()
    fake.make(0x1000, 4096, "weights", 1)
    fake.make(0x9000, 8192, "weights", 2)
    fake.make(0x20000, 65536, "kv_cache", 3)
    fake.pinned = fake_device(monkeypatch, fake)  # type: ignore[attr-defined]
    return fake


def test_the_tags_memory_comes_back_byte_for_byte_and_the_rest_is_discarded(
    pool: FakePool,
) -> None:
    backup = PoolBackup(pool)
    assert backup.reserve() == 4096 + 8192  # the weights, exactly, at start-up
    assert backup.reserve() == 0  # once
    for _ in range(3):
        backup.sleep()
        assert pool.calls[-1] == "sleep:()"  # vLLM discards the whole pool
        backup.wake_up(["weights"])
        assert bool((pool.memory[0x1000] == 1).all())
        assert bool((pool.memory[0x9000] == 2).all())
        assert pool.pointer_to_data[0x20000].is_asleep  # the KV cache still sleeps
        backup.wake_up(["kv_cache"])
        assert bool((pool.memory[0x20000] == GARBAGE).all())  # level 1: the KV cache is not kept
    assert backup.host_bytes == 4096 + 8192
    assert pool.pinned == [4096 + 8192]  # type: ignore[attr-defined]  # pinned once, exactly


def test_reserve_makes_the_first_copy_into_each_place_it_pins_and_a_sleep_one_more(
    pool: FakePool,
) -> None:
    backup = PoolBackup(pool)
    backup.reserve()  # the first copy into fresh pages is the slow one: made at start-up
    assert sorted(pool.viewed) == [0x1000, 0x9000]
    pool.viewed.clear()
    backup.reserve()
    assert pool.viewed == []  # nothing new pinned, nothing copied
    backup.sleep()
    assert sorted(pool.viewed) == [0x1000, 0x9000]  # the sleep's own copies, once each
    pool.make(0x40000, 2048, "weights", 7)  # made while asleep: mapped, nothing kept
    pool.viewed.clear()
    assert backup.reserve() == 2048
    assert pool.viewed == [0x40000]  # the sleeping ones' places keep their bytes
    backup.wake_up(None)
    assert bool((pool.memory[0x1000] == 1).all())


def test_allocations_made_or_freed_between_sleeps_are_placed_or_given_up(
    pool: FakePool,
) -> None:
    backup = PoolBackup(pool)
    backup.reserve()
    pool.make(0x40000, 2048, "weights", 7)  # an adapter loaded later
    backup.sleep()  # pins the new one's place then (it was not reserved)
    assert backup.host_bytes == 4096 + 8192 + 2048
    del pool.pointer_to_data[0x9000]  # freed while asleep
    backup.wake_up(None)
    assert bool((pool.memory[0x40000] == 7).all())
    assert bool((pool.memory[0x1000] == 1).all())
    assert backup.reserve() == 0


def test_a_failed_copy_leaves_the_pool_awake_and_untouched(
    pool: FakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    backup = PoolBackup(pool)
    break_copies(monkeypatch)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backup.sleep()
    assert pool.calls == []  # vLLM's sleep never ran
    assert not any(data.is_asleep for data in pool.pointer_to_data.values())


def test_close_says_what_it_loses(pool: FakePool, caplog: pytest.LogCaptureFixture) -> None:
    backup = PoolBackup(pool)
    backup.sleep()
    with caplog.at_level("WARNING", logger="hybridmem"):
        backup.close()
    assert "closed with 2 allocations asleep: their bytes are lost" in caplog.text
    assert backup.host_bytes == 0
    backup.close()


def test_misuse_is_refused_with_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"expected vLLM's CuMemAllocator.*got object"):
        PoolBackup(object())
    with pytest.raises(TypeError, match="tags must be a sequence of tag names, got 'weights'"):
        PoolBackup(FakePool(), tags="weights")
    with pytest.raises(ValueError, match="that is vLLM's level 2"):
        PoolBackup(FakePool(), tags=())


def test_a_pool_without_the_asleep_flag_is_refused_before_anything_moves(pool: FakePool) -> None:
    pool.pointer_to_data = {0x1000: OldRecord((0, 4096, 0x1000, 0), "weights")}  # type: ignore[dict-item]
    backup = PoolBackup(pool)
    with pytest.raises(TypeError, match=r"needs vLLM 0\.25 or later"):
        backup.sleep()
    assert pool.calls == []
