"""verl's batches handed from the event loop to the sending thread: in order, bounded, woken.

The drop-in's sender cuts verl's batches on the event loop (verl's weights may be an
async iterator, and a generator that gathers must run where the caller runs it) and
sends them from a thread. One batch waits at a time; the thread takes it without a trip
through the loop, and the loop, when it waits for room, is woken by the take.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from hybridmem._errors import SyncError
from hybridmem.integrations.verl.transfer import _Handover

BOUND_S = 30.0  # a lost wake-up fails the test instead of hanging it


def _taker(handover: _Handover, got: list[Any], until: object) -> threading.Thread:
    def run() -> None:
        while (item := handover.take()) is not until:
            got.append(item)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("count", [1, 2, 500])
def test_every_item_arrives_once_in_order_however_the_two_sides_interleave(count: int) -> None:
    async def main() -> list[Any]:
        end = object()
        handover = _Handover(asyncio.get_running_loop(), BOUND_S)
        got: list[Any] = []
        sending: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        thread = _taker(handover, got, end)
        for item in range(count):
            await asyncio.wait_for(handover.put(item, sending), BOUND_S)
        await asyncio.wait_for(handover.put(end, sending), BOUND_S)
        await asyncio.to_thread(thread.join, BOUND_S)
        assert not thread.is_alive()
        return got

    assert asyncio.run(main()) == list(range(count))


def test_a_put_that_waits_for_room_is_woken_by_the_take() -> None:
    async def main() -> None:
        handover = _Handover(asyncio.get_running_loop(), BOUND_S)
        sending: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await handover.put("first", sending)  # the one place
        second = asyncio.ensure_future(handover.put("second", sending))
        await asyncio.sleep(0)
        assert not second.done()  # full: it waits
        assert await asyncio.to_thread(handover.take) == "first"
        await asyncio.wait_for(second, BOUND_S)
        assert await asyncio.to_thread(handover.take) == "second"

    asyncio.run(main())


def test_a_put_returns_once_the_sending_thread_stopped() -> None:
    async def main() -> None:
        handover = _Handover(asyncio.get_running_loop(), BOUND_S)
        sending: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await handover.put("first", sending)
        waiting = asyncio.ensure_future(handover.put("second", sending))
        await asyncio.sleep(0)
        sending.set_result(0)  # the link failed: it takes nothing more
        await asyncio.wait_for(waiting, BOUND_S)
        await asyncio.wait_for(handover.put("third", sending), BOUND_S)  # at once

    asyncio.run(main())


def test_a_take_with_nothing_coming_is_a_bounded_sync_error() -> None:
    async def main() -> None:
        handover = _Handover(asyncio.get_running_loop(), 0.01)
        with pytest.raises(SyncError, match=r"gave no tensor for 0\.01 s .* the iterator is stuck"):
            await asyncio.to_thread(handover.take)

    asyncio.run(main())
