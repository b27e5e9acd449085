"""Watch and forget messages to the watchdog: queued, never a wait, none lost or reordered.

Messages beyond what the watchdog's socket holds wait in the supervisor and arrive in
order; stopping the watchdog sends what was queued first; a killed watchdog's queue is
dropped at once; at interpreter exit the calling thread drains them itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

import aioelastic
from aioelastic._core.start._watchdog import watchdog
from tests.support.waits import process_state, read_line, wait_gone

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def _started_watchdog_pid() -> int:
    watchdog.ensure_started()
    watchdog_pid = watchdog.pid
    assert watchdog_pid is not None
    return watchdog_pid


def _no_such_groups(count: int) -> list[int]:
    """Process group ids above ``pid_max``: no process can ever have them."""
    above = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    return [above + k for k in range(count)]


def _queue_at_stopped_watchdog(watchdog_pid: int, first: int, then: list[int]) -> None:
    """Stop the watchdog; watch ``first`` (into its socket), then forget each of ``then``
    (the socket fills; the rest waits in the supervisor's queue)."""
    os.kill(watchdog_pid, signal.SIGSTOP)
    watchdog.watch(first)
    for pgid in then:
        watchdog.forget(pgid)
    assert len(watchdog._messages) > 0, "every message fit in the socket: nothing was tested"


async def test_watch_messages_queued_at_a_stopped_watchdog_never_block_and_arrive_in_order(
    fresh_watchdog: None,
) -> None:
    # Watching and forgetting a group are one small message each; a datagram socket
    # takes a bounded number however small. At a stopped watchdog the ones beyond wait
    # in the supervisor, sent in order once it reads again: a group watched and
    # forgotten many times is forgotten in the end, so the watchdog's exit spares it.
    watchdog_pid = _started_watchdog_pid()
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        os.kill(watchdog_pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for _ in range(2000):
                watchdog.watch(bystander.pid)
                watchdog.forget(bystander.pid)
            queued = len(watchdog._messages)
            took = time.monotonic() - started
        finally:
            os.kill(watchdog_pid, signal.SIGCONT)
        assert queued > 0, "every message fit in the socket: nothing was tested"
        assert took < 5, f"4000 messages took {took:.1f} s to hand over"
        assert await anyio.to_thread.run_sync(watchdog._messages.flush, 30)
        result = await aioelastic.run_processes("after", "/bin/sh", {0: ("-c", "exit 3")}, {0: {}})
        assert result.failures[0].exitcode == 3
        watchdog.stop()  # it kills every group it still watches
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


async def test_stopping_the_watchdog_sends_what_was_queued_first(fresh_watchdog: None) -> None:
    # A forget still queued when the supervisor stops its watchdog must reach it before
    # the end-of-file: dropped, the watchdog would kill a group the job had let go of.
    watchdog_pid = _started_watchdog_pid()
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        fillers = _no_such_groups(2000)
        _queue_at_stopped_watchdog(watchdog_pid, bystander.pid, [*fillers, bystander.pid])
        os.kill(watchdog_pid, signal.SIGCONT)
        started = time.monotonic()
        watchdog.stop()  # at once: most of the queue is still in the supervisor
        assert time.monotonic() - started < 10
        assert bystander.poll() is None
        assert len(watchdog._messages) == 0
    finally:
        bystander.kill()
        bystander.wait()


async def test_messages_queued_at_a_watchdog_killed_meanwhile_are_dropped_at_once(
    fresh_watchdog: None,
) -> None:
    # The watchdog dies (SIGKILL) with messages still queued for it: the launcher thread
    # sending them gets an error instead of waiting for ever, drops the rest, and the
    # next start brings up a new watchdog.
    watchdog_pid = _started_watchdog_pid()
    first, *then = _no_such_groups(2001)
    _queue_at_stopped_watchdog(watchdog_pid, first, then)
    os.kill(watchdog_pid, signal.SIGKILL)
    started = time.monotonic()
    assert await anyio.to_thread.run_sync(watchdog._messages.flush, 10)
    assert time.monotonic() - started < 10
    assert len(watchdog._messages) == 0
    result = await aioelastic.run_processes("after", "/bin/sh", {0: ("-c", "exit 3")}, {0: {}})
    assert result.failures[0].exitcode == 3
    assert watchdog.pid != watchdog_pid
    assert process_state(watchdog_pid) is None  # the dead one was reaped


#: Run by the next test in a supervisor of its own: at its interpreter's exit, once no
#: thread may start, it floods its stopped watchdog with watch and forget messages.
_FLOOD_AT_EXIT = """
import atexit, os, signal, sys
from aioelastic._core.start._launchers import launcher_pool
from aioelastic._core.start._watchdog import watchdog

bystander, first_unused = int(sys.argv[1]), int(sys.argv[2])
watchdog.ensure_started()

def flood():  # registered after the watchdog's own stop(): runs before it
    try:
        launcher_pool().submit(int)
    except RuntimeError:
        print("refused", watchdog.pid, flush=True)
    else:
        print("accepted", flush=True)
        return
    os.kill(watchdog.pid, signal.SIGSTOP)
    watchdog.watch(bystander)
    for k in range(2000):
        watchdog.forget(first_unused + k)
    watchdog.forget(bystander)
    print("sent", len(watchdog._messages), flush=True)

atexit.register(flood)
"""

#: sendmsg's number in /proc/PID/syscall.
_SENDMSG = {"x86_64": 46, "aarch64": 211}.get(os.uname().machine)


@pytest.mark.skipif(_SENDMSG is None, reason="sendmsg's syscall number is known for x86_64/arm64")
async def test_messages_sent_at_interpreter_exit_are_drained_on_the_calling_thread() -> None:
    # At interpreter exit no launcher thread can start, so a message that finds the
    # watchdog's socket full is drained by the thread that sent it: it waits for the
    # watchdog (here stopped, then continued) instead of being lost, and the forget
    # sent last still reaches the watchdog before its end-of-file.
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        proc = await anyio.open_process(
            [sys.executable, "-c", _FLOOD_AT_EXIT, str(bystander.pid), str(_no_such_groups(1)[0])],
            stdout=subprocess.PIPE,
            stderr=None,
        )
        async with proc:
            assert proc.stdout is not None
            word, watchdog_pid = (await read_line(proc.stdout)).split()
            assert word == "refused"
            # Event: the exiting thread sleeps in sendmsg on the stopped watchdog's socket.
            with anyio.fail_after(30):
                while Path(f"/proc/{proc.pid}/syscall").read_text().split()[0] != str(_SENDMSG):
                    await anyio.sleep(0.01)
            os.kill(int(watchdog_pid), signal.SIGCONT)
            assert await read_line(proc.stdout) == "sent 0"
            with anyio.fail_after(30):
                assert await proc.wait() == 0
        await wait_gone(int(watchdog_pid), timeout=10)
        assert bystander.poll() is None  # its forget arrived before the end-of-file
    finally:
        bystander.kill()
        bystander.wait()
