"""The output hub: fan-out, bounded buffers with gap counts, replay, end of stream."""

from __future__ import annotations

import anyio
import pytest

from aioelastic import Std
from aioelastic._output import OutputHub, OutputItem


def _lines(hub: OutputHub, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        hub.publish(i % 2, Std.OUT, b"line %d" % i, frame=False)


async def _collect(stream: object) -> list[OutputItem]:
    items = []
    with anyio.fail_after(5):
        async for item in stream:  # type: ignore[attr-defined]
            items.append(item)
    return items


@pytest.mark.asyncio
async def test_every_subscriber_sees_every_item_in_order() -> None:
    hub = OutputHub()
    first, second = hub.subscribe(), hub.subscribe()
    _lines(hub, 100)
    hub.publish(0, Std.ERR, b"50%", frame=True)
    hub.close()
    for stream in (first, second):
        items = await _collect(stream)
        assert [i.data for i in items[:100]] == [b"line %d" % i for i in range(100)]
        last = items[-1]
        assert (last.frame, last.stream, last.text) == (True, Std.ERR, "50%")
        assert all(i.missed == 0 for i in items)


@pytest.mark.asyncio
async def test_a_slow_subscriber_gets_a_gap_count_and_the_newest_items() -> None:
    hub = OutputHub()
    slow = hub.subscribe(buffer=10)
    fast = hub.subscribe()
    _lines(hub, 25)
    hub.close()
    items = await _collect(slow)
    # The 15 oldest were dropped; the first item kept says so.
    assert [i.data for i in items] == [b"line %d" % i for i in range(15, 25)]
    assert items[0].missed == 15
    assert sum(i.missed for i in items) == 15
    assert len(await _collect(fast)) == 25


@pytest.mark.asyncio
async def test_publishing_never_waits_for_a_reader() -> None:
    hub = OutputHub()
    hub.subscribe(buffer=1)  # never read
    with anyio.fail_after(5):
        _lines(hub, 100_000)


@pytest.mark.asyncio
async def test_late_subscriber_replays_history_or_starts_live() -> None:
    hub = OutputHub(history=5)
    _lines(hub, 8)
    replayed = hub.subscribe()
    live = hub.subscribe(replay=False)
    _lines(hub, 1, start=8)
    hub.close()
    items = await _collect(replayed)
    assert [i.data for i in items] == [b"line %d" % i for i in range(3, 9)]
    # The history no longer reaches back to the start: the first item says how much is gone.
    assert items[0].missed == 3
    assert [i.data for i in await _collect(live)] == [b"line 8"]


@pytest.mark.asyncio
async def test_reset_history_starts_replay_at_the_new_attempt() -> None:
    hub = OutputHub()
    _lines(hub, 3)
    hub.reset_history()
    hub.publish(0, Std.OUT, b"attempt 1", frame=False, rank=4, attempt=1)
    hub.close()
    items = await _collect(hub.subscribe())
    assert [(i.data, i.rank, i.attempt, i.missed) for i in items] == [(b"attempt 1", 4, 1, 0)]


@pytest.mark.asyncio
async def test_reader_waiting_wakes_on_publish_and_ends_on_close() -> None:
    hub = OutputHub()
    stream = hub.subscribe()
    got: list[bytes] = []

    async def read() -> None:
        async for item in stream:
            got.append(item.data)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            hub.publish(0, Std.OUT, b"hello", frame=False)
            await anyio.wait_all_tasks_blocked()
            assert got == [b"hello"]
            hub.close()
    assert got == [b"hello"]


@pytest.mark.asyncio
async def test_aclose_unsubscribes() -> None:
    hub = OutputHub()
    async with hub.subscribe() as stream:
        _lines(hub, 2)
    _lines(hub, 2)
    assert await _collect(stream) == []
    assert hub._subscribers == []


@pytest.mark.asyncio
async def test_subscribing_after_close_replays_then_ends() -> None:
    hub = OutputHub()
    _lines(hub, 2)
    hub.close()
    assert len(await _collect(hub.subscribe())) == 2
    assert await _collect(hub.subscribe(replay=False)) == []


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10"])
def test_bad_buffer_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="buffer must be a positive number of items"):
        OutputHub().subscribe(buffer=bad)  # type: ignore[arg-type]
