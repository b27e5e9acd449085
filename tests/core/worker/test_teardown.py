"""Teardown's search for what is left of a group: the shared scan and the members it finds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

import aioelastic
from aioelastic._core.process import _platform
from aioelastic._core.process._runtime import runtime
from tests.children import core
from tests.support.paths import CHILDREN
from tests.support.waits import ReadyFifo, is_running

#: A group leader that forks a child which exits at once and is left a zombie (waited for
#: with WNOWAIT, never reaped), forks a second child that keeps running, reports both
#: pids, then blocks on stdin.
_LEADER = """
import os, sys, time
dead = os.fork()
if dead == 0:
    os._exit(0)
os.waitid(os.P_PID, dead, os.WEXITED | os.WNOWAIT)
live = os.fork()
if live == 0:
    sys.stdin.read()
    os._exit(0)
print(dead, live, flush=True)
sys.stdin.read()
"""


def test_live_group_members_lists_running_members_and_skips_zombies() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", _LEADER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,  # its own group (Popen's process_group= is 3.11+)
    )
    try:
        assert leader.stdout is not None
        dead, live = (int(pid) for pid in leader.stdout.readline().split())
        ours = os.getpgid(0)
        members = _platform.live_group_members({leader.pid, ours})
        assert sorted(members[leader.pid]) == sorted([leader.pid, live])
        assert dead not in members[leader.pid]
        # A caller that knows the leaders exited has them skipped unread (teardown's scan).
        assert _platform.live_group_members({leader.pid}, leaders_exited=True) == {
            leader.pid: [live]
        }
        # Pids named as no member (other groups' leaders, in teardown) are not looked at.
        assert (
            _platform.live_group_members({leader.pid}, leaders_exited=True, not_members={live})
            == {}
        )
        # Our own group is asked for too: this test process is a running member of it.
        assert os.getpid() in members[ours]
        assert _platform.live_group_members(set()) == {}
    finally:
        assert leader.stdin is not None
        leader.stdin.close()  # both blocked readers see end-of-file and exit
        leader.wait(timeout=30)
        assert leader.stdout is not None
        leader.stdout.close()
        # The leader's children were re-parented to init, which reaps them.


@pytest.mark.asyncio
async def test_groups_closed_together_each_lose_their_grandchildren(tmp_path: Path) -> None:
    """Teardowns running at once share one scan; each still finds its own group's members."""
    count = 4
    fifos = [ReadyFifo(tmp_path, f"ready{k}") for k in range(count)]
    grandchildren: list[int] = []
    try:
        async with AsyncExitStack() as stack:
            contexts = []
            for k, fifo in enumerate(fifos):
                ctx = aioelastic.start_processes(
                    f"g{k}", core.grandchild_then, {0: (str(fifo.path), 0, True)}, {0: {}}
                )
                contexts.append(await stack.enter_async_context(ctx))
            for fifo, ctx in zip(fifos, contexts, strict=True):
                (line,) = await fifo.lines(1)
                grandchildren.append(int(line.split()[1]))
                # The worker itself exits 0; its grandchild (which ignores SIGTERM, so
                # only a SIGKILL after a scan that found it ends it) runs on in its group.
                result = await ctx.wait()
                assert result is not None
                assert not result.is_failed()
            assert all(is_running(pid) for pid in grandchildren)
            async with anyio.create_task_group() as tg:
                for ctx in contexts:
                    tg.start_soon(ctx.close, signal.SIGTERM, 0.5)
            assert not any(is_running(pid) for pid in grandchildren)
    finally:
        for fifo in fifos:
            fifo.close()


