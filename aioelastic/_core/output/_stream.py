"""Worker output as an async stream: every line and progress frame, for any number of readers.

Each worker stream's pump (:mod:`._logs`) hands every chunk it reads to a
:class:`StreamOutput`, after writing it to the log file — one reader per pipe feeds the
file, the console and the subscribers. An :class:`OutputHub` gathers a group's streams
and fans their items out to its subscribers, each an :class:`OutputStream` (an async
iterator of :class:`OutputItem`).

Three rules shape it, so that a reader can never hurt the job it watches:

* Publishing never waits. A subscriber has a bounded buffer; when it is full the *oldest*
  buffered item is dropped (the reader is behind, and the newest output is what a live view
  wants) and the next item it receives carries ``missed``, the number of items it lost.
  The log files still have every byte.
* Nothing is cut into items while nobody subscribes: a stream keeps only its latest raw
  chunks (:data:`HISTORY_BYTES`), one ``deque.append`` per read, so a group that nobody
  watches pays nothing per line.
* A late subscriber may replay: with ``replay=True`` it starts with the items still in
  those chunks, oldest first across ranks (its first item carries ``missed`` when the
  history no longer reaches back to the start of the run or attempt).

An item is delivered when it is complete: a line at its ``\\n``, a progress frame at the
``\\r`` that ends it (a bar that draws ``\\r 40%`` delivers each frame when the next one
starts), and what is left at the end of the stream as a last line.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar, cast

import anyio

from ._std import Std

__all__ = ["OutputItem", "OutputStream"]

#: Items a subscriber may have buffered before the oldest are dropped.
DEFAULT_BUFFER = 10_000
#: Raw bytes each stream keeps for subscribers that replay.
HISTORY_BYTES = 1 << 20

_CR, _LF = 13, 10

T = TypeVar("T")


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
            or subscribed after the history was cut (0 normally). The log files hold them.
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


class OutputStream(Generic[T]):
    """One subscriber's view of a group's output: ``async for item in stream``.

    Iteration ends once every worker stream has ended and what is buffered was read.
    ``aclose()`` (or leaving ``async with``) unsubscribes early.
    """

    def __init__(self, hub: OutputHub, buffer: int, *, events: bool = False) -> None:
        self._hub = hub
        self._items: deque[T] = deque()
        #: Output items (not events) buffered now; the bound applies to them.
        self._lines = 0
        self._limit = buffer
        self._missed = 0
        self._events = events
        self._ready = anyio.Event()
        self._ended = False

    def _put(self, item: T) -> None:
        if isinstance(item, OutputItem):
            if self._lines >= self._limit:
                # Drop the oldest *output* item; lifecycle events are few and always kept,
                # so a gap is always followed by the output item that caused it.
                for index, old in enumerate(self._items):
                    if isinstance(old, OutputItem):
                        del self._items[index]
                        break
                self._missed += 1
            else:
                self._lines += 1
        self._items.append(item)
        self._ready.set()

    def _end(self) -> None:
        self._ended = True
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            self._ready = anyio.Event()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, OutputItem):
            self._lines -= 1
            if self._missed:
                # The gap is just before the oldest output item still buffered.
                missed, self._missed = self._missed, 0
                return cast(T, _with_missed(item, item.missed + missed))
        return item

    async def aclose(self) -> None:
        """Unsubscribe; buffered items are dropped."""
        self._hub._unsubscribe(self)
        self._items.clear()
        self._lines = 0
        self._end()

    async def __aenter__(self) -> OutputStream[T]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class StreamOutput:
    """One worker stream's side of the hub: raw history, and items while anyone listens.

    Args:
        hub: The hub to publish to.
        local_rank: The worker's local rank.
        stream: ``Std.OUT`` or ``Std.ERR``.
        rank: Its global rank under the agent.
        attempt: The agent's restart count.
    """

    def __init__(
        self,
        hub: OutputHub,
        local_rank: int,
        stream: Std,
        *,
        rank: int | None = None,
        attempt: int | None = None,
    ) -> None:
        self._hub = hub
        self._tags = (local_rank, stream)
        self._rank = rank
        self._attempt = attempt
        # Made at the first chunk: a group of hundreds of quiet workers keeps no empty deques.
        self._history: deque[tuple[float, bytes]] | None = None
        self._history_bytes = 0
        #: Items cut from the history before it: reported as ``missed`` on replay.
        self._history_dropped = 0
        #: The history no longer starts at a line boundary.
        self._history_cut = False
        #: Bytes after the last complete item, while items are being cut (live).
        self._partial: bytearray | None = None
        self._partial_time = 0.0
        self._ended = False
        hub._add(self)

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes the worker wrote (the pump calls this for every read)."""
        now = time.monotonic()
        if self._history is None:
            self._history = deque()
        self._history.append((now, chunk))
        self._history_bytes += len(chunk)
        while self._history_bytes > HISTORY_BYTES and len(self._history) > 1:
            _, old = self._history.popleft()
            self._history_bytes -= len(old)
            self._history_dropped += old.count(b"\n") + old.count(b"\r") - old.count(b"\r\n")
            self._history_cut = True
        if self._partial is not None:
            self._publish(self._cut(now, chunk))

    def end(self) -> None:
        """The stream ended: what is held is a last line."""
        if self._ended:
            return
        self._ended = True
        if self._partial:
            self._publish([self._last_item(self._partial_time, self._partial)])
        self._partial = None
        self._hub._stream_ended()

    def _start_live(self) -> list[OutputItem]:
        """Begin cutting items (the first subscriber came); return the history's items."""
        items, partial, partial_time = self._replay()
        if not self._ended:
            self._partial, self._partial_time = partial, partial_time
        return items

    def _stop_live(self) -> None:
        """Stop cutting items (no subscriber left); the history goes on."""
        self._partial = None

    def _replay(self) -> tuple[list[OutputItem], bytearray, float]:
        """Cut the whole history afresh: its items, and the bytes held after the last one."""
        saved = self._partial, self._partial_time
        self._partial = bytearray()
        try:
            items = [item for when, chunk in self._history or () for item in self._cut(when, chunk)]
            partial, partial_time = self._partial, self._partial_time
        finally:
            self._partial, self._partial_time = saved
        if self._history_cut and items:
            # The first item is a line whose start was cut off with the history.
            items.pop(0)
        if self._ended and partial:
            items.append(self._last_item(partial_time, partial))
            partial = bytearray()
        missed = self._history_dropped + int(self._history_cut)
        if items and missed:
            items[0] = _with_missed(items[0], missed)
        return items, partial, partial_time

    def _cut(self, when: float, chunk: bytes) -> list[OutputItem]:
        partial = self._partial
        assert partial is not None
        if not partial:
            self._partial_time = when
        items = []
        start = 0
        for end, frame in _boundaries(chunk, partial[-1:] == b"\r"):
            piece = chunk[start:end]
            if partial:
                piece = bytes(partial) + piece
                partial.clear()
            if frame:
                if len(piece) > 1:  # a \r at a line's start only returns to column 0
                    items.append(self._item(self._partial_time, piece[:-1], True))
            else:
                items.append(self._item(self._partial_time, piece[:-1].rstrip(b"\r"), False))
            self._partial_time = when
            start = end
        partial += chunk[start:]
        return items

    def _last_item(self, when: float, held: bytearray) -> OutputItem:
        """What was held when the stream ended: a frame if a ``\\r`` ended it, else a line."""
        if held.endswith(b"\r"):
            return self._item(when, bytes(held).rstrip(b"\r"), True)
        return self._item(when, bytes(held), False)

    def _item(self, when: float, data: bytes, frame: bool) -> OutputItem:
        local_rank, stream = self._tags
        return OutputItem(local_rank, stream, data, frame, when, 0, self._rank, self._attempt)

    def _publish(self, items: list[OutputItem]) -> None:
        for item in items:
            self._hub._publish(item)


