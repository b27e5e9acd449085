"""Stall detection with real quiet, chatty and timer-armed workers."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest

import aioelastic
from aioelastic._core.hangs import _guard as _hangs
from aioelastic._core.hangs._stall import RankActivity, StallReport, wait_for_stall
from tests.children import hangs
from tests.support.paths import CHILDREN
from tests.support.waits import ReadyFifo, is_running

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]


async def test_stalled_group_fails_every_rank_with_its_last_output_and_stack(
    tmp_path: Path,
) -> None:
    ready = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "stall",
            hangs.stuck,
            {0: (str(ready.path), "event"), 1: (str(ready.path), "sleep")},
            {0: {}, 1: {}},
            log_dir=tmp_path / "logs",
            redirects=aioelastic.Std.ALL,
            grace_period=5,
            stall_timeout=1.0,
        ) as ctx:
            await ready.lines(2, timeout=60)
            quiet_from = time.monotonic()
            with anyio.fail_after(1.0 + 10.0):
                result = await ctx.wait()
            caught = time.monotonic() - quiet_from
    finally:
        ready.close()
    assert result is not None
    assert sorted(result.failures) == [0, 1]
    assert caught < 1.0 + 5.0
    for rank, name in [(0, "stuck_in_event_wait"), (1, "stuck_in_sleep")]:
        message = result.failures[rank].message
        assert message.startswith("stalled: no worker wrote output or sent a timer request for "), (
            message
        )
        assert "s (stall timeout 1s)\n" in message
        assert f"rank {rank}: no output since it started\n" in message
        assert f"in {name}" in message
        log = (tmp_path / "logs" / str(rank) / "stderr.log").read_text()
        assert log.startswith("[aioelastic] stalled: ")


@pytest.mark.parametrize("teller", ["tells", "raises", "hangs"])
async def test_a_stall_is_told_by_the_groups_teller_before_the_group_is_stopped(
    tmp_path: Path,
    teller: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An agent tells a stall with every node's stacks (tests/elastic/channel/test_multinode.py);
    a teller that fails or takes too long gives way to the group's own report, and the group
    is stopped all the same."""
    monkeypatch.setattr(_hangs, "STALL_TELL_TIMEOUT", 1.0)
    ready = ReadyFifo(tmp_path)
    alive_when_told: list[bool] = []

    async def tell(report: StallReport) -> str:
        alive_when_told.append(all(is_running(pid) for pid in ctx.pids().values()))
        if teller == "raises":
            raise OSError("the store is gone")
        if teller == "hangs":
            await anyio.sleep_forever()
        return f"told: {report.reason()} with {sorted(report.stacks)}\n"

    try:
        ctx = aioelastic.start_processes(
            "told", hangs.stuck, {0: (str(ready.path), "event")}, {0: {}}, stall_timeout=1.0
        )
        ctx.tell_stalls_with(tell)
        async with ctx:
            await ready.lines(1, timeout=60)
            with anyio.fail_after(1.0 + 20.0):
                result = await ctx.wait()
    finally:
        ready.close()
    assert result is not None
    assert list(result.failures) == [0]
    assert result.failures[0].message.startswith("stalled: ")
    assert alive_when_told == [True]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    if teller == "tells":
        assert "aioelastic: told: stalled: no worker wrote output" in logged
        assert "with [0]" in logged
    else:
        assert "--- stack of local rank 0 ---" in logged
        assert "in stuck_in_event_wait" in logged
    if teller == "raises":
        assert "could not tell the stall in full: OSError('the store is gone')" in logged


