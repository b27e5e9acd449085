"""One budget of synchronous set-up work per turn of the event loop, shared by every group.

A group's start is many small pieces of synchronous work (a rank's environment, its log
files, its pipes, a hand-off to a launcher, the record of a started worker). Each group
used to give the loop back every millisecond of its own, with a checkpoint: fine alone,
but asyncio runs every task that is ready, first in first out, before it looks at its
timers and I/O again. Sixty-four groups starting at once were sixty-four ready tasks, and
each turn of the loop ran a slice of every one of them back to back, 88-161 ms before a
timer got its turn.

:func:`pace` is called between two pieces of that work. The first call in a turn of the
loop opens the turn's budget (:data:`TURN` seconds, for all groups together) and asks the
loop, with ``call_soon``, to close it on its next iteration. Calls return at once while
the budget lasts; once it is spent, callers queue, first come first served, and the close
wakes them: they run on the iteration after it, by which time the timers and I/O that came
due in the meantime have run. So a task woken by a timer waits for at most three turns'
budgets and pieces of work (the turn under way when the timer comes due, the one queued
before the timer's callback, and the one queued before the task's wake-up, which asyncio
schedules from that callback), however many groups start at once; and the work itself
never waits for an idle loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import weakref

__all__ = ["TURN", "pace"]

#: Seconds of set-up work that all groups together may do in one turn of the event loop.
#: A task woken by a timer waits up to three turns and pieces of work (a worker's record is
#: about 0.5 ms on a loaded 2-core machine): ~6 ms. A turn costs the loop an iteration
#: (~0.1 ms with the wake-ups), so a shorter one would cost the burst's throughput.
TURN = 0.002
#: How many waiting callers the end of a turn wakes.
_WAKE = 8


class _Turns:
    """The budget of one event loop: when its turn opened, and who waits for the next."""

    # No reference to its loop: the loop is the key of this object in _TURNS, which would
    # then keep every loop that ever paced alive.
    def __init__(self) -> None:
        self.opened_at: float | None = None
        #: (ticket, waiter), the lowest ticket first: a caller woken too late for the
        #: budget of its turn waits again in the place it had.
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self._tickets = itertools.count()

    def open(self, now: float, loop: asyncio.AbstractEventLoop) -> None:
        self.opened_at = now
        # Runs on the loop's next iteration, with the callbacks made ready meanwhile and
        # the timers that came due; the callers it wakes run on the iteration after.
        loop.call_soon(self._close, loop)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def ticket(self) -> int:
        return next(self._tickets)

    async def wait(self, ticket: int, loop: asyncio.AbstractEventLoop) -> None:
        waiter = loop.create_future()
        entry = (ticket, waiter)
        heapq.heappush(self._waiting, entry)
        try:
            await waiter
        finally:
            # A caller woken was taken off the heap by _close; one cancelled (or
            # interrupted) may still be on it, and its place must not be woken.
            if (not waiter.done() or waiter.cancelled()) and entry in self._waiting:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)

    def _close(self, loop: asyncio.AbstractEventLoop) -> None:
        self.opened_at = None
        # A few at a time: each woken caller that finds the next turn's budget spent
        # costs a task step for nothing, and a turn rarely has room for more.
        for _ in range(min(_WAKE, len(self._waiting))):
            _, waiter = heapq.heappop(self._waiting)
            if not waiter.done():
                waiter.set_result(None)
        if self._waiting:
            # The next turn opens now, so that its end wakes the next few, even if the
            # ones woken here were cancelled before they ran.
            self.open(time.monotonic(), loop)


_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Turns]
_TURNS = weakref.WeakKeyDictionary()
#: The loop last paced and its turns. A look-up in _TURNS makes a weak reference, an
#: object for the garbage collector, and pace() runs a few times per worker started.
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], _Turns] | None = None


def _turns_of(loop: asyncio.AbstractEventLoop) -> _Turns:
    global _last
    last = _last  # one read: another thread's loop may replace it meanwhile
    if last is not None and last[0]() is loop:
        return last[1]
    turns = _TURNS.get(loop)
    if turns is None:
        turns = _TURNS[loop] = _Turns()
    _last = (weakref.ref(loop), turns)
    return turns


async def pace() -> None:
    """Return when this turn of the event loop has budget left for another piece of work.

    Returns at once (no checkpoint) while it has; otherwise waits, in the order of
    arrival, for a turn in which the loop ran its timers and I/O first. Cancellable
    while it waits.
    """
    loop = asyncio.get_running_loop()
    turns = _turns_of(loop)
    ticket: int | None = None
    while True:
        now = time.monotonic()
        if turns.opened_at is None:
            turns.open(now, loop)
            return
        if now - turns.opened_at < TURN and (ticket is not None or not turns.has_waiting()):
            return
        if ticket is None:
            ticket = turns.ticket()
        await turns.wait(ticket, loop)
