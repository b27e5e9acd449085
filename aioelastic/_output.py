"""Worker output as an async stream: every line and progress frame, for any number of readers.

The log pumps (:mod:`._logs`) cut each worker stream into lines and ``\\r`` frames once; the
same pieces that go to the console are handed to an :class:`OutputHub`, which fans them out
to its subscribers. A subscriber is an :class:`OutputStream`, an async iterator of
:class:`OutputItem`.

Two rules shape it, both so that a reader can never hurt the job it watches:

* Publishing never waits. A subscriber has a bounded buffer; when it is full the *oldest*
  buffered item is dropped (the reader is behind, and the newest output is what a live view
  wants) and the next item it receives carries ``missed``, the number of items it lost.
  The log files, written by the pump before any of this, still have every byte.
* A late subscriber may replay: the hub keeps the most recent items of the current run in a
  bounded history, and a subscriber made with ``replay=True`` starts with them (its first
  item carries ``missed`` when the history no longer reaches back to the start).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType

import anyio

from ._std import Std

__all__ = ["OutputItem", "OutputStream"]

#: Items a subscriber may have buffered before the oldest are dropped.
DEFAULT_BUFFER = 10_000
#: Items the hub keeps for late subscribers that ask to replay.
HISTORY_ITEMS = 10_000


@dataclass(frozen=True, slots=True)
class OutputItem:
    """One line (or one ``\\r`` progress frame) that a worker wrote.

    Attributes:
        local_rank: The worker's local rank.
        stream: ``Std.OUT`` or ``Std.ERR``.
        data: The bytes, without the line ending (``\\n`` or the frame's ``\\r``).
        frame: ``True`` for a progress frame ended by ``\\r`` (the next frame redraws it),
            ``False`` for a line ended by ``\\n`` (or by the end of the stream).
        time: When the supervisor read it, in ``time.monotonic()`` seconds.
        missed: Items this subscriber lost just before this one because it read too slowly
            (0 normally). The log files still hold them.
        rank: The global rank under the elastic agent, else ``None``.
        attempt: The restart count under the elastic agent (0 for the first), else ``None``.
    """

    local_rank: int
    stream: Std
    data: bytes
    frame: bool
    time: float
    missed: int = 0
    rank: int | None = None
    attempt: int | None = None

    @property
    def text(self) -> str:
        """``data`` decoded as UTF-8, undecodable bytes replaced."""
        return self.data.decode("utf-8", "replace")


class OutputStream:
    """One subscriber's view of a group's output: ``async for item in stream``.

    Iteration ends once the workers' streams have all ended and what is buffered was read.
    ``aclose()`` (or leaving ``async with``) unsubscribes early.
    """

    def __init__(self, hub: OutputHub, buffer: int) -> None:
        self._hub = hub
        self._items: deque[OutputItem] = deque()
        self._limit = buffer
        self._missed = 0
        self._ready = anyio.Event()
        self._ended = False

    def _put(self, item: OutputItem) -> None:
        if len(self._items) >= self._limit:
            self._items.popleft()
            self._missed += 1
        self._items.append(item)
        self._ready.set()

    def _end(self) -> None:
        self._ended = True
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[OutputItem]:
        return self

    async def __anext__(self) -> OutputItem:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            self._ready = anyio.Event()
            await self._ready.wait()
        item = self._items.popleft()
        if self._missed:
            # The gap is just before the oldest item still buffered.
            missed, self._missed = self._missed, 0
            return _with_missed(item, item.missed + missed)
        return item

    async def aclose(self) -> None:
        """Unsubscribe; buffered items are dropped."""
        self._hub._unsubscribe(self)
        self._items.clear()
        self._end()

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class OutputHub:
    """Fans a group's output items out to its subscribers; never blocks the publisher.

    Args:
        history: How many of the latest items to keep for subscribers that replay.
    """

    def __init__(self, history: int = HISTORY_ITEMS) -> None:
        self._subscribers: list[OutputStream] = []
        self._history: deque[OutputItem] = deque(maxlen=history)
        self._history_dropped = 0
        self._closed = False

    def subscribe(self, *, replay: bool = True, buffer: int = DEFAULT_BUFFER) -> OutputStream:
        """A new subscriber; with ``replay`` it starts with the kept history."""
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"buffer must be a positive number of items, got {buffer!r}")
        stream = OutputStream(self, buffer)
        if replay:
            for item in self._history:
                stream._put(item)
            if self._history_dropped and stream._items:
                first = stream._items[0]
                stream._items[0] = _with_missed(first, first.missed + self._history_dropped)
        if self._closed:
            stream._end()
        else:
            self._subscribers.append(stream)
        return stream

    def publish(
        self,
        local_rank: int,
        stream: Std,
        data: bytes,
        *,
        frame: bool,
        rank: int | None = None,
        attempt: int | None = None,
    ) -> None:
        """Hand one line or frame to every subscriber (and the history)."""
        item = OutputItem(local_rank, stream, data, frame, time.monotonic(), 0, rank, attempt)
        if len(self._history) == self._history.maxlen:
            self._history_dropped += 1
        self._history.append(item)
        for subscriber in self._subscribers:
            subscriber._put(item)

    def reset_history(self) -> None:
        """Forget the history (a new attempt starts: replay begins there)."""
        self._history.clear()
        self._history_dropped = 0

    def close(self) -> None:
        """End every subscriber's iteration after what it has buffered."""
        self._closed = True
        for subscriber in self._subscribers:
            subscriber._end()
        self._subscribers.clear()

    def _unsubscribe(self, stream: OutputStream) -> None:
        if stream in self._subscribers:
            self._subscribers.remove(stream)


def _with_missed(item: OutputItem, missed: int) -> OutputItem:
    return OutputItem(
        item.local_rank,
        item.stream,
        item.data,
        item.frame,
        item.time,
        missed,
        item.rank,
        item.attempt,
    )
