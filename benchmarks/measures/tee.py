"""g. Tee: console throughput, lines lost or broken, and the latency of a single line.

The supervisor's fd 1 is a pipe read by a thread that dates every chunk
(:func:`benchmarks.measures._common.console`), so each system's console output is
captured and timed the same way.

throughput: N ``python -S`` workers each write LINES numbered lines of WIDTH characters
as fast as they can, stdout tee'd. Lines/s = all lines / (last byte on the console - first
worker's first write). Every console line must be exactly one worker line with its
rank's prefix: the others are *broken* (split, merged, wrong prefix, duplicated); worker
lines never seen whole are *lost*.

latency: N workers each print COUNT lines, one every INTERVAL s (0.13: not a multiple of
torch's 0.1 s tail period, so lines fall at varying phases of it), each carrying the clock
at its write; the latency is its arrival on the console minus that (median and maximum
over all lines of a repetition).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness._spec import Group, Measure, Metric, RepContext
from benchmarks.measures._common import (
    LINE,
    NAME,
    Capture,
    aio_core,
    aio_std,
    check_success,
    console,
    count_lines,
    envs_for,
    log_dir,
)
from benchmarks.measures._systems import binary_pair, binary_row
from benchmarks.programs import _bin
from benchmarks.programs._clock import read_stamps, seconds

RATE = Metric("lines_per_s", "lines/s", higher_is_better=True)
LOST = Metric("lost", "lines lost", ratio=False)
BROKEN = Metric("broken", "lines broken", ratio=False)
LATENCY = Metric("latency", "ms latency", scale=1000.0)
LATENCY_MAX = Metric("latency_max", "ms max latency", scale=1000.0)


def _args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    if ctx.str_param("mode") == "throughput":
        lines, width = ctx.int_param("lines"), ctx.int_param("width")
        return {r: _bin.argv("spam", ctx.workdir, r, lines, width) for r in range(ctx.n)}
    count, interval = ctx.int_param("count"), ctx.float_param("interval")
    return {r: _bin.argv("ping", r, count, interval) for r in range(ctx.n)}


def _metrics(ctx: RepContext, capture: Capture) -> dict[str, float]:
    if ctx.str_param("mode") == "throughput":
        lines, width = ctx.int_param("lines"), ctx.int_param("width")
        counted = count_lines(capture, ctx.n, lines, width)
        first = min(read_stamps(ctx.workdir, "spam_start", ctx.n))
        rate = ctx.n * lines / seconds(capture.last_arrival() - first)
        return {"lines_per_s": rate, "lost": counted.lost, "broken": counted.broken}
    latencies = []
    for line, arrival in capture.lines_with_arrival():
        match = LINE.match(line)
        if match is not None:
            latencies.append(seconds(arrival - int(match.group(4))))
    expected = ctx.n * ctx.int_param("count")
    if len(latencies) != expected:
        raise RuntimeError(f"expected {expected} timed lines on the console, got {len(latencies)}")
    return {"latency": statistics.median(latencies), "latency_max": max(latencies)}


async def aio(ctx: RepContext) -> dict[str, float]:
    """aioelastic with ``tee=Std.OUT``."""
    core = aio_core()
    std = aio_std()
    args = _args(ctx)
    with console() as capture:
        async with core.start_processes(
            name=NAME,
            entrypoint=_bin.executable(),
            args=args,
            envs=envs_for(ctx.n),
            log_dir=log_dir(ctx),
            tee=std.OUT,
        ) as pc:
            result = await pc.wait()
    check_success(result, "aioelastic")
    return _metrics(ctx, capture)


def torch_elastic(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic with ``tee=Std.OUT`` (TailLog)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    args = _args(ctx)
    with console() as capture:
        pc = start_processes(
            name=NAME,
            entrypoint=_bin.executable(),
            args=args,
            envs=envs_for(ctx.n),
            logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx), tee=Std.OUT),
        )
        try:
            # The period does not enter the numbers (they come from the console's clock);
            # a short one only ends each repetition sooner.
            result = pc.wait(period=0.05)
        finally:
            pc.close()
    check_success(result, "torch.elastic")
    return _metrics(ctx, capture)


_M = "benchmarks.measures.tee"
_SYSTEMS = binary_pair(_M, "aio", "torch_elastic")

MEASURE = Measure(
    name="tee",
    letter="g",
    title="tee'd output on the supervisor's console",
    metrics=(RATE, LOST, BROKEN, LATENCY, LATENCY_MAX),
    notes=(
        "throughput: N python -S workers each write 50,000 lines of 60 characters as fast as they "
        "can, stdout tee'd; console = a pipe drained by a thread (sys.stdout line-buffered, as on "
        "a terminal). latency: each worker prints 10 lines 0.13 s apart; console arrival - write."
    ),
    groups=(
        Group(
            name="throughput",
            systems=_SYSTEMS,
            rows=(binary_row("throughput", headline_n=4),),
            ns=(1, 4, 16),
            quick_ns=(2,),
            default_reps=3,
            params={"mode": "throughput", "lines": 50_000, "width": 60},
            quick_params={"lines": 2_000},
            warmup=False,
            rep_timeout=180.0,
        ),
        Group(
            name="latency",
            systems=_SYSTEMS,
            rows=(binary_row("latency", headline_n=16),),
            ns=(1, 16),
            quick_ns=(2,),
            default_reps=3,
            params={"mode": "latency", "count": 10, "interval": 0.13},
            quick_params={"count": 3},
            warmup=False,
            rep_timeout=60.0,
        ),
    ),
)
