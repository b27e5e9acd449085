"""Many jobs in one event loop: K groups side by side, each streamed, one failing, one cancelled.

    python examples/many_jobs.py --jobs 64 --nprocs 4 --lines 200 [--json out.json]

Every job is a :func:`aioelastic.start_processes` group of small shell workers, with its own
log directory and its own subscriber reading ``ctx.output()``. Job 1 fails (one rank exits
3); job 2 is cancelled while its workers run. Meanwhile a ticker measures how late the
event loop runs a 1 ms timer: the worst lateness is how unresponsive a service embedding
these jobs would have been. Prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

import aioelastic
from aioelastic import Std

FAILING_JOB = 1
CANCELLED_JOB = 2


def _worker_script(lines: int, fail: bool, hang: bool) -> str:
    body = f'i=0; while [ $i -lt {lines} ]; do echo "$0 line $i"; i=$((i+1)); done'
    if hang:
        body += "; echo ready; exec sleep 1000"
    if fail:
        body += "; exit 3"
    return body


async def run_job(
    job: int, nprocs: int, lines: int, log_root: Path, report: dict[str, Any]
) -> None:
    """One job: start, stream every line, wait; record what it saw and how it ended."""
    hang = job == CANCELLED_JOB
    seen = {rank: 0 for rank in range(nprocs)}
    with anyio.CancelScope() as scope:
        async with aioelastic.start_processes(
            name=f"job{job}",
            entrypoint="/bin/sh",
            args={
                rank: (
                    "-c",
                    _worker_script(lines, job == FAILING_JOB and rank == nprocs - 1, hang),
                    f"r{rank}",
                )
                for rank in range(nprocs)
            },
            envs={rank: {} for rank in range(nprocs)},
            log_dir=log_root / f"job{job}",
            redirects=Std.OUT,
            grace_period=2.0,
        ) as ctx:
            report["pids"][job] = list(ctx.pids().values())
            async with ctx.output() as output:
                async for item in output:
                    if item.text == "ready" and hang:
                        scope.cancel()  # cancelled mid-run, as a DELETE would
                    elif item.stream is Std.OUT:
                        seen[item.local_rank] += 1 + item.missed
            result = await ctx.wait()
        assert result is not None
        report["failed"][job] = sorted(result.failures)
    if scope.cancelled_caught:
        report["cancelled"].append(job)
    report["lines"][job] = seen


async def main_async(jobs: int, nprocs: int, lines: int) -> dict[str, Any]:
    """Run the scenario; return its summary (lines seen per job, latency, outcome)."""
    report: dict[str, Any] = {"pids": {}, "failed": {}, "cancelled": [], "lines": {}}
    worst = 0.0
    ticks = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal worst, ticks
        while not done.is_set():
            before = time.monotonic()
            await anyio.sleep(0.001)
            worst = max(worst, time.monotonic() - before - 0.001)
            ticks += 1

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aioelastic-many-jobs-") as tmp:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with anyio.create_task_group() as jobs_tg:
                for job in range(jobs):
                    jobs_tg.start_soon(run_job, job, nprocs, lines, Path(tmp), report)
            done.set()
    report.update(
        jobs=jobs,
        nprocs=nprocs,
        lines_per_rank=lines,
        seconds=round(time.monotonic() - started, 3),
        worst_loop_lateness_ms=round(worst * 1000, 2),
        ticks=ticks,
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    opts = parser.parse_args()
    report = anyio.run(main_async, opts.jobs, opts.nprocs, opts.lines)
    text = json.dumps(report, sort_keys=True)
    if opts.json is not None:
        opts.json.write_text(text + "\n")
    print(text, flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
