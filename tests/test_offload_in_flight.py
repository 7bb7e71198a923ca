"""An offload started and finished later: the copies queued, the storages freed at finish().

``Offloader.start_offload`` lets other device work (the switch's weight stages) run
while the offload's copies do; nothing is freed until ``finish()``, and ``cancel()``
frees nothing. On the CPU the streams are test_offload_free's fakes.
"""

from __future__ import annotations

import pytest
import torch

import hybridmem as hm
from hybridmem.memory.offload_free import OffloadInFlight
from tests.test_offload import _frozen_tensor, assert_bitwise_equal, make_model, snapshot
from tests.test_offload_free import chunks_of, fail_call, fresh, landings

__all__ = ["landings"]  # the fixture, used here by name


def storages_held(model: torch.nn.Module) -> bool:
    return all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_nothing_is_freed_until_finish_and_then_as_offload_does(landings: list[str]) -> None:
    model, optimizer, before, off = fresh()
    flight = off.start_offload()
    assert flight.pending
    assert "free" not in landings  # queued only
    assert storages_held(model)
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))  # readable meanwhile
    report = flight.finish()
    assert not flight.pending
    assert flight.report is report
    assert report.nbytes > 0
    assert off.offloaded_groups == set(report.groups)
    assert len(chunks_of(landings)) > 1  # freed and released chunk by chunk
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize("release_cache", [True, False])
def test_a_finished_flight_equals_an_offload(landings: list[str], release_cache: bool) -> None:
    model, optimizer, before, off = fresh()
    off.offload(release_cache=release_cache)
    off.reload()
    landings.clear()
    off.offload(release_cache=release_cache)
    by_offload = list(landings)
    off.reload()
    landings.clear()
    off.start_offload(release_cache=release_cache).finish()
    assert landings == by_offload
    assert ("empty_cache" in landings) is release_cache
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_every_other_call_is_refused_while_in_flight(landings: list[str]) -> None:
    model, optimizer, before, off = fresh()
    flight = off.start_offload()
    for call in (off.offload, off.start_offload, off.reload, off.close):
        with pytest.raises(RuntimeError, match=r"while an offload is in flight: call finish"):
            call()
    assert "free" not in landings
    flight.finish()
    off.reload()  # accepted again
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_cancel_frees_nothing_and_the_next_offload_runs(landings: list[str]) -> None:
    model, optimizer, before, off = fresh()
    flight = off.start_offload()
    flight.cancel()
    assert landings[-1] == "sync"  # the copies landed before the pool may be reused
    assert "free" not in landings
    assert not flight.pending
    assert off.offloaded_groups == frozenset()
    assert storages_held(model)
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.offload()
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize(
    ("first", "then"), [("finish", "finish"), ("cancel", "finish"), ("finish", "cancel")]
)
def test_a_flight_ends_once(landings: list[str], first: str, then: str) -> None:
    _, _, _, off = fresh()
    flight = off.start_offload()
    getattr(flight, first)()
    with pytest.raises(
        RuntimeError, match=rf"OffloadInFlight.{then}\(\): this offload has already ended"
    ):
        getattr(flight, then)()


def test_nothing_to_copy_is_a_flight_that_blocks_nothing(landings: list[str]) -> None:
    model, optimizer, before, off = fresh()
    off.offload()
    flight = off.start_offload()  # everything is offloaded already
    off.reload()  # not refused: nothing is in flight
    report = flight.finish()
    assert report.nbytes == 0
    assert_bitwise_equal(before, snapshot(model, optimizer))
    again = OffloadInFlight.done(report)
    assert again.pending
    assert again.finish() is report


def test_a_free_that_fails_at_finish_ends_the_flight_and_loses_nothing(
    landings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = fresh()
    flight = off.start_offload()
    fail_call(monkeypatch, "synchronize_event", 2, RuntimeError("injected: wait"))
    with pytest.raises(hm.OffloadError, match="those were reloaded from the host pool"):
        flight.finish()
    assert not flight.pending
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.offload()  # the Offloader is free again
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_target_that_cannot_be_freed_is_refused_at_start(landings: list[str]) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    imported = torch.nn.Parameter(_frozen_tensor(torch.arange(8.0)), requires_grad=False)
    model.register_parameter("imported", imported)
    off = hm.Offloader(model, optimizer)
    with pytest.raises(ValueError, match=r"cannot free targets\[0\]\.imported"):
        off.start_offload()
    assert landings[-1] == "sync"  # the copies queued landed before the error
    assert "free" not in landings
    model.imported = None  # type: ignore[assignment]
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off = hm.Offloader(model, optimizer)
    off.start_offload().finish()  # nothing was left in flight
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
