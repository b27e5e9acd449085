"""Event-driven synchronisation for tests: a child says "ready" through a FIFO.

The test creates the FIFO and opens its read end without blocking; a worker opens it for
writing and writes a line when it reached the state the test waits for. The test awaits
readability with a timeout — never a sleep.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from aioelastic._core.process._platform import proc_stat


class ReadyFifo:
    """A named pipe a worker writes ``ready``-style lines to."""

    def __init__(self, directory: Path, name: str = "ready") -> None:
        self.path = make_fifo(directory, f"{name}.fifo")
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        # Our own idle writer: without one, the FIFO reports hang-up (readable, empty)
        # after each worker closes it, and waiting on it would spin.
        self._keep_open = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self._buffer = b""

    async def lines(self, count: int, timeout: float = 30.0) -> list[str]:
        """Wait for ``count`` lines (each writer writes whole lines)."""
        with anyio.fail_after(timeout):
            while self._buffer.count(b"\n") < count:
                await anyio.wait_readable(self._fd)
                self._buffer += os.read(self._fd, 65536)
        lines = self._buffer.split(b"\n")
        taken, rest = lines[:count], lines[count:]
        self._buffer = b"\n".join(rest)
        return [line.decode() for line in taken]

    def close(self) -> None:
        """Close both ends."""
        os.close(self._keep_open)
        os.close(self._fd)


def make_fifo(directory: Path, name: str) -> Path:
    """A new named pipe ``directory/name``, for a child program to open by its path.

    How each side opens it is the caller's: a ``go`` gate the test writes to once the
    workers should go on, or a channel a worker answers on; :class:`ReadyFifo` for
    ``ready`` lines.
    """
    path = directory / name
    os.mkfifo(path)
    return path


async def read_line(stream: anyio.abc.ByteReceiveStream, timeout: float = 30) -> str:
    """The next line a child process writes to ``stream``, decoded, without its newline.

    Read a byte at a time: whatever follows the line stays in the stream for the next call.
    """
    line = b""
    with anyio.fail_after(timeout):
        while not line.endswith(b"\n"):
            line += await stream.receive(1)
    return line.decode().strip()


def process_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (``None`` when it no longer exists)."""
    fields = proc_stat(pid, 1)
    return None if fields is None else fields[0].decode()


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z", "X")


def _status_mask(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return None


def wait_signal_held(pid: int, sig: int, timeout: float) -> bool:
    """Wait until ``sig`` is pending on ``pid`` and blocked there (held, not acted on).

    ``False`` once ``pid`` is gone or the time is out: it took the signal (its default
    action, a handler) instead of holding it. The kernel has no event for a signal made
    pending, so ``/proc`` is read until then (a signal sent before the call is pending
    already: at once).
    """
    bit = 1 << (sig - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and is_running(pid):
        pending, blocked = _status_mask(pid, "ShdPnd"), _status_mask(pid, "SigBlk")
        if pending is not None and blocked is not None and pending & blocked & bit:
            return True
        time.sleep(0.01)
    return False


async def wait_gone(pid: int, timeout: float = 30) -> None:
    """Wait, event-driven (a pidfd), until ``pid`` has exited; it may stay a zombie."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with anyio.fail_after(timeout):
            await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def wait_all_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Block until every process in ``pids`` has exited; return those still running.

    The blocking twin of :func:`wait_gone`, for synchronous tests (a launcher run as a
    subprocess): waits on each pidfd with ``select`` until one shared deadline.
    """
    deadline = time.monotonic() + timeout
    alive = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone (and reaped)
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                alive.append(pid)
        finally:
            os.close(fd)
    return alive


@asynccontextmanager
async def started_in_own_session(
    argv: list[str], env: dict[str, str]
) -> AsyncIterator[anyio.abc.Process]:
    """A process in its own session, killed (group and all) and reaped on the way out."""
    proc = await anyio.open_process(
        argv, env={**os.environ, **env}, start_new_session=True, stderr=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with anyio.CancelScope(shield=True):
            await proc.wait()
            await proc.aclose()


async def close_with_reporter_stopped(ctx: Any, reporter_pid: int, grace: float) -> Any:
    """SIGSTOP the process that reports the workers' exits, ``close()`` ``ctx``, and check it.

    The report never comes: teardown must give up after its bound, and the rank's failure
    must say its exit status is unknown. Returns the result of ``ctx.wait()``; the caller
    continues the reporter (SIGCONT) whatever happens.
    """
    from aioelastic._core.worker._teardown import CHILDREN_KILL_TIMEOUT

    os.kill(reporter_pid, signal.SIGSTOP)
    start = time.monotonic()
    with anyio.fail_after(60):
        await ctx.close()
    took = time.monotonic() - start
    result = await ctx.wait()
    assert took < grace + CHILDREN_KILL_TIMEOUT + 15
    assert result is not None
    assert result.is_failed()
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert failure.message == (
        f"worker 0 was not seen exiting {CHILDREN_KILL_TIMEOUT:g} s after SIGKILL "
        "(uninterruptible sleep, or a stopped fork server or watchdog?); its exit status "
        "is unknown"
    )
    return result


async def longest_loop_gap(seconds: float, tick: float = 0.005) -> float:
    """Sleep ``tick`` at a time for ``seconds``; the longest the event loop kept this task
    waiting between two wake-ups (a loop blocked in a system call shows here)."""
    worst, last = 0.0, time.monotonic()
    until = last + seconds
    while last < until:
        await anyio.sleep(tick)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    return worst


async def longest_loop_gap_while_stopped(
    pid: int, jobs: Sequence[Callable[[], Awaitable[object]]], seconds: float = 1.0
) -> float:
    """Stop process ``pid`` (SIGSTOP), start ``jobs`` at once and tick for ``seconds``,
    then continue it and await the jobs: the longest gap of the event loop meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(job)
            worst = await longest_loop_gap(seconds)
            os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)
    return worst
