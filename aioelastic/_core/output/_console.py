"""The supervisor's own stdout and stderr, written whole lines at a time from one thread each.

Why a thread: the console may be a terminal or a pipe that a slow reader drains, and a
blocking ``write`` on the event loop would stall exit detection for every worker. Making
fd 1 non-blocking is not an option either: the flag belongs to the open file description,
shared with the terminal and every other process writing to it. So each stream gets one
writer thread (two in all, whatever the number of workers), started on first use, that
sleeps on a condition variable while nothing is queued (no wake-ups while idle), and every
block it writes holds only whole lines — which is what keeps lines of different ranks from
interleaving. When stdout and stderr are the same file or pipe (``2>&1``), the two threads
take turns, so a block of one never lands inside a block of the other.

Back-pressure: producers may queue up to :data:`HIGH_WATER` bytes ahead of the console;
beyond that, :meth:`ConsoleStream.wait_for_room` makes the log pumps stop reading their
pipes, so only a worker that out-writes the console by that much is ever slowed down — it
then blocks in its own ``write`` until the console catches up. Nothing is ever dropped.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Literal, Protocol

from ..process._runtime import runtime

#: Bytes that may wait for the console before log pumps stop reading their pipes. Read
#: when a console is first used, so a program may lower it before starting workers.
HIGH_WATER = 16 * 1024 * 1024
#: The most the writer thread joins into one ``write``: bounds the copy, and lets the
#: back-pressure wait end as soon as part of a large backlog is out.
WRITE_BLOCK = 1024 * 1024

StreamName = Literal["stdout", "stderr"]


class ConsoleSink(Protocol):
    """Where a log pump hands its console blocks.

    A :class:`ConsoleStream`, or a stage in front of one (:class:`~._collapse.Lane`).
    """

    def put(self, data: bytes) -> None:
        """Queue ``data`` (whole lines and frames) without waiting."""

    def room(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
        """``None`` while there is room, else a future resolved in ``loop`` once there is."""

    def end(self) -> None:
        """The producer's stream ended: nothing more will be put."""


class ConsoleStream:
    """A queue of whole-line chunks drained into ``sys.stdout`` or ``sys.stderr``.

    Args:
        name: Which of the supervisor's streams this writes to. The stream object is
            looked up at each write, so a replaced ``sys.stdout`` is honoured.
        high_water: Queued bytes beyond which :meth:`wait_for_room` waits; defaults to
            :data:`HIGH_WATER`.
    """

    def __init__(self, name: StreamName, high_water: int | None = None) -> None:
        self.name = name
        self._high_water = HIGH_WATER if high_water is None else high_water
        self._cond = threading.Condition()
        self._queue: deque[bytes] = deque()
        self._enqueued = 0
        self._written = 0
        self._waiters: list[
            tuple[Callable[[], bool], asyncio.AbstractEventLoop, asyncio.Future[None]]
        ] = []
        self._thread: threading.Thread | None = None

    def put(self, data: bytes) -> None:
        """Queue ``data`` (whole lines) without waiting; see :meth:`wait_for_room`."""
        if not data:
            return
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._write_forever, name=f"aioelastic-{self.name}", daemon=True
                )
                self._thread.start()
            self._queue.append(data)
            self._enqueued += len(data)
            self._cond.notify()

    async def wait_for_room(self) -> None:
        """Wait while more than the high-water mark is queued."""
        await self._wait_until(self._has_room)

    def room(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
        """``None`` while at most the high-water mark is queued, else a future for room.

        The callback form of :meth:`wait_for_room`, for log pumps that run as reader
        callbacks rather than tasks. The future is resolved in ``loop`` once the queue is
        back under the mark.
        """
        condition = self._has_room
        with self._cond:
            if condition():
                return None
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((condition, loop, future))
        return future

    def end(self) -> None:
        """A producer's stream ended: nothing to do, the console keeps nothing per producer."""

    def _has_room(self) -> bool:
        return self._enqueued - self._written <= self._high_water

    async def flush(self) -> None:
        """Wait until everything queued so far has been written."""
        with self._cond:
            target = self._enqueued
        await self._wait_until(lambda: self._written >= target)

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        with self._cond:
            if condition():
                return
            future: asyncio.Future[None] = loop.create_future()
            entry = (condition, loop, future)
            self._waiters.append(entry)
        try:
            await future
        finally:
            with self._cond:
                if entry in self._waiters:
                    self._waiters.remove(entry)

    def _write_forever(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                chunks = [self._queue.popleft()]
                size = len(chunks[0])
                while self._queue and size + len(self._queue[0]) <= WRITE_BLOCK:
                    size += len(self._queue[0])
                    chunks.append(self._queue.popleft())
            self._write(b"".join(chunks) if len(chunks) > 1 else chunks[0])
            with self._cond:
                self._written += size
                ready = [w for w in self._waiters if w[0]()]
                for waiter in ready:
                    self._waiters.remove(waiter)
            # Settled with call_soon_threadsafe, which returns at once. This one thread
            # serves every event loop of the process; anyio.from_thread.run_sync would
            # block it until the waiter's loop ran the call, and forever if that loop
            # stopped running (asyncio.run ending) with the call still queued.
            for _, loop, future in ready:
                try:
                    loop.call_soon_threadsafe(_resolve, future)
                except RuntimeError:
                    pass  # that event loop is closed; nobody waits any more

    def _write(self, data: bytes) -> None:
        stream = sys.stdout if self.name == "stdout" else sys.stderr
        try:
            with _target_lock(stream):
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:
                    stream.flush()  # text the host printed before us goes first
                    buffer.write(data)
                    buffer.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
        except Exception:
            # A closed or broken console (the reader went away, sys.stdout is None or
            # was replaced by something odd): workers must not block or die for it, and
            # this thread must survive to keep the byte count that flush() and
            # wait_for_room() wait on. Redirected logs still get every byte.
            pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _target_lock(stream: object) -> threading.Lock:
    """One lock per file or pipe written to: stdout and stderr share it under ``2>&1``.

    Writes larger than ``PIPE_BUF`` are not atomic, so two threads writing blocks of
    whole lines into the same pipe could still cut each other's lines.
    """
    key: object
    try:
        st = os.fstat(stream.fileno())  # type: ignore[attr-defined]
        key = (st.st_dev, st.st_ino)
    except Exception:
        key = id(stream)  # no file descriptor (a StringIO...): lock the object itself
    with runtime.lock:
        lock = runtime.console_locks.get(key)
        if lock is None:
            lock = runtime.console_locks[key] = threading.Lock()
        return lock


def consoles() -> dict[str, ConsoleStream]:
    """This process's console writers by stream name (kept by the runtime)."""
    return runtime.consoles


def console(name: StreamName) -> ConsoleStream:
    """The process-wide writer for the supervisor's ``stdout`` or ``stderr``.

    A forked child (a worker started with "fork" that supervises workers of its own)
    gets writers of its own: it inherits the parent's but not their threads, so what it
    queued there would never be written (the runtime forgets them at the fork).
    """
    with runtime.lock:
        stream = consoles().get(name)
        if stream is None:
            stream = consoles()[name] = ConsoleStream(name)
        return stream
