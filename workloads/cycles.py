"""Start/wait/close cycles, measured: what one supervising process keeps after many runs.

:func:`measure_cycles` runs the cycles and returns the supervisor's open fds, resident
memory and threads before and after (and the fork server's fds).
``tests/core/group/test_resources.py`` asserts bounds on these figures;
``python -m benchmarks.resources`` prints them.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio

import aioelastic
from aioelastic._core.process import _platform
from aioelastic._core.start._forkserver import fork_server
from workloads import workers


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
    """The ``start_processes`` arguments of one cycle of ``nprocs`` workers of ``kind``."""
    envs: dict[int, dict[str, str]] = {r: {} for r in range(nprocs)}
    if kind == "binary":
        return {"entrypoint": "true", "args": {r: () for r in range(nprocs)}, "envs": envs}
    return {
        "entrypoint": workers.add,
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
