"""Workers die with their supervisor, however it dies — and only then."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.support.audit import MARK_VAR, processes_with_env
from tests.support.waits import is_running, make_fifo, read_line, wait_gone

pytestmark = pytest.mark.asyncio


async def _start_supervisor(
    tmp_path: Path, method: str, nprocs: int, hold: float
) -> tuple[anyio.abc.Process, list[int]]:
    fifo = make_fifo(tmp_path, "ready.fifo")
    proc = await anyio.open_process(
        [
            sys.executable,
            "-m",
            "tests.children.core",
            "supervise",
            method,
            str(nprocs),
            str(fifo),
            str(hold),
        ],
        stdout=subprocess.PIPE,
        stderr=None,
    )
    assert proc.stdout is not None
    line = await read_line(proc.stdout, timeout=60)
    head, _, reported = line.partition("|")
    words = head.split()
    assert words[0] == "pids", line
    pids = [int(w) for w in words[1:]]
    if method == "grandchildren":
        pids += [int(w) for w in reported.split()]
    return proc, pids


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver", "binary", "grandchildren"])
async def test_sigkill_of_the_supervisor_kills_its_workers(tmp_path: Path, method: str) -> None:
    proc, pids = await _start_supervisor(tmp_path, method, 2, hold=0)
    assert all(is_running(pid) for pid in pids)
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    for pid in pids:
        # Workers: the kernel's parent-death signal. Their children: the watchdog.
        await wait_gone(pid, timeout=10.0)
    # And every helper it started (a fork server and its spares: their own parent-death
    # signals), which on a loaded machine may still be on its way out as the workers are
    # gone: found by the test's mark in their environment.
    for pid in processes_with_env(MARK_VAR, os.environ[MARK_VAR]):
        await wait_gone(pid, timeout=10.0)
    await proc.aclose()


async def test_subreaper_mode_stops_a_descendant_that_left_its_group(tmp_path: Path) -> None:
    fifo = make_fifo(tmp_path, "ready.fifo")
    proc = await anyio.run_process(
        [sys.executable, "-m", "tests.children.core", "subreaper", str(fifo)], check=True
    )
    words = proc.stdout.decode().split()
    assert words[0] == "escaped"
    assert words[2] == "gone", f"escaped descendant {words[1]} left in state {words[2]}"


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_workers_outlive_the_thread_that_started_them(tmp_path: Path) -> None:
    proc, pids = await _start_supervisor(tmp_path, "spawn", 2, hold=11.0)
    assert proc.stdout is not None
    assert await read_line(proc.stdout, timeout=40) == "alive"
    proc.send_signal(signal.SIGTERM)
    await proc.wait()
    for pid in pids:
        await wait_gone(pid, timeout=10.0)
    await proc.aclose()
