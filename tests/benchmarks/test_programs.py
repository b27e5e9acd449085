"""The worker programs' side of the protocol: the ready barrier, the supervisor tree's memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from benchmarks.programs._ready import make_fifo, wait_ready, wait_ready_async

ROOT = Path(__file__).resolve().parents[2]


def _blocking(path: Path, count: int) -> None:
    wait_ready(path, count)


def _on_the_loop(path: Path, count: int) -> None:
    anyio.run(wait_ready_async, path, count)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", [_blocking, _on_the_loop])
def test_the_ready_barrier_returns_once_every_worker_signalled(
    tmp_path: Path, wait: Callable[[Path, int], None]
) -> None:
    fifo = make_fifo(tmp_path / "ready")
    # Workers open the FIFO write-only, which blocks until the barrier opens it: as in a
    # repetition, they may start before the waiter does.
    code = (
        "import sys; from benchmarks.programs._ready import signal_ready; signal_ready(sys.argv[1])"
    )
    workers = [
        subprocess.Popen([sys.executable, "-c", code, str(fifo)], cwd=ROOT) for _ in range(3)
    ]
    try:
        wait(fifo, 3)
    finally:
        for worker in workers:
            assert worker.wait(timeout=30) == 0


@pytest.mark.parametrize("wait", [_blocking, _on_the_loop])
def test_the_ready_barrier_waits_for_nobody_when_no_one_is_expected(
    tmp_path: Path, wait: Callable[[Path, int], None]
) -> None:
    wait(tmp_path / "never-made", 0)  # a group of one: rank 0 has no sibling to wait for


def test_supervisor_tree_memory_leaves_out_the_workers() -> None:
    from benchmarks.programs._scale_mem import children, rss_kb, tree_kb

    worker = subprocess.Popen(["/bin/sleep", "60"])
    try:
        # Stopped, its memory cannot change between two readings (a process just past
        # exec is still loading its libraries). waitpid(WUNTRACED) returns once it is.
        os.kill(worker.pid, signal.SIGSTOP)
        os.waitpid(worker.pid, os.WUNTRACED)
        assert worker.pid in children(os.getpid())
        assert rss_kb(worker.pid) > 0
        assert tree_kb(worker.pid, ()) == rss_kb(worker.pid)
        assert tree_kb(worker.pid, {worker.pid}) == 0
    finally:
        worker.kill()
        worker.wait(timeout=10)
    assert rss_kb(worker.pid) == 0  # reaped: gone from /proc
