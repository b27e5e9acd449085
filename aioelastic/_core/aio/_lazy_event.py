"""An event that costs almost nothing until a task actually has to wait for it.

A supervised worker carries a few one-shot events (exited, settled, each stream
closed). An ``anyio.Event`` allocates an ``asyncio.Event`` and its waiter deque at
once, close to a kilobyte each; with hundreds of workers that is a good part of
what the supervisor holds per worker, for events that are almost always set
before anyone waits on them. :class:`LazyEvent` keeps a flag and makes the real
event only for a task that waits while it is not set.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import anyio.lowlevel


class LazyEvent:
    """``anyio.Event``'s ``set``/``is_set``/``wait``, with the event made on the first wait."""

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: anyio.Event | None = None

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set

    def set(self) -> None:
        """Set the flag and wake every waiter (idempotent)."""
        self._set = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Wait until the flag is set (a checkpoint, like ``anyio.Event.wait``, if it is)."""
        if self._set:
            await anyio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


async def wait_all(events: Iterable[LazyEvent]) -> None:
    """Wait until every one of ``events`` is set: one checkpoint, not one per event.

    Teardown waits on an event per worker (exited, settled, each stream closed) that is
    nearly always set already; a checkpoint for each would cost a turn of the event loop
    per worker, hundreds of them for a large group.
    """
    for event in events:
        if not event.is_set():
            await event.wait()
    await anyio.lowlevel.checkpoint()
