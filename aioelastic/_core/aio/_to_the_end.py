"""Run a teardown to its end even when the task awaiting it is cancelled by asyncio.

anyio's shielded cancel scopes stop anyio's own cancellation, not asyncio's: a
``task.cancel()`` raises ``CancelledError`` at the task's next ``await``, shield or not.
That is what ``asyncio.run`` does to the main task at Ctrl-C (Python 3.11+), and what a
caller's ``asyncio.wait_for`` or ``task.cancel()`` does. A teardown cut there leaves its
workers running, unreaped or with their pipes open. So the teardown runs in a task of its
own, which that cancellation does not reach, and the cancelled task waits for it as often
as it is cancelled, then passes the cancellation on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def to_the_end(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Await ``work()`` to its end; a cancellation meanwhile is raised after it, not in it.

    Raises:
        asyncio.CancelledError: this task was cancelled while ``work()`` ran (it still
            ran to its end).
        Exception: whatever ``work()`` raised.
    """
    task = asyncio.ensure_future(work())
    cancelled = await _wait_out(task)
    result = task.result()
    if cancelled is not None:
        raise cancelled
    return result


async def wait_out(task: asyncio.Future[Any]) -> None:
    """Wait until ``task`` is done, however it ends, even if this task is cancelled meanwhile.

    Does not look at how ``task`` ended (its result or exception stay for the caller).

    Raises:
        asyncio.CancelledError: this task was cancelled while waiting (raised once
            ``task`` is done).
    """
    cancelled = await _wait_out(task)
    if cancelled is not None:
        raise cancelled


async def _wait_out(task: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait until ``task`` is done; the cancellation of this task meanwhile, if any."""
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            # asyncio.wait, unlike a plain await, leaves the task running when the
            # waiter is cancelled.
            await asyncio.wait({task})
        except asyncio.CancelledError as exc:
            cancelled = exc
    return cancelled
