"""Learning that a worker exited, from the kernel, without reaping it.

A worker's exit is observed with ``WNOWAIT``: the process stays a zombie until teardown
has signalled its process group for the last time. While the leader is unreaped its pid
(and so its process-group id) cannot be reused, so ``killpg(pgid)`` can never hit an
unrelated process group that happens to get the same number.

A watch calls back once, from the event loop, when the exit is known (:meth:`ExitWatch.
on_exit`): a reader callback on a file descriptor, not a task per worker — a task and
its cancel scopes cost more than the rest of a binary worker's bookkeeping. Three ways
to watch, chosen by :func:`watch_child`:

* :class:`PidfdWatch` — a pidfd becomes readable when the process exits. No thread, no
  polling.
* :class:`ThreadWatch` — the fallback where pidfds are missing: a thread blocks in
  ``waitid(WNOWAIT)``. (A ``multiprocessing`` sentinel would be the other option, but a
  grandchild that inherited the pipe keeps it open after the worker's own exit.)
* :class:`StatusPipeWatch` — for workers forked by our fork server (not our children):
  the server watches them and writes the exit status into a pipe only we and it hold.
  (Binary workers, the watchdog's children, are reported on their start batch's socket:
  :class:`~aioelastic._core.start._binary_start.SpawnedWatch`.)
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
from collections.abc import Callable
from typing import Protocol

from ..aio._reader_hub import ReaderHub, reader_hub
from ..child._status_record import STATUS, decode_status
from ..process import _platform
from ..process._runtime import runtime

#: What a watch reports: the exit code (negative: killed by that signal), or why the
#: exit status could not be learnt (:class:`ExitNotSeen`, or the error of the read).
ExitOutcome = int | Exception
OnExit = Callable[[ExitOutcome], None]


class ExitNotSeen(Exception):
    """The watch was given up (:meth:`ExitWatch.abandon`) before the exit was seen."""


class ExitWatch(Protocol):
    """Watches one process's exit and reaps it afterwards."""

    pid: int

    def on_exit(self, callback: OnExit) -> None:
        """Call ``callback`` once, from the running event loop, with the exit's outcome.

        The process stays unreaped. Called at most once per watch.
        """
        ...

    def abandon(self) -> None:
        """Stop watching: ``callback`` gets :class:`ExitNotSeen` now, unless it was called."""
        ...

    async def wait(self) -> int:
        """The exit code, once the process exited (see :meth:`on_exit`).

        Raises:
            Exception: What kept the exit status from being read.
        """
        ...

    def reap(self) -> None:
        """Release the exited process (reap the zombie) and any fd held for it. Idempotent."""
        ...


class LoopWatch:
    """One callback, called once from the event loop; the reader it waits with, if any."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._loop: asyncio.AbstractEventLoop | None = None
        self._callback: OnExit | None = None
        self._delivered = False
        self._watching = False
        #: The fd whose reader callback is registered now, if one is, and where.
        self._reading: int | None = None
        self._hub: ReaderHub | None = None

    def on_exit(self, callback: OnExit) -> None:
        """See :meth:`ExitWatch.on_exit`."""
        if self._watching:
            raise RuntimeError(f"the exit of pid {self.pid} is watched already")
        self._watching = True
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._callback = callback
        self._begin()

    def abandon(self) -> None:
        """See :meth:`ExitWatch.abandon`."""
        self._stop_reading()
        self._deliver(ExitNotSeen())

    async def wait(self) -> int:
        """See :meth:`ExitWatch.wait`."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def settle(outcome: ExitOutcome) -> None:
            if future.done():
                return
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        self.on_exit(settle)
        return await future

    def _begin(self) -> None:
        raise NotImplementedError

    def _read_when_ready(self, fd: int, step: Callable[[], ExitOutcome | None]) -> None:
        """Once ``fd`` is readable, deliver what ``step`` returns (``None``: not yet)."""
        assert self._loop is not None
        self._hub = reader_hub(self._loop)
        self._hub.add(fd, functools.partial(self._on_readable, step))
        self._reading = fd

    def _on_readable(self, step: Callable[[], ExitOutcome | None]) -> None:
        self._stop_reading()
        outcome: ExitOutcome | None
        try:
            outcome = step()
        except Exception as exc:
            outcome = exc
        if outcome is not None:
            self._deliver(outcome)

    def _stop_reading(self) -> None:
        # Before the fd is closed, always: a registration left behind would belong to
        # whatever file reuses the number next.
        if self._reading is not None:
            assert self._hub is not None
            self._hub.remove(self._reading)
            self._reading, self._hub = None, None

    def _deliver(self, outcome: ExitOutcome) -> None:
        if self._delivered or self._callback is None:
            return
        self._delivered = True
        callback, self._callback = self._callback, None
        callback(outcome)


