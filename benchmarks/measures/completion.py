"""b. No-op job completion: from the start call until the caller has the result.

bin: N x ``/bin/true``. fn: N no-op functions from a module that imports nothing heavy,
started by a (warm) fork server. torch.distributed.elastic's ``PContext.wait()`` runs
with its default ``period=1``: a job can never complete faster than its first poll after
the workers exit. torch.multiprocessing's ``join`` waits on the processes' sentinels.
"""

from __future__ import annotations

from typing import Any

from benchmarks._spec import SECONDS, Group, Measure, RepContext, Row, System
from benchmarks._util import now_ns, seconds
from benchmarks.measures._common import (
    NAME,
    aio_core,
    check_success,
    envs_for,
    log_dir,
    set_stdlib_forkserver_preload,
    torch_mp,
)

TRUE = "/bin/true"


def _fn_args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    return {r: (r, str(ctx.workdir)) for r in range(ctx.n)}


async def aio_bin(ctx: RepContext) -> dict[str, float]:
    """aioelastic run_processes of N /bin/true."""
    core = aio_core()
    start = now_ns()
    result = await core.run_processes(
        name=NAME,
        entrypoint=TRUE,
        args={r: () for r in range(ctx.n)},
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
    )
    elapsed = now_ns() - start
    check_success(result, "aioelastic")
    return {"seconds": seconds(elapsed)}


def torch_elastic_bin(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic start_processes + wait() of N /bin/true."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    start = now_ns()
    pc = start_processes(
        name=NAME,
        entrypoint=TRUE,
        args={r: () for r in range(ctx.n)},
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx)),
    )
    try:
        result = pc.wait()
        elapsed = now_ns() - start
    finally:
        pc.close()
    check_success(result, "torch.elastic")
    return {"seconds": seconds(elapsed)}


async def aio_fn(ctx: RepContext) -> dict[str, float]:
    """aioelastic run_processes of N no-op functions (fork server)."""
    core = aio_core()
    from benchmarks import _fn_light

    start = now_ns()
    result = await core.run_processes(
        name=NAME,
        entrypoint=_fn_light.noop,
        args=_fn_args(ctx),
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
        start_method="forkserver",
    )
    elapsed = now_ns() - start
    check_success(result, "aioelastic")
    return {"seconds": seconds(elapsed)}


def torch_elastic_fn(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic start_processes + wait() of N no-op functions."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from benchmarks import _fn_light

    _torch_preload(ctx)
    start = now_ns()
    pc = start_processes(
        name=NAME,
        entrypoint=_fn_light.noop,
        args=_fn_args(ctx),
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx)),
        start_method="forkserver",
    )
    try:
        result = pc.wait()
        elapsed = now_ns() - start
    finally:
        pc.close()
    check_success(result, "torch.elastic")
    return {"seconds": seconds(elapsed)}


def torch_mp_fn(ctx: RepContext) -> dict[str, float]:
    """torch.multiprocessing.start_processes(join=True) of N no-op functions."""
    mp = torch_mp()
    from benchmarks import _fn_light

    _torch_preload(ctx)
    start = now_ns()
    mp.start_processes(
        _fn_light.noop, args=(str(ctx.workdir),), nprocs=ctx.n, join=True, start_method="forkserver"
    )
    return {"seconds": seconds(now_ns() - start)}


def _torch_preload(ctx: RepContext) -> None:
    # torch's worker wrapper (its _wrap) lives in torch, so each of its function workers
    # imports torch even when the user's function does not; a torch-preloading fork
    # server keeps that ~1.5 s out of the comparison, which is about waiting, not imports.
    if ctx.params.get("torch_preload"):
        set_stdlib_forkserver_preload(["torch"])


_M = "benchmarks.measures.completion"
_TP = {"torch_preload": True}

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
            systems=(
                System("aioelastic/binary", "aioelastic", f"{_M}:aio_bin"),
                System("torch.elastic/binary", "torch", f"{_M}:torch_elastic_bin"),
            ),
            rows=(Row("bin /bin/true", "aioelastic/binary", "torch.elastic/binary", headline_n=8),),
            ns=(1, 2, 4, 8, 16, 32),
            quick_ns=(2,),
            default_reps=5,
        ),
        Group(
            name="fn",
            systems=(
                System("aioelastic/forkserver", "aioelastic", f"{_M}:aio_fn"),
                System("torch.elastic/forkserver", "torch", f"{_M}:torch_elastic_fn", _TP),
                System("torch.mp/forkserver", "torch", f"{_M}:torch_mp_fn", _TP),
            ),
            rows=(
                Row("fn no-op forkserver", "aioelastic/forkserver", "torch.elastic/forkserver"),
                Row("fn no-op forkserver", "aioelastic/forkserver", "torch.mp/forkserver"),
            ),
            ns=(1, 4, 16),
            quick_ns=(2,),
            default_reps=5,
        ),
    ),
)