async def test_chatty_worker_is_never_stalled(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    try:
        result = await aioelastic.run_processes(
            "chatty",
            hangs.chatty,
            {0: (str(ready.path), 3.0)},
            {0: {}},
            log_dir=tmp_path / "logs",
            redirects=aioelastic.Std.OUT,
            stall_timeout=1.0,
        )
    finally:
        ready.close()
    assert not result.is_failed()
    assert result.return_values == {0: "done"}


async def test_timer_requests_count_as_a_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Silent, but arming and releasing a timer every 0.3 s: alive, not stalled.
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    ready = ReadyFifo(tmp_path)
    try:
        result = await aioelastic.run_processes(
            "beats",
            hangs.heartbeat,
            {0: (str(ready.path), 2.5, 0.3)},
            {0: {}},
            stall_timeout=1.0,
        )
    finally:
        ready.close()
    assert not result.is_failed(), result.failures


async def test_report_names_what_each_rank_last_wrote() -> None:
    report = StallReport(
        30.0,
        31.25,
        [RankActivity(0, 100.0, "epoch 3 step 41"), RankActivity(1, None)],
        {1: "Current thread 0x1 (most recent call first):\n  File x, line 1 in f\n"},
        at=131.0,
    )
    assert report.format() == (
        "stalled: no worker wrote output or sent a timer request for 31.2s "
        "(stall timeout 30s)\n"
        "  rank 0: last output 31.0s ago: 'epoch 3 step 41'\n"
        "  rank 1: no output since it started\n"
        "--- stack of local rank 1 ---\n"
        "Current thread 0x1 (most recent call first):\n"
        "  File x, line 1 in f\n"
    )


async def test_wait_for_stall_moves_with_activity_and_rejects_nonsense() -> None:
    last = [time.monotonic()]
    async with anyio.create_task_group() as tg:
        done = anyio.Event()
        idle: list[float] = []

        async def watch() -> None:
            idle.append(await wait_for_stall(0.5, lambda: last[0]))
            done.set()

        tg.start_soon(watch)
        began = time.monotonic()
        # Activity at 0.3 s pushes the deadline to 0.8 s.
        await anyio.sleep(0.3)
        last[0] = time.monotonic()
        with anyio.fail_after(10):
            await done.wait()
        assert time.monotonic() - began >= 0.8
        assert idle[0] >= 0.5
    with pytest.raises(
        ValueError, match=r"stall timeout must be a positive number of seconds, got 0"
    ):
        await wait_for_stall(0, time.monotonic)
    with pytest.raises(ValueError, match=r"stall_timeout: -1 is not > 0 seconds"):
        aioelastic.start_processes("x", hangs.chatty, {0: ("", 0.0)}, {0: {}}, stall_timeout=-1)


@pytest.mark.asyncio
async def test_cli_stall_timeout_reports_every_rank_with_its_stack(tmp_path: Path) -> None:
    barrier = str(CHILDREN / "barrier.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    argv = [sys.executable, "-m", "aioelastic.run", "--nproc-per-node", "2"]
    logs = tmp_path / "logs"
    begin = time.monotonic()
    out = await anyio.run_process(
        [*argv, "--stall-timeout", "2", "--max-restarts", "0", f"--log-dir={logs}", barrier],
        env=env,
        check=False,
    )
    stderr = out.stderr.decode()
    assert time.monotonic() - begin < 60
    # Stopped as a group (SIGTERM), every rank a failure with its own stack.
    assert out.returncode == 128 + signal.SIGTERM, stderr
    report = stderr[stderr.index("=" * 60) :]
    assert report.count("stalled: no worker wrote output or sent a timer request for ") == 2
    assert "rank 0: last output " in report
    assert "ago: 'rank 0 step 1'" in report
    assert "ago: 'rank 1 step 1'" in report
    assert "in other_rank_waits_in_sleep" in report
    assert "in wait_for_peers_in_barrier" in report
    # Printed before the workers were stopped, and kept: the job's report, here one node's
    # ranks, grouped by where they are (as across nodes, docs/hangs.md).
    told = stderr[stderr.index("stalled: no worker wrote") : stderr.index("=" * 60)]
    assert "\nstacks of 2 ranks on 1 node\n" in told
    assert re.search(r"\nrank 0 \(node 0 \S+ pid \d+\): other_rank_waits_in_sleep <- ", told)
    assert re.search(r"\nrank 1 \(node 0 \S+ pid \d+\): wait <- wait threading.py:", told)
    (written,) = logs.glob("*/stall-*.txt")
    assert told.startswith(written.read_text().rstrip("\n"))


async def test_cli_rejects_a_bad_stall_timeout() -> None:
    out = await anyio.run_process(
        [sys.executable, "-m", "aioelastic.run", "--stall-timeout", "0", "x.py"], check=False
    )
    assert out.returncode == 2
    assert "error: argument --stall-timeout: 0 is not > 0 seconds" in out.stderr.decode()