class PidfdWatch(LoopWatch):
    """Exit of one of our children through a pidfd."""

    def __init__(self, pid: int, pidfd: int) -> None:
        super().__init__(pid)
        self._pidfd: int | None = pidfd

    def _begin(self) -> None:
        assert self._pidfd is not None
        self._read_when_ready(self._pidfd, self._read_status)

    def _read_status(self) -> ExitOutcome:
        assert self._pidfd is not None
        info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOWAIT)
        assert info is not None
        return _platform.returncode_from_siginfo(info)

    def reap(self) -> None:
        """See :meth:`ExitWatch.reap`."""
        self._stop_reading()
        if self._pidfd is None:
            return
        # WNOHANG: teardown may give up on a process that outlived SIGKILL (uninterruptible
        # sleep); blocking here would stall the event loop. It is left to the subreaper.
        try:
            os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            pass
        os.close(self._pidfd)
        self._pidfd = None
        runtime.own_children.discard(self.pid)


class ThreadWatch(LoopWatch):
    """Exit of one of our children through a thread blocked in ``waitid``."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self._reaped = False

    def _begin(self) -> None:
        # A daemon thread of its own, not a pooled one: it blocks until the process
        # exits (every worker is eventually killed, so it ends), and WNOWAIT reaps
        # nothing. Abandoned, its late answer is dropped.
        threading.Thread(
            target=self._block_until_exit, name=f"aioelastic-exit-{self.pid}", daemon=True
        ).start()

    def _block_until_exit(self) -> None:
        outcome: ExitOutcome
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            assert info is not None
            outcome = _platform.returncode_from_siginfo(info)
        except Exception as exc:
            outcome = exc
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, outcome)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    def reap(self) -> None:
        """See :meth:`ExitWatch.reap`."""
        if self._reaped:
            return
        self._reaped = True
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        runtime.own_children.discard(self.pid)


class StatusPipeWatch(LoopWatch):
    """Exit of a worker another process of ours started, reported through a status pipe."""

    def __init__(self, pid: int, status_fd: int, release: Callable[[int], None]) -> None:
        super().__init__(pid)
        self._status_fd: int | None = status_fd
        self._release = release

    def _begin(self) -> None:
        assert self._status_fd is not None
        self._read_when_ready(self._status_fd, self._read_status)

    def _read_status(self) -> ExitOutcome | None:
        assert self._status_fd is not None
        returncode = decode_status(os.read(self._status_fd, STATUS.size))
        if returncode is None:
            # The reporting process died first: its workers die with it (parent-death
            # signal), so report what the kernel did to them.
            return self._reporter_died()
        return returncode

    def _reporter_died(self) -> ExitOutcome | None:
        """The outcome when the reporting process died first (``None``: delivered later)."""
        return -signal.SIGKILL

    def reap(self) -> None:
        """See :meth:`ExitWatch.reap`."""
        self._stop_reading()
        if self._status_fd is None:
            return
        os.close(self._status_fd)
        self._status_fd = None
        self._release(self.pid)


def watch_child(pid: int) -> ExitWatch:
    """The best available way to watch our own child ``pid``: a pidfd, else a thread.

    Must be called before anything could reap ``pid`` (right after it was started), so
    that the pidfd refers to our process and not to a recycled pid.
    """
    pidfd = _platform.pidfd_open(pid)
    if pidfd is not None:
        return PidfdWatch(pid, pidfd)
    return ThreadWatch(pid)
