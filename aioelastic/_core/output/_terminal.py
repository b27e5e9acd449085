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

stdin: when the supervisor's stdin is a terminal and the supervisor is its foreground job,
every worker's stdin is a pty too: its stdout pty (else its stderr pty, else one of its
own), so ``input()``, ``breakpoint()``, pdb and ``open("/dev/stdin")`` see a terminal.
What is typed is routed by :mod:`._stdin_router`: to the one worker of a group of one, to
the worker that reads in a group of several (the real terminal does the echo and line
editing; Ctrl-D is passed on as end-of-file). Elsewhere every stdin is ``/dev/null``.

The pty's output post-processing is turned off (no ``\\n`` to ``\\r\\n``): the bytes the
worker writes are the bytes the real terminal gets, which does that translation itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import termios
import threading
from dataclasses import dataclass, field

from ._frames import Live
from ._logs import StreamPump
from ._stdin_router import StdinTarget, in_foreground
from ._tty_readers import terminal_device


@dataclass
class WorkerStdio:
    """One worker's stdout, stderr and stdin: pipes, or pseudo-terminals at a terminal.

    Attributes:
        stdout_r: Where the supervisor reads the worker's stdout (pipe or pty master).
        stdout_w: The worker's stdout (pipe or pty slave), closed once it is started.
        stderr_r: Same for stderr.
        stderr_w: Same for stderr.
        stdin: The worker's stdin (a pty slave), or ``None`` for ``/dev/null``.
        live_stdout: What of stdout is passed on as soon as it arrives: frames at a pty,
            and partial lines as well when the worker is alone.
        live_stderr: Same for stderr.
        stdin_master: Our copy of the master side of the worker's stdin pty, where typed
            input is written (see :meth:`stdin_target`); ``None`` without a stdin pty.
    """

    stdout_r: int
    stdout_w: int
    stderr_r: int
    stderr_w: int
    stdin: int | None = None
    live_stdout: Live = Live.OFF
    live_stderr: Live = Live.OFF
    stdin_master: int | None = None
    #: The stdin pty's device number (of the slave side: the master's is /dev/ptmx's).
    stdin_device: int = -1
    #: Our own copies of the pty masters, for the window size (see serve).
    _masters: list[int] = field(default_factory=list)
    #: stdin is a pty of its own, not the stdout or stderr pty.
    _stdin_alone: bool = False

    @property
    def uses_terminal(self) -> bool:
        """Whether any stream is a pty, so that :meth:`serve` has work to do."""
        return bool(self._masters)

    def child_ends(self) -> list[int]:
        """The descriptors the worker gets; the supervisor closes them once it started."""
        ends = [self.stdout_w, self.stderr_w]
        if self._stdin_alone and self.stdin is not None:
            ends.append(self.stdin)
        return ends

    def parent_ends(self) -> list[int]:
        """The descriptors the supervisor reads, and its private copies of pty masters."""
        ends = [self.stdout_r, self.stderr_r, *self._masters]
        if self.stdin_master is not None:
            ends.append(self.stdin_master)
        return ends

    def stdin_target(
        self, local_rank: int, label: str, pid: int, streams: tuple[StreamPump, ...]
    ) -> StdinTarget:
        """Hand the stdin pty's master copy over to a :class:`StdinTarget` of the router.

        From now on the router closes it (:meth:`StdinRouter.attach`).
        """
        assert self.stdin_master is not None
        master, self.stdin_master = self.stdin_master, None
        return StdinTarget(
            local_rank,
            label,
            pid,
            master,
            self.stdin_device,
            streams=streams,
            drain=self._stdin_alone,
        )

    async def serve(self, pid: int) -> None:
        """Keep the worker's terminals in step with the real one, until cancelled.

        Passes window-size changes on (and SIGWINCH to the worker's process group: the
        pty is not its controlling terminal, so the kernel does not). Closes the private
        master copies at the end.
        """
        try:
            await self._follow_window_size(pid)
        finally:
            for fd in self._masters:
                os.close(fd)
            self._masters.clear()

    async def _follow_window_size(self, pid: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # no signal handlers off the main thread: the size stays as at start
        from ..aio._signals import handle_signals

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

    Attributes:
        stdin: stdin is a terminal and this process its foreground job: what is typed
            there is ours to pass on.
        stdout: stdout is a terminal.
        stderr: stderr is a terminal.
    """

    stdin: bool
    stdout: bool
    stderr: bool

    @classmethod
    def probe(cls) -> ConsoleTerminals:
        """Ask the kernel about descriptors 0, 1 and 2 now."""
        return cls(stdin=_isatty(0) and in_foreground(), stdout=_isatty(1), stderr=_isatty(2))


def open_worker_stdio(
    *, stdout_plain: bool, stderr_plain: bool, single_worker: bool, terminals: ConsoleTerminals
) -> WorkerStdio:
    """Create a worker's stdout, stderr and stdin: pipes, or ptys at a terminal.

    Args:
        stdout_plain: The worker's stdout goes to the supervisor's stdout unprefixed
            (shown, neither tee'd nor redirected).
        stderr_plain: Same for stderr.
        single_worker: The group has one worker: its partial lines are shown at once.
        terminals: Which of the supervisor's streams are terminals (one
            :meth:`ConsoleTerminals.probe` per group start).

    Returns:
        The descriptors; a stream gets a pty when it is plain and the supervisor's
        stream of the same name is a terminal, else a pipe, as outside a terminal. stdin
        is a pty when the supervisor's is a terminal it may read (see the module
        documentation), else ``/dev/null``.
    """
    opened: list[int] = []
    with contextlib.ExitStack() as cleanup_on_fail:
        cleanup_on_fail.callback(_close_all, opened)
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
        if terminals.stdin:
            _open_stdin(stdio, out, err, opened)
        cleanup_on_fail.pop_all()
    return stdio


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _open_stdin(
    stdio: WorkerStdio, out: tuple[int, int, bool], err: tuple[int, int, bool], opened: list[int]
) -> None:
    """Give the worker a stdin pty: its stdout's or stderr's, else one of its own."""
    if out[2] or err[2]:
        master, slave, _ = out if out[2] else err
        stdio.stdin, stdio.stdin_device = slave, terminal_device(slave)
        stdio.stdin_master = os.dup(master)
        opened.append(stdio.stdin_master)
        return
    # Both streams are pipes (tee'd, redirected, or our own are not terminals): a pty for
    # stdin alone. Its master is ours only; what the worker writes to it is dropped.
    master, slave, _ = _open(True, opened)
    stdio.stdin, stdio.stdin_master, stdio._stdin_alone = slave, master, True
    stdio.stdin_device = terminal_device(slave)
    stdio._masters.append(os.dup(master))
    opened.append(stdio._masters[-1])


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


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
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
