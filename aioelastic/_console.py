"""The supervisor's own stdout and stderr, written whole lines at a time from one thread each.

Why a thread: the console may be a terminal or a pipe that a slow reader drains, and a
blocking ``write`` on the event loop would stall exit detection for every worker. Making
fd 1 non-blocking is not an option either: the flag belongs to the open file description,
shared with the terminal and every other process writing to it. So each stream gets one
writer thread (two in all, whatever the number of workers) that sleeps on a condition
variable while nothing is queued, and every chunk it writes holds only whole lines — which
is what keeps lines of different ranks from interleaving.

Back-pressure: producers may queue up to :data:`HIGH_WATER` bytes ahead of the console;
beyond that, :meth:`ConsoleStream.wait_for_room` makes the log pump stop reading its pipe,
so only a worker that out-writes the console by that much is ever slowed down.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Literal

HIGH_WATER = 16 * 1024 * 1024

StreamName = Literal["stdout", "stderr"]


class ConsoleStream:
    """A queue of whole-line chunks drained into ``sys.stdout`` or ``sys.stderr``."""

    def __init__(self, name: StreamName, high_water: int = HIGH_WATER) -> None:
        self.name = name
        self._high_water = high_water
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
        await self._wait_until(lambda: self._enqueued - self._written <= self._high_water)

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
                chunks = list(self._queue)
                self._queue.clear()
            data = b"".join(chunks)
            self._write(data)
            with self._cond:
                self._written += len(data)
                ready = [w for w in self._waiters if w[0]()]
                for waiter in ready:
                    self._waiters.remove(waiter)
            for _, loop, future in ready:
                try:
                    loop.call_soon_threadsafe(_resolve, future)
                except RuntimeError:
                    pass  # that event loop is closed; nobody waits any more

    def _write(self, data: bytes) -> None:
        stream = sys.stdout if self.name == "stdout" else sys.stderr
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()  # text the host printed before us goes first
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode("utf-8", "replace"))
                stream.flush()
        except (OSError, ValueError):
            # A closed or broken console (the reader went away): workers must not
            # block or die for it; their redirected logs still get every byte.
            pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_consoles: dict[str, ConsoleStream] = {}
_consoles_lock = threading.Lock()


def console(name: StreamName) -> ConsoleStream:
    """The process-wide writer for the supervisor's ``stdout`` or ``stderr``."""
    with _consoles_lock:
        stream = _consoles.get(name)
        if stream is None:
            stream = _consoles[name] = ConsoleStream(name)
        return stream