class OutputHub:
    """Fans a group's output items out to its subscribers; never blocks the publisher."""

    def __init__(self) -> None:
        self._subscribers: list[OutputStream[Any]] = []
        self._streams: list[StreamOutput] = []
        #: Lifecycle events published so far (few), with when they were published.
        self._events: list[tuple[float, object]] = []
        #: Streams not ended yet; once sealed (no stream will be added), the last one to
        #: end ends the subscribers' iteration.
        self._open = 0
        self._sealed = False
        self._closed = False

    def subscribe(
        self, *, replay: bool = True, buffer: int = DEFAULT_BUFFER, events: bool = False
    ) -> OutputStream[Any]:
        """A new subscriber; with ``replay`` it starts with the history's items.

        Args:
            replay: Start with the history (the current attempt's output still held).
            buffer: Output items it may fall behind by before the oldest are dropped.
            events: Also deliver the lifecycle events given to :meth:`event`.

        Raises:
            ValueError: ``buffer`` is not a positive number of items.
        """
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"buffer must be a positive number of items, got {buffer!r}")
        subscriber: OutputStream[Any] = OutputStream(self, buffer, events=events)
        if not self._subscribers:
            history = [s._start_live() for s in self._streams]
        else:
            history = [s._replay()[0] for s in self._streams]
        if replay:
            timed: list[list[tuple[float, object]]] = [[(i.time, i) for i in h] for h in history]
            if events:
                timed.append(self._events)
            for _, item in heapq.merge(*timed, key=lambda pair: pair[0]):
                subscriber._put(item)
        if self._closed:
            subscriber._end()
        else:
            self._subscribers.append(subscriber)
        return subscriber

    def event(self, event: object) -> None:
        """Publish a lifecycle event to the subscribers that asked for events."""
        self._events.append((time.monotonic(), event))
        for subscriber in self._subscribers:
            if subscriber._events:
                subscriber._put(event)

    def new_attempt(self) -> None:
        """Forget the streams of the previous attempt: replay starts at the next one."""
        self._streams = [s for s in self._streams if not s._ended]

    def close(self) -> None:
        """End every subscriber's iteration after what it has buffered."""
        if self._closed:
            return
        self._closed = True
        for subscriber in self._subscribers:
            subscriber._end()
        self._subscribers.clear()
        for stream in self._streams:
            stream._stop_live()

    def seal(self) -> None:
        """No stream will be added: close once every stream has ended."""
        self._sealed = True
        if self._open == 0:
            self.close()

    def _add(self, stream: StreamOutput) -> None:
        self._streams.append(stream)
        self._open += 1
        if self._subscribers:
            stream._start_live()

    def _stream_ended(self) -> None:
        self._open -= 1
        if self._sealed and self._open == 0:
            self.close()

    def _publish(self, item: OutputItem) -> None:
        for subscriber in self._subscribers:
            subscriber._put(item)

    def _unsubscribe(self, subscriber: OutputStream[Any]) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)
            if not self._subscribers:
                for stream in self._streams:
                    stream._stop_live()


def _boundaries(chunk: bytes, after_cr: bool) -> Iterator[tuple[int, bool]]:
    """Where complete items of ``chunk`` end: ``(end, frame)``, ``end`` past the ending.

    A ``\\n`` ends a line (a ``\\r\\n`` too); a ``\\r`` followed by anything else ends a
    frame — known only once the next byte arrives, so a chunk's final ``\\r`` waits.
    """
    i = 0
    n = len(chunk)
    if after_cr and n and chunk[0] not in (_CR, _LF):
        # The \r that ended the previous chunk ended a frame.
        yield 0, True
    while i < n:
        nl = chunk.find(b"\n", i)
        cr = chunk.find(b"\r", i, nl if nl >= 0 else n)
        if cr < 0:
            if nl < 0:
                return
            yield nl + 1, False
            i = nl + 1
            continue
        following = chunk[cr + 1 : cr + 2]
        if not following:
            return  # the last byte: a frame's end or a CRLF's start, next chunk says
        if following[0] in (_CR, _LF):
            i = cr + 1
            continue
        yield cr + 1, True
        i = cr + 1


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
