"""One worker stream (stdout or stderr) from its pipe to its log file, console and tail.

A :class:`StreamPump` is a task in the context's task group that sleeps on the event
loop's readiness notification for the pipe while the worker is quiet (no thread, no
polling period), and on each wake-up:

* appends the raw bytes to the log file, if the stream is redirected — every byte, in
  order, undecoded;
* cuts the bytes into whole lines and progress frames for the console (prefixed when
  tee'd) with a :class:`~._frames.Framer`, holding back a partial line until its newline,
  its redrawing ``\r``, the end of the stream, or :data:`FLUSH_DELAY` after its first
  byte arrived;
* keeps the last lines of stderr for the failure report.

The read end may be a pipe or the master side of a pseudo-terminal (:mod:`._terminal`),
which reports the end of the stream as ``EIO`` rather than end-of-file.

Log files are written with plain ``os.write`` from the event loop: an append to a local
file lands in the page cache in microseconds, less than handing each chunk to a thread
(aiofiles) would cost. The console, which *can* block, is behind :mod:`._console`.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import time
from pathlib import Path

import anyio

from ._console import ConsoleStream
from ._frames import Framer, Live
from ._lazy_event import LazyEvent
from ._output import StreamOutput

#: How long a partial line (a progress bar, ``print(end="")``) may wait for its newline,
#: counted from its first byte: a bar that keeps growing is still shown this often.
FLUSH_DELAY = 0.25

_CHUNK = 1 << 16
_CHUNKS_PER_WAKEUP = 64


class StreamPump:
    """Moves one worker stream from its pipe to where the stream's settings send it.

    Args:
        fd: The read end of the worker's pipe (made non-blocking; closed at the end).
        log_path: The log file to append every byte to, or ``None``.
        console: Where whole lines are printed, or ``None``.
        prefix: Put before every console line (and after every redrawing ``\\r``).
        keep_tail: Whether to keep the last :data:`~._frames.TAIL_LINES` lines for a report.
        live: What the console is shown as soon as it arrives (:class:`~._frames.Live`).
        output: Where every chunk goes for ``ctx.output()`` subscribers (after the file).
        log_fd: ``log_path`` already opened with :func:`create_log`; the pump owns it
            from now on (closes it in :meth:`finish`).
    """

    def __init__(
        self,
        fd: int,
        *,
        log_path: Path | None,
        console: ConsoleStream | None,
        prefix: bytes,
        keep_tail: bool,
        live: Live = Live.OFF,
        output: StreamOutput | None = None,
        log_fd: int | None = None,
    ) -> None:
        self._log_fd: int | None = log_fd
        os.set_blocking(fd, False)
        self._fd: int | None = fd
        self._log_path = log_path
        #: Bytes appended to the log file so far, and why appending stopped (if it did).
        self._log_written = 0
        self._log_error: OSError | None = None
        self._console = console
        self._output = output
        self._framer = Framer(prefix, console=console is not None, keep_tail=keep_tail, live=live)
        #: When the held partial line must be printed (``inf`` while none is held).
        self._flush_at = math.inf
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        #: Set once the pipe reached end-of-file (or was closed by :meth:`finish`).
        self.closed = LazyEvent()
        #: CLOCK_MONOTONIC time of the last chunk read, and the last bytes read (for
        #: stall reports).
        self.last_output: float | None = None
        self.last_chunk = b""

    def fileno(self) -> int | None:
        """The pipe's read end, ``None`` once closed."""
        return self._fd

    def open_log(self) -> None:
        """Create the log file; refuses to overwrite one (``O_EXCL``)."""
        if self._log_path is not None and self._log_fd is None:
            self._log_fd = create_log(self._log_path)

    async def run(self) -> None:
        """Pump until end-of-file (all writers — the worker and its children — are gone)."""
        while self._fd is not None:
            # No deadline at all while no partial line is held: an idle worker costs
            # no wake-ups.
            with anyio.CancelScope(deadline=self._flush_at) as idle:
                await self._readable()
            if idle.cancelled_caught:
                # The rest of the line may be waiting in the pipe already (this task was
                # late, the machine busy): take it before deciding the line is partial.
                self.drain(_CHUNKS_PER_WAKEUP)
                if anyio.current_time() >= self._flush_at:
                    self._flush_at = math.inf
                    self._put(self._framer.flush())
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
            except OSError as exc:
                # A pseudo-terminal's master reads EIO once every slave side is closed.
                if exc.errno != errno.EIO:
                    raise
                chunk = b""
            count += 1
            if not chunk:
                self.finish()
                return
            self._consume(chunk)

    def finish(self) -> None:
        """Flush the held partial line and close the pipe and the log file (idempotent)."""
        self._flush_at = math.inf
        self._put(self._framer.end())
        if self._output is not None:
            self._output.end()
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

    def _append_to_log(self, chunk: bytes) -> None:
        # A full disk (ENOSPC), the file-size limit (EFBIG) or an I/O error must not stop
        # the pump: the pipe keeps being drained (a worker never blocks on a full pipe)
        # and the console and the tail still get every byte. The file just ends here.
        assert self._log_fd is not None
        view = memoryview(chunk)
        try:
            while view:
                written = os.write(self._log_fd, view)
                self._log_written += written
                view = view[written:]
        except OSError as exc:
            self._log_error = exc
            os.close(self._log_fd)
            self._log_fd = None

    def log_fault(self) -> str | None:
        """Why the log file is incomplete (``"... not written past byte N: ..."``), or ``None``."""
        if self._log_error is None:
            return None
        return f"log {self._log_path} not written past byte {self._log_written}: {self._log_error}"

    def tail_lines(self) -> list[str]:
        """The last stderr lines (with a held partial line), decoded for a report.

        A line redrawn with carriage returns (a progress bar) is reported once, as it was
        last drawn.
        """
        return [line.decode("utf-8", "replace") for line in self._framer.tail_lines()]

    def _consume(self, chunk: bytes) -> None:
        self.last_output = time.monotonic()
        # The end of the output so far, not of this chunk: `python -u` writes a print's
        # text and its newline in two writes, and the last chunk is often just "\n".
        self.last_chunk = (self.last_chunk + chunk[-256:])[-256:]
        if self._log_fd is not None:
            self._append_to_log(chunk)
        if self._output is not None:
            self._output.feed(chunk)
        if self._console is None and not self._framer.keeps_tail:
            return
        self._put(self._framer.feed(chunk))
        if not self._framer.holding:
            self._flush_at = math.inf
        elif self._flush_at == math.inf:
            self._flush_at = anyio.current_time() + FLUSH_DELAY

    def _put(self, data: bytes) -> None:
        if data and self._console is not None:
            self._console.put(data)


def create_log(path: Path) -> int:
    """Create a stream's log file for appending; refuses to overwrite one (``O_EXCL``).

    Blocking: creating a file can take a millisecond on a slow or busy filesystem, so a
    group's log files are created off the event loop (see ``PContext``).
    """
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
