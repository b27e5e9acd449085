"""Learning that a worker exited, from the kernel, without reaping it.

A worker's exit is observed with ``WNOWAIT``: the process stays a zombie until teardown
has signalled its process group for the last time. While the leader is unreaped its pid
(and so its process-group id) cannot be reused, so ``killpg(pgid)`` can never hit an
unrelated process group that happens to get the same number.

Three ways to watch, chosen by :func:`watch_child`:

* :class:`PidfdWatch` — a pidfd becomes readable when the process exits; anyio waits on
  it like on a socket. No thread, no polling.
* :class:`ThreadWatch` — the fallback where pidfds are missing: a thread blocks in
  ``waitid(WNOWAIT)``. (A ``multiprocessing`` sentinel would be the other option, but a
  grandchild that inherited the pipe keeps it open after the worker's own exit.)
* :class:`StatusPipeWatch` — for workers forked by our fork server (not our children):
  the server watches them and writes the exit status into a pipe only we and it hold.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.to_thread

from . import _platform
from ._runtime import runtime
from ._status import STATUS, decode_status


class ExitWatch(Protocol):
    """Waits for one process's exit and reaps it afterwards."""

    pid: int

    async def wait(self) -> int:
        """Return the exit code (negative: killed by that signal) once the process exited.

        Only one task may wait at a time; the process stays unreaped.
        """
        ...

    def reap(self) -> None:
        """Release the exited process (reap the zombie) and any fd held for it. Idempotent."""
        ...


class PidfdWatch:
    """Exit of one of our children through a pidfd."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd: int | None = pidfd
        self._returncode: int | None = None

    async def wait(self) -> int:
        """See :meth:`ExitWatch.wait`."""
        if self._returncode is None:
            assert self._pidfd is not None
            await anyio.wait_readable(self._pidfd)
            info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOWAIT)
            assert info is not None
            self._returncode = _platform.returncode_from_siginfo(info)
        return self._returncode

    def reap(self) -> None:
        """See :meth:`ExitWatch.reap`."""
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


def _waiter_limiter() -> anyio.CapacityLimiter:
    # Waiter threads block until their process exits, and every worker gets one in
    # fallback mode: they must not queue behind anyio's default limit of 40 threads.
    limiter = runtime.exit_waiters
    if limiter is None:
        limiter = runtime.exit_waiters = anyio.CapacityLimiter(math.inf)
    return limiter


class ThreadWatch:
    """Exit of one of our children through a thread blocked in ``waitid``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._returncode: int | None = None
        self._reaped = False

    def _block_until_exit(self) -> int:
        info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        assert info is not None
        return _platform.returncode_from_siginfo(info)

    async def wait(self) -> int:
        """See :meth:`ExitWatch.wait`."""
        if self._returncode is None:
            # If this wait is cancelled the thread is abandoned; it still ends, because
            # every worker is eventually killed, and WNOWAIT means it reaps nothing.
            self._returncode = await anyio.to_thread.run_sync(
                self._block_until_exit, abandon_on_cancel=True, limiter=_waiter_limiter()
            )
        return self._returncode

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


class StatusPipeWatch:
    """Exit of a fork-server worker, reported by the server through a status pipe."""

    def __init__(self, pid: int, status_fd: int, release: Callable[[int], None]) -> None:
        self.pid = pid
        self._status_fd: int | None = status_fd
        self._release = release
        self._returncode: int | None = None

    async def wait(self) -> int:
        """See :meth:`ExitWatch.wait`."""
        if self._returncode is None:
            assert self._status_fd is not None
            await anyio.wait_readable(self._status_fd)
            returncode = decode_status(os.read(self._status_fd, STATUS.size))
            if returncode is not None:
                self._returncode = returncode
            else:
                # The fork server died before reporting: its workers die with it
                # (parent-death signal), so report what the kernel did to them.
                self._returncode = -signal.SIGKILL
        return self._returncode

    def reap(self) -> None:
        """See :meth:`ExitWatch.reap`."""
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
