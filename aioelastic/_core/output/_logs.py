"""One worker stream (stdout or stderr) from its pipe to its log file, console and tail.

A :class:`StreamPump` is no task at all: it is called back by the event loop when the
pipe is readable (through the loop's :class:`~..process._reader_hub.ReaderHub`), so a
quiet worker costs neither a thread, nor a polling period, nor a task's memory (a few kB
each, for hundreds of workers). On each call it:

* appends the raw bytes to the log file, if the stream is redirected — every byte, in
  order, undecoded;
* cuts the bytes into whole lines and progress frames for the console (prefixed when
  tee'd) with a :class:`~._frames.Framer`, holding back a partial line until its newline,
  its redrawing ``\r``, the end of the stream, or :data:`FLUSH_DELAY` after its first
  byte arrived (no delay while the last write was a block-buffered writer's full buffer,
  see :data:`BLOCK_WRITE`, which a pty hands over in pieces: :data:`PTY_PIECE`) — through
  a :mod:`._collapse` stage when identical lines of several ranks are printed once;
* keeps the last lines of stderr for the failure report.

The read end may be a pipe or the master side of a pseudo-terminal (:mod:`._terminal`),
which reports the end of the stream as ``EIO`` rather than end-of-file.

Log files are written with plain ``os.write`` from the event loop: an append to a local
file lands in the page cache in microseconds, less than handing each chunk to a thread
(aiofiles) would cost. The console, which *can* block, is behind :mod:`..process._console`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import time
from collections.abc import Callable

from ..aio._lazy_event import LazyEvent
from ..aio._reader_hub import ReaderHub, reader_hub
from ._console import ConsoleSink
from ._frames import Framer, Live
from ._stream import StreamOutput

logger = logging.getLogger("aioelastic")

#: How long a partial line (a progress bar, ``print(end="")``) may wait for its newline,
#: counted from its first byte: a bar that keeps growing is still shown this often.
FLUSH_DELAY = 0.25

#: A write this long that ends mid-line is a block-buffered writer's full buffer, not a
#: prompt: the rest of its line comes with the writer's next flush, however late, so the
#: line waits for it with no flush delay. C's stdio flushes 4096 bytes to a pipe, Python's
#: ``print()`` about 8 KiB; a prompt (``print(end="")``, ``input()``) is a small write.
#: A pipe hands such a write to one read; a pty in pieces (see :data:`PTY_PIECE`).
BLOCK_WRITE = 4096

#: The kernel passes a write to a pty's slave on in pieces of this size (``tty_write``
#: copies at most 2048 bytes at a time and may yield the CPU between two of them), and
#: the master's line discipline holds at most 4095 bytes for a read. Reading until
#: ``EAGAIN`` gets all that was passed on: a read that finds the line discipline empty
#: first waits for the pty's pending input to be moved into it (``n_tty_read`` calls
#: ``tty_buffer_flush_work``). So a batch of reads ends inside a write only where the
#: writer had not passed the next piece on yet, after at least one whole piece: a batch
#: this long may be continued by the next one; a shorter one (a line, a prompt) is
#: always a write's end. Output post-processing is off on our ptys (``_terminal.py``),
#: which would otherwise cut pieces at each newline it translates.
PTY_PIECE = 2048

_CHUNK = 1 << 16
_CHUNKS_PER_WAKEUP = 64
#: At most this many chunks are read by :meth:`StreamPump.catch_up` (a prompt and what
#: led to it, not a backlog).
_CATCH_UP_CHUNKS = 4


class StreamPump:
    """Moves one worker stream from its pipe to where the stream's settings send it.

    Args:
        fd: The read end of the worker's pipe (made non-blocking; closed at the end).
        log_path: The log file to append every byte to, or ``None``.
        console: Where whole lines are printed (the console, or a collapsing stage in
            front of it: :mod:`._collapse`), or ``None``.
        prefix: Put before every console line (and after every redrawing ``\\r``).
        keep_tail: Whether to keep the last :data:`~._frames.TAIL_LINES` lines for a report.
        live: What the console is shown as soon as it arrives (:class:`~._frames.Live`).
        output: Where every chunk goes for ``ctx.output()`` subscribers (after the file).
        log_fd: ``log_path`` already opened with :func:`create_log`; the pump owns it
            from now on (closes it in :meth:`finish`).
    """

    # Two per worker, hundreds of workers: no per-instance dict.
    __slots__ = (
        "_batch",
        "_batch_at",
        "_batch_from",
        "_burst",
        "_console",
        "_dry",
        "_fd",
        "_flush_at",
        "_framer",
        "_hub",
        "_log_error",
        "_log_fd",
        "_log_path",
        "_log_written",
        "_loop",
        "_output",
        "_read_error",
        "_reading",
        "_room",
        "_timer",
        "closed",
        "last_chunk",
        "last_output",
        "on_chunk",
    )

    def __init__(
        self,
        fd: int,
        *,
        log_path: str | os.PathLike[str] | None,
        console: ConsoleSink | None,
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
        #: The reads since the pipe was last found empty (a batch, see PTY_PIECE): their
        #: bytes, where in the stream they begin, the time of the last one; whether the
        #: batch ended (a read found the pipe empty); the bytes of the batches that may be
        #: pieces of one write, this one included (see ``_frame``).
        self._batch = 0
        self._batch_from = 0
        self._batch_at = -math.inf
        self._dry = True
        self._burst = 0
        #: The loop calling us back while started (see :meth:`start`).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Whether the reader callback is registered for ``_fd`` now, and where.
        self._reading = False
        self._hub: ReaderHub | None = None
        #: The wake-up at ``_flush_at``, while a partial line is held.
        self._timer: asyncio.TimerHandle | None = None
        #: Resolved once the console has room again, while reading is paused for it.
        self._room: asyncio.Future[None] | None = None
        #: Why the pipe stopped being read before its end, if it did.
        self._read_error: Exception | None = None
        #: Set once the pipe reached end-of-file (or was closed by :meth:`finish`).
        self.closed = LazyEvent()
        #: CLOCK_MONOTONIC time of the last chunk read, and the last bytes read (for
        #: stall reports).
        self.last_output: float | None = None
        self.last_chunk = b""
        #: Called with each chunk read, after it was passed on (the stdin router watches
        #: for prompts this way); ``None``: nobody watches.
        self.on_chunk: Callable[[bytes], None] | None = None

    def fileno(self) -> int | None:
        """The pipe's read end, ``None`` once closed."""
        return self._fd

    def open_log(self) -> None:
        """Create the log file; refuses to overwrite one (``O_EXCL``)."""
        if self._log_path is not None and self._log_fd is None:
            self._log_fd = create_log(self._log_path)

    def start(self) -> None:
        """Start pumping, from callbacks of the running event loop (no task, no thread).

        Raises:
            RuntimeError: Called outside the event loop's thread, or twice.
        """
        if self._loop is not None:
            raise RuntimeError("StreamPump.start() was called twice; start a pump once")
        self._loop = asyncio.get_running_loop()
        if self._fd is not None:
            # No read now: the registration is level-triggered, so bytes the worker wrote
            # already call the reader on the loop's next turn (a read here would mostly
            # find the pipe empty, for a syscall and an exception per stream).
            self._read_on()

    async def run(self) -> None:
        """Start pumping (see :meth:`start`) and wait until the pipe is closed."""
        self.start()
        await self.closed.wait()

    def _resume(self) -> None:
        assert self._loop is not None
        self._room = None
        if self._fd is None:
            return
        if not self._reading:
            self._read_on()
        # Bytes may have arrived while paused, and a held line may be due by now.
        self._step()

    def _read_on(self) -> None:
        assert self._loop is not None
        assert self._fd is not None
        self._hub = reader_hub(self._loop)
        self._hub.add(self._fd, self._step)
        self._reading = True

    def _read_off(self) -> None:
        if self._reading:
            assert self._hub is not None
            assert self._fd is not None
            self._hub.remove(self._fd)
            self._hub, self._reading = None, False

    def _step(self) -> None:
        """One wake-up: the pipe is readable, or a held line's deadline came."""
        loop = self._loop
        assert loop is not None
        if self._fd is None or self._room is not None:
            return
        try:
            self.drain(_CHUNKS_PER_WAKEUP)
            # Checked after the drain: the rest of the line may have been waiting in the
            # pipe already (this call was late, the machine busy).
            if self._flush_at <= loop.time():
                self._flush_at = math.inf
                self._put(self._framer.flush())
        except Exception as exc:
            # In a task this would have failed the whole group; from a callback it would
            # only reach the loop's exception handler while the worker blocks on a full
            # pipe. The stream ends here instead, and the failure report says why.
            logger.exception("aioelastic: reading a worker's output failed")
            self._read_error = exc
            self.finish()
            return
        if self.fileno() is None:  # the drain reached the end of the stream
            return
        timer = self._timer
        if timer is not None and timer.when() != self._flush_at:
            timer.cancel()
            self._timer = timer = None
        if timer is None and self._flush_at != math.inf:
            self._timer = loop.call_at(self._flush_at, self._on_deadline)
        if self._console is not None:
            # Back-pressure: while the console is far behind, stop reading the pipe. A
            # held partial line's bytes are then simply part of what is waited on.
            room = self._console.room(loop)
            if room is not None:
                self._pause(room)

    def set_live(self, live: Live) -> None:
        """Change what the console is shown as soon as it arrives (see :class:`Live`).

        Raised to :attr:`Live.EVERYTHING`, a held prompt is shown at once; a stream with
        a prefix stays as it is (its partial lines would be cut by the prefix).
        """
        self._put(self._framer.set_live(live))
        if self._framer.live is Live.EVERYTHING and not self._framer.holding:
            self._flush_at = math.inf

    def put_note(self, note: bytes, prompt: bytes = b"") -> bool:
        """Print a line of the supervisor's own on this stream's console, then ``prompt``.

        ``prompt`` (the stream's last partial line, printed as a line of its own
        already) is shown again as written, without a newline: only on a console stream
        without a prefix, and only while nothing is held (a held prompt is shown by
        :meth:`set_live`). Returns False when this stream has no console.
        """
        if self._console is None:
            return False
        self._put(note)
        framer = self._framer
        if prompt and not framer.prefixed and not framer.holding and not framer.raw_text_shown:
            self._put(prompt)
        return True

    def typed_line_echoed(self) -> None:
        """A line typed for this worker was echoed by the terminal, ending the shown line."""
        self._framer.end_shown_line()

    def raw_text_shown(self) -> bool:
        """Whether the console shows a partial line of this stream as written (a prompt)."""
        return self._framer.raw_text_shown

    def _on_deadline(self) -> None:
        self._timer = None
        self._step()

    def _pause(self, room: asyncio.Future[None]) -> None:
        assert self._loop is not None
        assert self._fd is not None
        self._room = room
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._read_off()
        room.add_done_callback(lambda _: self._resume())

    def catch_up(self) -> None:
        """Consume what the worker wrote so far (a few chunks), unless the console is full.

        For the keyboard's router: a worker found blocked reading its terminal wrote its
        prompt before it read, but on a busy machine the pipe may not have been read yet,
        and a note printed now would come before that output instead of before the prompt.
        """
        if self._room is None:
            self.drain(max_chunks=_CATCH_UP_CHUNKS)

    def drain(self, max_chunks: int | None = None) -> None:
        """Consume what the pipe holds now, without waiting (the exit path calls this)."""
        count = 0
        while self._fd is not None and (max_chunks is None or count < max_chunks):
            try:
                chunk = os.read(self._fd, _CHUNK)
            except BlockingIOError:
                self._dry = True
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
        if self._console is not None:
            self._console.end()
        if self._output is not None:
            self._output.end()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fd is not None:
            # Unregistered while the number still names this pipe: a stale registration
            # would be attached to whatever file reuses the number next (another worker's
            # pipe, a pidfd of teardown), whose reader would never be called.
            self._read_off()
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
        if self._read_error is not None:
            return f"output not read to the end: {self._read_error!r}"
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
        self.last_output = now = time.monotonic()
        # The end of the output so far, not of this chunk: `python -u` writes a print's
        # text and its newline in two writes, and the last chunk is often just "\n".
        self.last_chunk = (self.last_chunk + chunk[-256:])[-256:]
        if self._log_fd is not None:
            self._append_to_log(chunk)
        if self._output is not None:
            self._output.feed(chunk)
        if self._console is not None or self._framer.keeps_tail:
            self._frame(chunk, now)
        if self.on_chunk is not None:
            self.on_chunk(chunk)

    def _frame(self, chunk: bytes, now: float) -> None:
        framer = self._framer
        if self._dry:
            # A write to a pty reaches us in batches (PTY_PIECE): one that follows a
            # whole piece soon enough may be the rest of the same write. The writer can
            # lose the CPU between two pieces, and this callback be late, on a loaded
            # machine: a gap up to the flush delay itself still joins them.
            if self._batch < PTY_PIECE or now - self._batch_at > FLUSH_DELAY:
                self._burst = 0
            self._batch, self._batch_from, self._dry = 0, framer.fed, False
        self._batch += len(chunk)
        self._burst += len(chunk)
        self._batch_at = now
        held_from = framer.held_from if framer.holding else None
        self._put(framer.feed(chunk))
        if not framer.holding:
            self._flush_at = math.inf
        elif (
            self._burst >= BLOCK_WRITE
            and not framer.holds_frame
            and (framer.held_from != self._batch_from or self._batch >= BLOCK_WRITE)
        ):
            # A full buffer that ended mid-line: a slow block-buffered writer (a line a
            # step, an 8 KiB flush a minute) would otherwise have a line cut in two at
            # every flush. Its end, or a prompt written after it, is shown as usual.
            # The buffer is counted over the batches of one write (at a pty its last
            # piece can be 2 bytes, read on their own), but a held piece that starts a
            # batch of less than BLOCK_WRITE is a write of its own (a prompt after whole
            # lines); one that continues a line, or follows a newline in the batch, is
            # the buffer's tail.
            self._flush_at = math.inf
        elif framer.held_from != held_from or self._flush_at == math.inf:
            # A new piece is held: its own first byte starts its delay, not that of the
            # line this chunk completed (a piece held with no delay that grew by a small
            # write, a prompt after a full buffer, starts it now). A block-buffered
            # writer ends nearly every read mid-line, and a deadline kept from the first
            # of them cut a line in two every FLUSH_DELAY. The loop's clock (anyio's on
            # asyncio), asked of the loop directly because this runs in a reader
            # callback, outside any task.
            loop = self._loop or asyncio.get_running_loop()
            self._flush_at = loop.time() + FLUSH_DELAY

    def _put(self, data: bytes) -> None:
        if data and self._console is not None:
            self._console.put(data)


def create_log(path: str | os.PathLike[str]) -> int:
    """Create a stream's log file for appending; refuses to overwrite one (``O_EXCL``).

    Blocking: creating a file can take a millisecond on a slow or busy filesystem, so a
    group's log files are created off the event loop (see ``PContext``).
    """
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
