"""A binary worker when the watchdog that started it, or the supervisor, goes wrong.

A worker is killed, not orphaned, when the watchdog dies under it or the supervisor dies at
any point of a start; a batch the watchdog died before answering is reported as not
started; a stopped watchdog that never reports an exit does not hold up teardown.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

import aioelastic
from aioelastic._core.process import _platform
from aioelastic._core.start._binary_start import BinaryStart, send_batch
from aioelastic._core.start._watchdog import watchdog
from tests.support.audit import MARK_VAR, processes_with_env
from tests.support.waits import ReadyFifo, close_with_reporter_stopped, is_running, process_state

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@pytest.mark.parametrize("fresh_watchdog", ["pidfd", "waitid-thread"], indirect=True)
async def test_watchdog_killed_under_a_running_binary_kills_it_and_reports_it(
    tmp_path: Path, fresh_watchdog: None
) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "sleeper",
            "/bin/sh",
            {0: ("-c", f"echo ready > {fifo.path}; exec sleep 600")},
            {0: {}},
            grace_period=1,
        ) as ctx:
            await fifo.lines(1)
            (pid,) = ctx.pids().values()
            assert is_running(pid)
            assert watchdog.pid is not None
            os.kill(watchdog.pid, signal.SIGKILL)
            with anyio.fail_after(20):
                result = await ctx.wait()
        assert result.failures[0].exitcode == -signal.SIGKILL
        assert not is_running(pid)  # killed (its new parent reaps it when it will)
        # The next start brings a new watchdog up.
        again = await aioelastic.run_processes("true", "true", {0: ()}, {0: {}})
        assert not again.is_failed()
    finally:
        fifo.close()


def _marked(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline and process_state(int(entry)) not in (None, "Z"):
            found.append(int(entry))
    return found


@pytest.mark.parametrize(
    ("kill_after", "exit_watch"),
    [(1, "pidfd"), (5, "pidfd"), (20, "pidfd"), (5, "waitid-thread"), (20, "waitid-thread")],
)
async def test_supervisor_sigkilled_while_starting_binaries_leaves_no_orphan(
    kill_after: int, exit_watch: str
) -> None:
    # The supervisor starts binaries in a loop and is SIGKILLed mid-stream, so that the
    # kill lands inside some start: every binary it created must still die.
    marker = f"aioelastic-orphan-check-{os.getpid()}-{kill_after}-{exit_watch}"
    env = dict(os.environ)
    if exit_watch == "waitid-thread":
        env[_platform.NO_PIDFD_ENV] = "1"  # the watchdog waits with threads
    proc = await anyio.open_process(
        [sys.executable, "-m", "tests.children.binary_loop", marker],
        stdout=subprocess.PIPE,
        stderr=None,
        env=env,
    )
    assert proc.stdout is not None
    seen = b""
    with anyio.fail_after(30):
        while seen.count(b"\n") < kill_after:
            seen += await proc.stdout.receive()
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    await proc.aclose()
    with anyio.fail_after(20):
        for pid in _marked(marker):
            await _exits(pid)
        # The supervisor's watchdog outlives it by the moment its kill of every group
        # takes (it acts on the parent-death signal, then exits): waited for too, or a
        # loaded machine finds it still alive when the test ends.
        for pid in processes_with_env(MARK_VAR, os.environ[MARK_VAR]):
            await _exits(pid)
    assert _marked(marker) == []


async def _exits(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


async def test_watchdog_dead_before_answering_a_batch_fails_every_start_of_it(
    fresh_watchdog: None,
) -> None:
    # The batch reached the watchdog's socket, but the watchdog died before it made
    # anything: every start is reported as not started, and nothing is left open.
    watchdog.ensure_started()
    assert watchdog.pid is not None
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    os.kill(watchdog.pid, signal.SIGSTOP)
    try:
        starts = [BinaryStart(["/bin/sleep", "600"], {}, devnull, devnull)] * 3
        batch = send_batch(dict(os.environ), starts, block=True)
        os.kill(watchdog.pid, signal.SIGKILL)
        started = time.monotonic()
        select.select([batch.fileno()], [], [], 20)  # readable: the end-of-file
        outcomes = batch.receive()
        batch.close()
    finally:
        os.close(devnull)
    assert time.monotonic() - started < 20
    assert batch.done
    assert len(outcomes) == 3
    for outcome in outcomes:
        assert isinstance(outcome, RuntimeError)
        assert "the watchdog died while starting '/bin/sleep'" in str(outcome)


@pytest.mark.timeout(90)
async def test_a_stopped_watchdog_that_never_reports_an_exit_does_not_hold_up_teardown(
    tmp_path: Path, fresh_watchdog: None
) -> None:
    # The watchdog started the worker and answered, then is stopped: the worker is
    # killed at close, but the exit report never comes. Teardown gives up on it after
    # its bound, says so, and leaves no fd (the batch's socket is closed once the last
    # worker it waits for is reaped); continued, the watchdog serves on.
    fifo = ReadyFifo(tmp_path)
    watchdog_pid = None
    try:
        ctx = aioelastic.start_processes(
            "unreported",
            "/bin/sh",
            {0: ("-c", f"echo ready > {fifo.path}; exec sleep 600")},
            {0: {}},
            grace_period=0.5,
        )
        async with ctx:
            await fifo.lines(1)
            watchdog_pid = watchdog.pid
            assert watchdog_pid is not None
            await close_with_reporter_stopped(ctx, watchdog_pid, grace=0.5)
    finally:
        fifo.close()
        if watchdog_pid is not None:
            os.kill(watchdog_pid, signal.SIGCONT)
    again = await aioelastic.run_processes("after", "/bin/true", {0: ()}, {0: {}})
    assert not again.is_failed()
    assert watchdog.pid == watchdog_pid
