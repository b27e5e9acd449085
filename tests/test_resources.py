"""Resource stability: many start/wait/close cycles leave the supervisor as they found it.

A supervisor lives as long as its service or agent, and runs groups over and over (every
restart of an elastic job is one). Whatever one cycle leaks — a pipe, a pidfd, a log
file, a thread, a buffer — adds up. This runs 1,000 cycles of 4 workers and compares the
supervising process's file descriptors (must be exactly equal), resident memory (flat
within a generous bound) and threads (bounded by the launcher pool) before and after.

:func:`measure_cycles` is also the function a benchmark calls to print these figures.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic import _platform
from aioelastic._forkserver import fork_server
from tests.children import core

pytestmark = pytest.mark.asyncio

#: Resident-memory growth allowed over 1,000 cycles. Generous on purpose: the allocator
#: keeps freed arenas, and a shared machine adds noise; a leak of even one 1 KiB object
#: per worker would be 4 MB here, a leaked pipe buffer far more.
RSS_BOUND_MB = 20.0
#: Launcher threads never retire (see aioelastic._launchers) and are created on demand,
#: up to this many: the only threads a cycle may add for good.
LAUNCHER_THREADS = 8


@dataclass(frozen=True)
class CycleFigures:
    """What :func:`measure_cycles` measured."""

    cycles: int
    nprocs: int
    kind: str
    seconds: float
    fds_before: int
    fds_after: int
    rss_before_mb: float
    rss_after_mb: float
    threads_before: int
    threads_after: int
    #: Open fds of the fork server that made the workers (``kind="forkserver"`` only).
    server_fds_before: int | None = None
    server_fds_after: int | None = None

    @property
    def rss_growth_mb(self) -> float:
        """Resident memory gained over the measured cycles."""
        return self.rss_after_mb - self.rss_before_mb

    def table(self) -> str:
        """The figures as printed by the test (and a benchmark)."""
        per_cycle = 1000 * self.seconds / self.cycles
        return "\n".join(
            [
                f"aioelastic resource stability: {self.cycles} start/wait/close cycles of "
                f"{self.nprocs} {self.kind} workers in {self.seconds:.1f} s "
                f"({per_cycle:.1f} ms per cycle)",
                f"  open fds       {self.fds_before:>8} -> {self.fds_after:<8}",
                f"  RSS (MB)       {self.rss_before_mb:>8.1f} -> {self.rss_after_mb:<8.1f}"
                f" ({self.rss_growth_mb:+.1f})",
                f"  threads        {self.threads_before:>8} -> {self.threads_after:<8}",
                *(
                    [f"  fork server fds{self.server_fds_before:>8} -> {self.server_fds_after:<8}"]
                    if self.server_fds_before is not None
                    else []
                ),
            ]
        )


def open_fd_count(pid: int | str = "self") -> int:
    """Open file descriptors of this process (or of ``pid``)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _server_fds() -> int | None:
    """The fork server's open fds once it reaped every worker it was released.

    It reaps on the supervisor's release message, on its own time, and no event says when:
    this checks its children at short intervals (bounded), then counts.
    """
    pid = fork_server(()).pid
    if pid is None:
        return None
    deadline = time.monotonic() + 10
    while _platform.children_of(pid) and time.monotonic() < deadline:
        await anyio.sleep(0.005)
    return open_fd_count(pid)


def rss_mb() -> float:
    """Resident set size of this process, in MB (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _group(kind: str, nprocs: int) -> dict[str, Any]:
    envs: dict[int, dict[str, str]] = {r: {} for r in range(nprocs)}
    if kind == "binary":
        return {"entrypoint": "true", "args": {r: () for r in range(nprocs)}, "envs": envs}
    return {
        "entrypoint": core.add,
        "args": {r: (r, 1) for r in range(nprocs)},
        "envs": envs,
        "start_method": kind,
    }


async def measure_cycles(
    cycles: int = 1000, nprocs: int = 4, kind: str = "fork", warmup: int = 20
) -> CycleFigures:
    """Run ``cycles`` start/wait/close cycles and measure the supervisor before and after.

    Args:
        cycles: Measured cycles.
        nprocs: Workers per cycle.
        kind: ``"binary"`` (the ``true`` program) or a start method for a function worker
            (``"fork"``, ``"forkserver"``, ``"spawn"``).
        warmup: Cycles run first, unmeasured: they start what is kept for good on first
            use (launcher threads, the watchdog, a fork server).

    Returns:
        The figures; every cycle is checked to have succeeded.
    """
    group = _group(kind, nprocs)
    expected = {r: None if kind == "binary" else r + 1 for r in range(nprocs)}

    async def cycle() -> None:
        async with aioelastic.start_processes("cycle", **group, grace_period=5) as ctx:
            result = await ctx.wait()
        assert result is not None
        assert result.return_values == expected, result

    for _ in range(warmup):
        await cycle()
    gc.collect()
    fds_before, rss_before, threads_before = open_fd_count(), rss_mb(), threading.active_count()
    server_fds_before = await _server_fds() if kind == "forkserver" else None
    started = time.perf_counter()
    for _ in range(cycles):
        await cycle()
    seconds = time.perf_counter() - started
    gc.collect()
    return CycleFigures(
        cycles=cycles,
        nprocs=nprocs,
        kind=kind,
        seconds=seconds,
        fds_before=fds_before,
        fds_after=open_fd_count(),
        rss_before_mb=rss_before,
        rss_after_mb=rss_mb(),
        threads_before=threads_before,
        threads_after=threading.active_count(),
        server_fds_before=server_fds_before,
        server_fds_after=await _server_fds() if kind == "forkserver" else None,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_thousand_cycles_leave_fds_and_memory_flat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Fork-server workers: a fork of the small server costs the same whatever the size of
    # this process (pytest with torch imported makes a plain fork twice as slow), and the
    # server's own bookkeeping (one status pipe and pidfd per worker) is checked as well.
    figures = await measure_cycles(cycles=1000, nprocs=4, kind="forkserver")
    with capsys.disabled():
        print("\n" + figures.table())
    assert figures.fds_after == figures.fds_before
    assert figures.server_fds_after == figures.server_fds_before
    assert figures.rss_growth_mb < RSS_BOUND_MB
    assert figures.threads_after <= figures.threads_before + LAUNCHER_THREADS


@pytest.mark.parametrize("kind", ["binary", "fork", "spawn"])
async def test_cycles_of_every_kind_leave_fds_flat(kind: str) -> None:
    """Fewer cycles, every other way a worker is made: the fds must match exactly."""
    figures = await measure_cycles(
        cycles=10 if kind == "spawn" else 50, nprocs=4, kind=kind, warmup=3
    )
    assert figures.fds_after == figures.fds_before, figures.table()
