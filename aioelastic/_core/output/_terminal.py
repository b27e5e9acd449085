"""Workers that see a terminal when the supervisor's console is one.

When the supervisor's own stdout (or stderr) is a terminal and a worker's stream goes to
it unprefixed (neither redirected nor tee'd), the worker writes into a pseudo-terminal of
its own instead of a pipe: ``isatty()`` is True, the window size is the real terminal's
(and follows it: SIGWINCH is passed on), so tqdm, rich and friends keep their colours,
width and ``\\r`` bars. The supervisor still reads every byte from the pty's master side,
exactly as from a pipe (:class:`~._logs.StreamPump`), so what made the pipes worth having
stays: lines of different ranks are never spliced into each other, nothing is lost, and
the failure report still quotes the last stderr lines. Progress frames are passed on as
soon as they arrive (:class:`~._frames.Live`), so a bar moves at the worker's pace; a
single worker's partial lines too, so a prompt stays on its line.

Why not plain inheritance of the terminal (what torchrun does): N workers writing to one
terminal cut each other's lines, and stderr would no longer pass through the supervisor,
so a failure report could not quote it.

stdin: with a single local worker the worker's stdin is its stdout pty, and the
supervisor forwards what is typed on its own terminal into it while the supervisor is
the terminal's foreground job, so ``input()`` and ``breakpoint()`` work (the real
terminal does the echo and line editing; Ctrl-D is passed on as end-of-file). With
several workers every stdin is ``/dev/null``: which rank should a typed line go to?

The pty's output post-processing is turned off (no ``\\n`` to ``\\r\\n``): the bytes the
worker writes are the bytes the real terminal gets, which does that translation itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import struct
import termios
import threading
from dataclasses import dataclass, field

import anyio

from ..process._runtime import runtime
from ._frames import Live

#: End-of-file typed at the start of a line (VEOF), as the worker's pty expects it.
_EOF = b"\x04"


@dataclass
class WorkerStdio:
    """One worker's stdout, stderr and stdin: pipes, or pseudo-terminals at a terminal.

    Attributes:
        stdout_r: Where the supervisor reads the worker's stdout (pipe or pty master).
        stdout_w: The worker's stdout (pipe or pty slave), closed once it is started.
        stderr_r: Same for stderr.
        stderr_w: Same for stderr.
        stdin: The worker's stdin, or ``None`` for ``/dev/null``.
        live_stdout: What of stdout is passed on as soon as it arrives: frames at a pty,
            and partial lines as well when the worker is alone.
        live_stderr: Same for stderr.
    """

    stdout_r: int
    stdout_w: int
    stderr_r: int
    stderr_w: int
    stdin: int | None = None
    live_stdout: Live = Live.OFF
    live_stderr: Live = Live.OFF
    #: Our own copies of the pty masters, for the window size and stdin (see serve).
    _masters: list[int] = field(default_factory=list)
    _forward_stdin_to: int | None = None

    @property
    def uses_terminal(self) -> bool:
        """Whether any stream is a pty, so that :meth:`serve` has work to do."""
        return bool(self._masters)

    def child_ends(self) -> list[int]:
        """The descriptors the worker gets; the supervisor closes them once it started."""
        return [self.stdout_w, self.stderr_w]

    def parent_ends(self) -> list[int]:
        """The descriptors the supervisor reads, and its private copies of pty masters."""
        return [self.stdout_r, self.stderr_r, *self._masters]

    async def serve(self, pid: int) -> None:
        """Keep the worker's terminals in step with the real one, until cancelled.

        Passes window-size changes on (and SIGWINCH to the worker's process group: the
        pty is not its controlling terminal, so the kernel does not) and, for a single
        worker, forwards what is typed. Closes the private master copies at the end.
        """
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._follow_window_size, pid)
                if self._forward_stdin_to is not None:
                    tg.start_soon(_forward_stdin, self._forward_stdin_to)
        finally:
            for fd in self._masters:
                os.close(fd)
            self._masters.clear()

    async def _follow_window_size(self, pid: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # no signal handlers off the main thread: the size stays as at start
        from ..process._signals import handle_signals

        async with handle_signals((signal.SIGWINCH,)) as sigs:
            seen = 0
            while True:
                seen += 1
                await sigs.wait(seen)
                size = _console_window_size()
                if size is None:
                    continue
                for fd in self._masters:
                    with contextlib.suppress(OSError):
                        fcntl.ioctl(fd, termios.TIOCSWINSZ, size)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGWINCH)


@dataclass(frozen=True)
class ConsoleTerminals:
    """Which of the supervisor's own stdin, stdout and stderr are terminals.

    Looked up once per group start (:meth:`probe`) and handed to every
    :func:`open_worker_stdio` of it: the answer does not change between the workers of
    one start, and asking the kernel twice per worker added up for hundreds of them.
    """

    stdin: bool
    stdout: bool
    stderr: bool

    @classmethod
    def probe(cls) -> ConsoleTerminals:
        """Ask the kernel about descriptors 0, 1 and 2 now."""
        return cls(stdin=_isatty(0), stdout=_isatty(1), stderr=_isatty(2))


def open_worker_stdio(
    *, stdout_plain: bool, stderr_plain: bool, single_worker: bool, terminals: ConsoleTerminals
) -> WorkerStdio:
    """Create a worker's stdout and stderr: pipes, or ptys where the console is a terminal.

    Args:
        stdout_plain: The worker's stdout goes to the supervisor's stdout unprefixed
            (shown, neither tee'd nor redirected).
        stderr_plain: Same for stderr.
        single_worker: The group has one worker: its stdin may be the terminal's.
        terminals: Which of the supervisor's streams are terminals (one
            :meth:`ConsoleTerminals.probe` per group start).

    Returns:
        The descriptors; a stream gets a pty when it is plain and the supervisor's
        stream of the same name is a terminal, else a pipe, as outside a terminal.
    """
    opened: list[int] = []
    try:
        out = _open(stdout_plain and terminals.stdout, opened)
        err = _open(stderr_plain and terminals.stderr, opened)
        at_terminal = Live.EVERYTHING if single_worker else Live.FRAMES
        stdio = WorkerStdio(
            out[0],
            out[1],
            err[0],
            err[1],
            live_stdout=at_terminal if out[2] else Live.OFF,
            live_stderr=at_terminal if err[2] else Live.OFF,
        )
        for is_pty, master in ((out[2], out[0]), (err[2], err[0])):
            if is_pty:
                stdio._masters.append(os.dup(master))
                opened.append(stdio._masters[-1])
        if out[2] and single_worker and terminals.stdin and _in_foreground():
            stdio.stdin = stdio.stdout_w
            stdio._forward_stdin_to = stdio._masters[0]
        return stdio
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise


def _open(pty: bool, opened: list[int]) -> tuple[int, int, bool]:
    if not pty:
        r, w = os.pipe2(os.O_CLOEXEC)
        opened += [r, w]
        return r, w, False
    master, slave = os.openpty()  # both close-on-exec, as every fd Python creates
    opened += [master, slave]
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # oflag: the worker's bytes reach the terminal unchanged
    # lflag: the real terminal echoes what is typed and turns Ctrl-C into SIGINT already.
    attrs[3] &= ~(termios.ECHO | termios.ECHONL | termios.ISIG)
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    size = _console_window_size()
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    return master, slave, True


async def _forward_stdin(master: int) -> None:
    """Copy what is typed on our terminal into the worker's pty, line by line.

    One forwarder at a time (two single-worker groups side by side in one program): the
    later one leaves its worker's stdin without input rather than race for the lines.
    """
    if runtime.stdin_forwarded:
        return
    runtime.stdin_forwarded = True
    try:
        await _forward_stdin_lines(master)
    finally:
        runtime.stdin_forwarded = False


async def _forward_stdin_lines(master: int) -> None:
    while True:
        await anyio.wait_readable(0)
        if not _in_foreground():
            # Reading the terminal as a background job would stop us (SIGTTIN), and
            # what is typed now belongs to the foreground job.
            return
        try:
            data = os.read(0, 4096)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR):
                continue
            return
        await _write_all(master, data or _EOF)
        if not data:
            return


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await anyio.wait_writable(fd)
        except OSError:
            return  # the worker is gone


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _in_foreground() -> bool:
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _console_window_size() -> bytes | None:
    """The supervisor's terminal size, as ``TIOCGWINSZ`` packs it."""
    for fd in (1, 2, 0):
        with contextlib.suppress(OSError):
            size = fcntl.ioctl(fd, termios.TIOCGWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            if struct.unpack("HHHH", size)[:2] != (0, 0):
                return size
    return None
