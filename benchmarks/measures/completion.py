"""b. No-op job completion: from the start call until the caller has the result.

bin: N x ``/bin/true``. fn: N no-op functions from a module that imports nothing heavy,
started by a (warm) fork server. torch.distributed.elastic's ``PContext.wait()`` runs
with its default ``period=1``: a job can never complete faster than its first poll after
the workers exit. torch.multiprocessing's ``join`` waits on the processes' sentinels.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness._spec import SECONDS, Group, Measure, RepContext
from benchmarks.measures._common import (
    NAME,
    aio_core,
    check_success,
    envs_for,
    log_dir,
    preload_torch_if_asked,
    torch_mp,
)
from benchmarks.measures._systems import binary_pair, binary_row, forkserver_rows, forkserver_trio
from benchmarks.programs._clock import now_ns, seconds

TRUE = "/bin/true"


def _fn_args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    return {r: (r, str(ctx.workdir)) for r in range(ctx.n)}


async def _aio(ctx: RepContext, entrypoint: Any, args: dict[int, Any], **kw: Any) -> float:
    """Seconds from aioelastic's ``run_processes`` call to its successful result."""
    core = aio_core()
    start = now_ns()
    result = await core.run_processes(
        name=NAME,
        entrypoint=entrypoint,
        args=args,
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
        **kw,
    )
    elapsed = now_ns() - start
    check_success(result, "aioelastic")
    return seconds(elapsed)


def _torch_elastic(ctx: RepContext, entrypoint: Any, args: dict[int, Any], **kw: Any) -> float:
    """Seconds from torch.distributed.elastic's ``start_processes`` to ``wait()``'s result."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    start = now_ns()
    pc = start_processes(
        name=NAME,
        entrypoint=entrypoint,
        args=args,
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx)),
        **kw,
    )
    try:
        result = pc.wait()
        elapsed = now_ns() - start
    finally:
        pc.close()
    check_success(result, "torch.elastic")
    return seconds(elapsed)


async def aio_bin(ctx: RepContext) -> dict[str, float]:
    """aioelastic run_processes of N /bin/true."""
    return {"seconds": await _aio(ctx, TRUE, {r: () for r in range(ctx.n)})}


def torch_elastic_bin(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic start_processes + wait() of N /bin/true."""
    return {"seconds": _torch_elastic(ctx, TRUE, {r: () for r in range(ctx.n)})}


async def aio_fn(ctx: RepContext) -> dict[str, float]:
    """aioelastic run_processes of N no-op functions (fork server)."""
    from benchmarks.programs import _fn_light

    return {"seconds": await _aio(ctx, _fn_light.noop, _fn_args(ctx), start_method="forkserver")}


def torch_elastic_fn(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic start_processes + wait() of N no-op functions."""
    from benchmarks.programs import _fn_light

    preload_torch_if_asked(ctx)
    return {
        "seconds": _torch_elastic(ctx, _fn_light.noop, _fn_args(ctx), start_method="forkserver")
    }


def torch_mp_fn(ctx: RepContext) -> dict[str, float]:
    """torch.multiprocessing.start_processes(join=True) of N no-op functions."""
    mp = torch_mp()
    from benchmarks.programs import _fn_light

    preload_torch_if_asked(ctx)
    start = now_ns()
    mp.start_processes(
        _fn_light.noop, args=(str(ctx.workdir),), nprocs=ctx.n, join=True, start_method="forkserver"
    )
    return {"seconds": seconds(now_ns() - start)}


_M = "benchmarks.measures.completion"

MEASURE = Measure(
    name="completion",
    letter="b",
    title="no-op job: start call to result in hand",
    metrics=(SECONDS,),
    notes=(
        "bin: N x /bin/true. fn: N no-op functions (their module imports nothing heavy) through "
        "a warm fork server; torch's fork server preloads torch, which its worker wrapper "
        "imports. torch.elastic waits with its default `wait()` (period 1 s)."
    ),
    groups=(
        Group(
            name="bin",
            systems=binary_pair(_M),
            rows=(binary_row("bin /bin/true", headline_n=8),),
            ns=(1, 2, 4, 8, 16, 32),
            quick_ns=(2,),
            default_reps=5,
        ),
        Group(
            name="fn",
            systems=forkserver_trio(_M),
            rows=forkserver_rows("fn no-op forkserver"),
            ns=(1, 4, 16),
            quick_ns=(2,),
            default_reps=5,
        ),
    ),
)
