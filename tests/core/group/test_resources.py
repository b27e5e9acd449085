"""Resource stability: many start/wait/close cycles leave the supervisor as they found it.

A supervisor lives as long as its service or agent, and runs groups over and over (every
restart of an elastic job is one). Whatever one cycle leaks — a pipe, a pidfd, a log
file, a thread, a buffer — adds up. This runs 1,000 cycles of 4 workers and compares the
supervising process's file descriptors (must be exactly equal), resident memory (flat
within a generous bound) and threads (bounded by the launcher pool) before and after.

:func:`workloads.cycles.measure_cycles` does the measuring; ``python -m
benchmarks.resources`` prints the same figures outside pytest.
"""

from __future__ import annotations

import pytest

from workloads.cycles import measure_cycles

pytestmark = pytest.mark.asyncio

#: Resident-memory growth allowed over 1,000 cycles. Generous on purpose: the allocator
#: keeps freed arenas, and a shared machine adds noise; a leak of even one 1 KiB object
#: per worker would be 4 MB here, a leaked pipe buffer far more.
RSS_BOUND_MB = 20.0
#: Launcher threads never retire (see aioelastic._core.start._launchers) and are created on demand,
#: up to this many: the only threads a cycle may add for good.
LAUNCHER_THREADS = 8


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
