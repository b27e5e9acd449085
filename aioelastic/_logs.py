"""One worker stream (stdout or stderr) from its pipe to its log file, console and tail.

A :class:`StreamPump` is a task in the context's task group that sleeps on the event
loop's readiness notification for the pipe while the worker is quiet (no thread, no
polling period), and on each wake-up:

* appends the raw bytes to the log file, if the stream is redirected — every byte, in
  order, undecoded;
* cuts the bytes into whole lines for the console (prefixed when tee'd), holding back a
  partial line until its newline, the end of the stream, or :data:`FLUSH_DELAY` after
  its first byte arrived;
* keeps the last lines of stderr for the failure report.

Log files are written with plain ``os.write`` from the event loop: an append to a local
file lands in the page cache in microseconds, less than handing each chunk to a thread
(aiofiles) would cost. The console, which *can* block, is behind :mod:`._console`.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections import deque
from pathlib import Path

import anyio

from ._console import ConsoleStream

#: How long a partial line (a progress bar, ``print(end="")``) may wait for its newline,
#: counted from its first byte: a bar that keeps growing is still shown this often.
FLUSH_DELAY = 0.25
#: A line longer than this is passed on in pieces rather than held in memory.
MAX_HELD_LINE = 8 * 1024 * 1024
#: How many stderr lines a failure report quotes.
TAIL_LINES = 50
#: A longer stderr line is kept for the report as its head and end only.
TAIL_LINE_BYTES = 8 * 1024

_CHUNK = 1 << 16
_CHUNKS_PER_WAKEUP = 64
# A carriage return that redraws a line (a progress bar), not the one of a CRLF ending.
_REDRAW = re.compile(rb"\r(?![\r\n])")


class StreamPump:
    """Moves one worker stream from its pipe to where the stream's settings send it.

    Args:
        fd: The read end of the worker's pipe (made non-blocking; closed at the end).
        log_path: The log file to append every byte to, or ``None``.
        console: Where whole lines are printed, or ``None``.
        prefix: Put before every console line (and after every redrawing ``\\r``).
        keep_tail: Whether to keep the last :data:`TAIL_LINES` lines for a report.
    """

    def __init__(
        self,
        fd: int,
        *,
        log_path: Path | None,
        console: ConsoleStream | None,
        prefix: bytes,
        keep_tail: bool,
    ) -> None:
        os.set_blocking(fd, False)
        self._fd: int | None = fd
        self._log_path = log_path
        self._log_fd: int | None = None
        self._console = console
        self._prefix = prefix
        self._partial = bytearray()
        #: When the held partial line must be printed (``inf`` while none is held).
        self._flush_at = math.inf
        self.tail: deque[bytes] | None = deque(maxlen=TAIL_LINES) if keep_tail else None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        #: Set once the pipe reached end-of-file (or was closed by :meth:`finish`).
        self.closed = anyio.Event()
        #: CLOCK_MONOTONIC time of the last chunk read, and the last bytes read (for
        #: stall reports).
        self.last_output: float | None = None
        self.last_chunk = b""

    def open_log(self) -> None:
        """Create the log file; refuses to overwrite one (``O_EXCL``)."""
        if self._log_path is not None and self._log_fd is None:
            self._log_fd = os.open(
                self._log_path,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                0o644,
            )

    async def run(self) -> None:
        """Pump until end-of-file (all writers — the worker and its children — are gone)."""
        while self._fd is not None:
            # No deadline at all while no partial line is held: an idle worker costs
            # no wake-ups.
            with anyio.CancelScope(deadline=self._flush_at) as idle:
                await self._readable()
            if idle.cancelled_caught:
                self._emit_partial()
            else:
                self.drain(_CHUNKS_PER_WAKEUP)
            if self._console is not None:
                # Back-pressure: while the console is far behind, stop reading the pipe.
                # The deadline of a held partial line still applies meanwhile, but its
                # bytes simply join the queue, which is what is being waited on.
                await self._console.wait_for_room()

    async def _readable(self) -> None:
        """Wait until the pipe is readable, or closed by :meth:`finish` from another task.

        Not ``anyio.wait_readable``: the exit path closes the pipe from another task
        while this one may be waiting, and the registration must be removed *before* the
        descriptor is closed — a stale one would be attached to whatever file reuses the
        number next (another worker's pipe, a pidfd of teardown), whose waiter would then
        never wake. anyio keeps its registrations per task, out of reach of other tasks.
        """
        assert self._fd is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self._fd, _resolve, future)
        self._waiter = (loop, future)
        try:
            await future
        finally:
            if self._waiter is not None:
                self._waiter = None
                if self._fd is not None:
                    loop.remove_reader(self._fd)

    def drain(self, max_chunks: int | None = None) -> None:
        """Consume what the pipe holds now, without waiting (the exit path calls this)."""
        count = 0
        while self._fd is not None and (max_chunks is None or count < max_chunks):
            try:
                chunk = os.read(self._fd, _CHUNK)
            except BlockingIOError:
                return
            count += 1
            if not chunk:
                self.finish()
                return
            self._consume(chunk)

    def finish(self) -> None:
        """Flush the held partial line and close the pipe and the log file (idempotent)."""
        self._emit_partial()
        if self._fd is not None:
            if self._waiter is not None:
                # The pump task is asleep on this pipe: unregister while the number
                # still names this pipe, then wake the task (it sees the pipe closed).
                loop, future = self._waiter
                self._waiter = None
                loop.remove_reader(self._fd)
                _resolve(future)
            os.close(self._fd)
            self._fd = None
            self.closed.set()
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def tail_lines(self) -> list[str]:
        """The last stderr lines (with a held partial line), decoded for a report.

        A line redrawn with carriage returns (a progress bar) is reported as it was last
        drawn.
        """
        if self.tail is None:
            return []
        lines = list(self.tail)
        if self._partial:
            lines.append(_tail_entry(bytes(self._partial)))
        return [_last_drawn(line).decode("utf-8", "replace") for line in lines[-TAIL_LINES:]]

    def _consume(self, chunk: bytes) -> None:
        self.last_output = time.monotonic()
        # The end of the output so far, not of this chunk: `python -u` writes a print's
        # text and its newline in two writes, and the last chunk is often just "\n".
        self.last_chunk = (self.last_chunk + chunk)[-256:]
        if self._log_fd is not None:
            _write_all(self._log_fd, chunk)
        if self._console is None and self.tail is None:
            return
        end = chunk.rfind(b"\n") + 1
        if end == 0:
            if not self._partial:
                self._flush_at = anyio.current_time() + FLUSH_DELAY
            # bytearray appends are amortised O(1): a 1 MB line arriving in 64 KiB
            # chunks is copied once, not once per chunk.
            self._partial += chunk
            if len(self._partial) > MAX_HELD_LINE:
                self._emit_partial()
            return
        if self._partial:
            self._partial += chunk[:end]
            data = bytes(self._partial)
            self._partial.clear()
        else:
            data = chunk[:end] if end < len(chunk) else chunk
        lines = data[:-1].split(b"\n")
        if end < len(chunk):
            self._partial += chunk[end:]
            self._flush_at = anyio.current_time() + FLUSH_DELAY
        else:
            self._flush_at = math.inf
        if self.tail is not None:
            self.tail.extend(_tail_entry(line) for line in lines[-TAIL_LINES:])
        if self._console is not None:
            self._console.put(self._framed(lines))

    def _framed(self, lines: list[bytes]) -> bytes:
        if not self._prefix:
            return b"\n".join(lines) + b"\n"
        prefix = self._prefix
        block = b"".join([prefix + line + b"\n" for line in lines])
        if b"\r" in block:
            # A progress bar returns to column 0 and would draw over the prefix.
            block = _REDRAW.sub(lambda _: b"\r" + prefix, block)
        return block

    def _emit_partial(self) -> None:
        self._flush_at = math.inf
        if not self._partial:
            return
        line = bytes(self._partial)
        self._partial.clear()
        if self.tail is not None:
            self.tail.append(_tail_entry(line))
        if self._console is not None:
            self._console.put(self._framed([line]))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _tail_entry(line: bytes) -> bytes:
    """What the report keeps of a stderr line: all of it unless it is huge."""
    if len(line) <= TAIL_LINE_BYTES:
        return line
    half = TAIL_LINE_BYTES // 2
    cut = len(line) - 2 * half
    return line[:half] + b" [... %d bytes cut ...] " % cut + line[-half:]


def _last_drawn(line: bytes) -> bytes:
    body = line.rstrip(b"\r")
    return body[body.rfind(b"\r") + 1 :]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
