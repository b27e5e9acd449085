"""One worker stream (stdout or stderr) from its pipe to its log file, console and tail.

A :class:`StreamPump` is a task in the context's task group that sleeps in
``wait_readable`` on the pipe while the worker is quiet (no thread, no polling period),
and on each wake-up:

* appends the raw bytes to the log file, if the stream is redirected — every byte, in
  order, undecoded;
* cuts the bytes into whole lines for the console (prefixed when tee'd), holding back a
  partial line until its newline, the end of the stream, or :data:`FLUSH_DELAY`;
* keeps the last lines of stderr for the failure report.

Log files are written with plain ``os.write`` from the event loop: an append to a local
file lands in the page cache in microseconds, less than handing each chunk to a thread
(aiofiles) would cost. The console, which *can* block, is behind :mod:`._console`.
"""

from __future__ import annotations

import math
import os
from collections import deque
from pathlib import Path

import anyio

from ._console import ConsoleStream

#: How long a partial line (a progress bar, ``print(end="")``) waits for its newline.
FLUSH_DELAY = 0.25
#: A line longer than this is passed on in pieces rather than held in memory.
MAX_HELD_LINE = 8 * 1024 * 1024
#: How many stderr lines a failure report quotes.
TAIL_LINES = 50

_CHUNK = 1 << 16
_CHUNKS_PER_WAKEUP = 64


class StreamPump:
    """Moves one worker stream from its pipe to where the stream's settings send it."""

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
        self._partial = b""
        self.tail: deque[bytes] | None = deque(maxlen=TAIL_LINES) if keep_tail else None
        #: Set once the pipe reached end-of-file (or was closed by :meth:`finish`).
        self.closed = anyio.Event()

    def open_log(self) -> None:
        """Create the log file; refuses to overwrite one (``O_EXCL``)."""
        if self._log_path is not None and self._log_fd is None:
            self._log_fd = os.open(
                self._log_path,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                0o644,
            )

    @property
    def open(self) -> bool:
        """Whether the pipe has not reached end-of-file yet."""
        return self._fd is not None

    async def run(self) -> None:
        """Pump until end-of-file (all writers — the worker and its children — are gone)."""
        while self._fd is not None:
            with anyio.move_on_after(FLUSH_DELAY if self._partial else math.inf) as idle:
                await anyio.wait_readable(self._fd)
            if idle.cancelled_caught:
                self._emit_partial()
            else:
                self.drain(_CHUNKS_PER_WAKEUP)
            if self._console is not None:
                await self._console.wait_for_room()

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
            os.close(self._fd)
            self._fd = None
            self.closed.set()
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def tail_lines(self) -> list[str]:
        """The last stderr lines (with a held partial line), decoded for a report."""
        if self.tail is None:
            return []
        lines = list(self.tail)
        if self._partial:
            lines.append(self._partial)
        return [line.decode("utf-8", "replace") for line in lines[-TAIL_LINES:]]

    def _consume(self, chunk: bytes) -> None:
        if self._log_fd is not None:
            _write_all(self._log_fd, chunk)
        if self._console is None and self.tail is None:
            return
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n") + 1
        if end == 0:
            self._partial = data
            if len(data) > MAX_HELD_LINE:
                self._emit_partial()
            return
        self._partial = data[end:]
        lines = data[: end - 1].split(b"\n")
        if self.tail is not None:
            self.tail.extend(lines[-TAIL_LINES:])
        if self._console is not None:
            self._console.put(self._framed(lines))

    def _framed(self, lines: list[bytes]) -> bytes:
        if not self._prefix:
            return b"\n".join(lines) + b"\n"
        prefix = self._prefix
        return b"".join([prefix + line + b"\n" for line in lines])

    def _emit_partial(self) -> None:
        if not self._partial:
            return
        line, self._partial = self._partial, b""
        if self.tail is not None:
            self.tail.append(line)
        if self._console is not None:
            self._console.put(self._framed([line]))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