@pytest.mark.asyncio
async def test_a_group_that_ended_leaves_no_leader_for_the_scans_to_skip(tmp_path: Path) -> None:
    """Teardown's scans skip the recorded workers of every group; a reaped one must be
    forgotten at once, or its pid, once reused, would be skipped in someone's group."""
    before = set(runtime.worker_leaders)
    result = await aioelastic.run_processes(
        "mixed", "/bin/sh", {0: ("-c", "exit 0"), 1: ("-c", "exit 3")}, {0: {}, 1: {}}
    )
    assert result.is_failed()
    assert runtime.worker_leaders == before


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_close_whose_task_asyncio_cancels_still_stops_every_worker(
    tmp_path: Path,
) -> None:
    """asyncio's own cancellation reaches through anyio's shields; teardown must not stop.

    It is what ``asyncio.run`` does to the main task at Ctrl-C, often while that task is
    in ``close()`` (a failed group waiting out its grace period). The worker ignores
    SIGTERM, so the teardown is in its grace period when the cancellation comes; it must
    still SIGKILL and reap the worker, and only then pass the cancellation on.
    """
    import asyncio
    import time

    fifo = ReadyFifo(tmp_path)
    grace = 1.0
    script = (
        f"trap 'echo term > {fifo.path}' TERM; echo ready > {fifo.path}; "
        "while :; do sleep 600 & wait $!; done"
    )
    try:
        async with aioelastic.start_processes(
            "stubborn", "/bin/sh", {0: ("-c", script)}, {0: {}}, grace_period=grace
        ) as ctx:
            assert await fifo.lines(1) == ["ready"]
            (pid,) = ctx.pids().values()
            started = time.monotonic()
            closer = asyncio.ensure_future(ctx.close())
            assert await fifo.lines(1) == ["term"]  # the teardown is in its grace period
            assert is_running(pid)
            closer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closer
            took = time.monotonic() - started
            assert not is_running(pid)  # SIGKILLed after the grace period, and reaped
            result = await ctx.wait()
        assert took < grace + 10
        assert result is not None
        assert result.stopped
    finally:
        fifo.close()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_ctrl_c_while_close_waits_out_its_grace_period_still_ends_every_worker(
    tmp_path: Path,
) -> None:
    """The same, from a real SIGINT to a supervisor running under ``anyio.run``."""
    import json
    import time

    fifo = ReadyFifo(tmp_path)
    try:
        async with await anyio.open_process(
            [sys.executable, "-m", "tests.children.interrupted_close", str(fifo.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        ) as proc:
            assert proc.stdin is not None
            assert proc.stderr is not None
            (line,) = await fifo.lines(1)
            worker = int(line.split()[1])
            await proc.stdin.send(b"close\n")
            err = b""
            with anyio.fail_after(30):
                while b"closing\n" not in err:
                    err += await proc.stderr.receive()
            proc.send_signal(signal.SIGINT)  # close() is in its 2 s grace period now
            started = time.monotonic()
            with anyio.fail_after(30):
                await proc.wait()
                async for chunk in proc.stderr:
                    err += chunk
            took = time.monotonic() - started
    finally:
        fifo.close()
    assert took < 2.0 + 10
    left = json.loads(err.decode().strip().splitlines()[-1])
    assert left == {"children": [], "fds": []}
    assert not is_running(worker)


# -- stop_leader_first -------------------------------------------------------------------

_CLI_CHILD = str(CHILDREN / "cli.py")


async def _checkpointing_group(
    tmp_path: Path, *, stop_leader_first: bool, grace: float, helper_ignores_term: bool = False
) -> tuple[str, float, list[int]]:
    """Start one checkpointing worker (tests/children/cli.py), close its group, and say
    what its checkpoint came to, how long ``close()`` took, and the worker's and helper's pids.
    """
    import time

    fifo = ReadyFifo(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    argv = ("-u", _CLI_CHILD, "checkpoint", "--out", str(out), "--ready", str(fifo.path))
    if helper_ignores_term:
        argv += ("--helper-ignores-term",)
    try:
        async with aioelastic.start_processes(
            "trainer",
            sys.executable,
            {0: argv},
            {0: {}},
            grace_period=grace,
            stop_leader_first=stop_leader_first,
        ) as ctx:
            (line,) = await fifo.lines(1, timeout=60)
            pids = [int(word.split("=")[1]) for word in line.split()[2:]]
            started = time.monotonic()
            await ctx.close()
            took = time.monotonic() - started
            result = await ctx.wait()
    finally:
        fifo.close()
    assert result is not None
    assert not result.failures  # it exited 0 after the stop signal: stopped, not failed
    return (out / "rank0").read_text(), took, pids


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_stop_leader_first_lets_the_worker_checkpoint_with_its_helper(
    tmp_path: Path,
) -> None:
    """The worker alone gets SIGTERM; its helper answers; the group is signalled after."""
    saved, took, pids = await _checkpointing_group(tmp_path, stop_leader_first=True, grace=30)
    assert saved == "saved step 0"
    # The helper outlives its stdin (only a signal ends it): the group got SIGTERM when
    # the worker exited, long before the grace period would have ended.
    assert took < 10, took
    assert not any(is_running(pid) for pid in pids)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_by_default_the_whole_group_is_signalled_and_the_helper_is_gone(
    tmp_path: Path,
) -> None:
    """torchrun's behaviour, unchanged: the helper gets SIGTERM with the worker."""
    saved, took, pids = await _checkpointing_group(tmp_path, stop_leader_first=False, grace=30)
    assert saved == "helper gone"
    assert took < 10, took
    assert not any(is_running(pid) for pid in pids)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_stop_leader_first_kills_a_helper_that_ignores_the_signal_after_the_grace(
    tmp_path: Path,
) -> None:
    grace = 1.0
    saved, took, pids = await _checkpointing_group(
        tmp_path, stop_leader_first=True, grace=grace, helper_ignores_term=True
    )
    assert saved == "saved step 0"
    assert grace <= took < grace + 10, took  # SIGKILLed once the grace period ended
    assert not any(is_running(pid) for pid in pids)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_stop_leader_first_still_escalates_on_a_second_close(tmp_path: Path) -> None:
    """A worker and a child that both ignore SIGTERM: the second close() SIGKILLs both."""
    import time

    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "stubborn",
            sys.executable,
            {0: ("-u", _CLI_CHILD, "hold", "--ignore-signals", "--ready", str(fifo.path))},
            {0: {}},
            grace_period=300,
            stop_leader_first=True,
        ) as ctx:
            (line,) = await fifo.lines(1, timeout=60)
            pids = [int(word.split("=")[1]) for word in line.split()[2:]]
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctx.close)
                tg.start_soon(ctx.close)
            took = time.monotonic() - started
    finally:
        fifo.close()
    assert took < 10, took
    assert not any(is_running(pid) for pid in pids)


def test_stop_leader_first_takes_only_a_bool() -> None:
    with pytest.raises(TypeError, match=r"^stop_leader_first: 'yes' \(str\) is not True or False$"):
        aioelastic.start_processes("w", "/bin/true", {0: ()}, {0: {}}, stop_leader_first="yes")
