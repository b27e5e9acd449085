"""f. Supervisor cost while N workers sit idle: CPU time and threads of the supervisor.

N ``python -S`` workers print one line, signal that they run, then sleep. From that moment
the supervisor is in its ``wait(timeout=T)`` (what a caller does while a job runs) for T
seconds; the measure is the supervisor process's own CPU time (all its threads, not its
children) over those T seconds and its thread count (the larger of the counts at the
start and the end of the window). tee: every stream of every rank tee'd to the console
(torch: one TailLog thread per rank and stream, each polling its file every 0.1 s).
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness._spec import Group, Measure, Metric, RepContext
from benchmarks.measures._common import NAME, aio_core, aio_std, envs_for, log_dir
from benchmarks.measures._systems import binary_pair, binary_row
from benchmarks.programs import _bin
from benchmarks.programs._ready import make_fifo, wait_ready, wait_ready_async

CPU = Metric("cpu", "ms CPU", scale=1000.0)
THREADS = Metric("threads", "threads")


def _thread_count() -> int:
    """Threads of this process right now (from ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads: line in /proc/self/status")


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads, not its children).

    ``CLOCK_PROCESS_CPUTIME_ID`` has nanosecond resolution; ``os.times()`` counts in
    clock ticks (10 ms), too coarse for an idle supervisor.
    """
    return time.process_time()


def _args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    fifo = make_fifo(ctx.workdir / "ready")
    return {r: _bin.argv("idle", fifo) for r in range(ctx.n)}


async def aio(ctx: RepContext) -> dict[str, float]:
    """aioelastic: ``await pc.wait(timeout=T)`` while the workers idle."""
    core = aio_core()
    std = aio_std()
    tee = std.ALL if ctx.params.get("tee") else std.NONE
    idle = ctx.float_param("idle")
    async with core.start_processes(
        name=NAME,
        entrypoint=_bin.executable(),
        args=_args(ctx),
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
        tee=tee,
    ) as pc:
        await wait_ready_async(str(ctx.workdir / "ready"), ctx.n)
        threads = _thread_count()
        cpu = _cpu_seconds()
        result = await pc.wait(timeout=idle)
        cpu = _cpu_seconds() - cpu
        threads = max(threads, _thread_count())
        if result is not None:
            raise RuntimeError(f"aioelastic: the idle workers ended early: {result!r}")
    return {"cpu": cpu, "threads": threads}


def torch_elastic(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic: ``pc.wait(timeout=T)`` (period 1 s) while the workers idle."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    tee = Std.ALL if ctx.params.get("tee") else Std.NONE
    idle = ctx.float_param("idle")
    pc = start_processes(
        name=NAME,
        entrypoint=_bin.executable(),
        args=_args(ctx),
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx), tee=tee),
    )
    try:
        wait_ready(ctx.workdir / "ready", ctx.n)
        threads = _thread_count()
        cpu = _cpu_seconds()
        result = pc.wait(timeout=idle)
        cpu = _cpu_seconds() - cpu
        threads = max(threads, _thread_count())
    finally:
        pc.close()
    if result is not None:
        raise RuntimeError(f"torch.elastic: the idle workers ended early: {result!r}")
    return {"cpu": cpu, "threads": threads}


_M = "benchmarks.measures.idle"


def _group(name: str, tee: bool, reps: int) -> Group:
    return Group(
        name=name,
        systems=binary_pair(_M, "aio", "torch_elastic"),
        rows=(binary_row(name, headline_n=16),),
        ns=(16,),
        quick_ns=(4,),
        default_reps=reps,
        params={"tee": tee, "idle": 20.0},
        quick_params={"idle": 1.0},
        warmup=False,
        rep_timeout=120.0,
    )


MEASURE = Measure(
    name="idle",
    letter="f",
    title="supervisor cost while N workers idle for 20 s",
    metrics=(CPU, THREADS),
    notes=(
        "The supervisor's own CPU time (all threads, not children) and thread count during "
        "`wait(timeout=20)` while N python -S workers sleep. tee: all streams of all ranks tee'd."
    ),
    groups=(_group("tee", True, 2), _group("no tee", False, 1)),
)
