from __future__ import annotations

import anyio
import pytest

from aioelastic._core.aio._lazy_event import LazyEvent

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def test_waiters_before_set_are_woken_and_a_later_wait_returns_at_once() -> None:
    event = LazyEvent()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await event.wait()
        woken.append(n)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, 1)
            tg.start_soon(waiter, 2)
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            assert not event.is_set()
            event.set()
        assert sorted(woken) == [1, 2]
        assert event.is_set()
        await event.wait()


async def test_a_wait_on_a_set_event_is_a_checkpoint() -> None:
    # As with anyio.Event: a cancelled task waiting on a set event is still cancelled.
    event = LazyEvent()
    event.set()
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await event.wait()
        reached = True
    assert scope.cancelled_caught
    assert not reached
