"""The failing job behind measures c (failure detection) and d (teardown).

N workers; once all run, rank 0 waits a random delay (so that its failure falls at a
random phase of any polling period), stamps the clock and exits 1. Its siblings sleep,
optionally ignoring SIGTERM so that the supervisor has to wait out its grace period and
SIGKILL them. The result is the time from rank 0's stamp to the moment the supervisor's
wait hands the failure to the caller, with every sibling stopped (both systems stop the
siblings before returning).

Parameters: ``ignore_term`` (bool), ``grace`` (s; aioelastic's ``grace_period`` and
torch.multiprocessing's ``grace_period``; torch.distributed.elastic has no such knob on
this path and always allows 30 s), ``limit`` (s; torch runs are stopped after this and
reported as ``> limit``), ``jitter`` (s; the random delay's upper bound).
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness._spec import RepContext, RepTimeout
from benchmarks.measures._common import (
    NAME,
    aio_core,
    check_failure,
    envs_for,
    log_dir,
    preload_torch_if_asked,
    torch_mp,
)
from benchmarks.programs import _bin
from benchmarks.programs._clock import now_ns, read_stamp, read_stamps, seconds
from benchmarks.programs._ready import make_fifo, wait_ready, wait_ready_async


class Watchdog:
    """SIGKILLs the given workers if the run is still going after ``limit`` seconds.

    torch's failure path blocks for 30 s on SIGTERM-ignoring siblings whatever grace the
    caller wanted; rather than spend those 30 s per repetition, the run is cut short by
    killing the siblings (the processes this driver started, by pid), which lets torch's
    teardown return, and the repetition is reported as a timeout.
    """

    def __init__(self, limit: float, pids: Callable[[], list[int]]) -> None:
        self.limit = limit
        self.fired = False
        self._pids = pids
        self._timer = threading.Timer(limit, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        for pid in self._pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self._timer.join()
        if self.fired:
            raise RepTimeout(self.limit)


def _outcome(ctx: RepContext, done: int) -> dict[str, float]:
    failed = read_stamp(ctx.workdir / "fail0")
    elapsed = seconds(done - failed)
    grace = ctx.float_param("grace")
    outcome = {
        "seconds": elapsed,
        "beyond_grace": elapsed - grace if ctx.params["ignore_term"] else 0.0,
    }
    if ctx.n > 1 and not ctx.params["ignore_term"]:
        # Every sibling stamped its SIGTERM before it died, and both systems return only
        # once the siblings are gone: the first stamp is when the failure was acted on.
        # (See benchmarks.programs._fn_light.stamp_on_term.)
        told = read_stamps(ctx.workdir, "term", ctx.n, first=1)
        outcome["detected"] = seconds(min(told) - failed)
    return outcome


def _delay(ctx: RepContext) -> float:
    return random.uniform(0.0, ctx.float_param("jitter"))


def _fifos(ctx: RepContext) -> tuple[Path, Path]:
    return make_fifo(ctx.workdir / "ready"), make_fifo(ctx.workdir / "armed")


def _bin_args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    fifo, armed = _fifos(ctx)
    ignore = int(bool(ctx.params["ignore_term"]))
    args = {0: _bin.argv("fail", fifo, ctx.n - 1, armed, ctx.workdir / "fail0", _delay(ctx))}
    term = ctx.workdir / "term"
    args.update({r: _bin.argv("sleep", fifo, ignore, f"{term}{r}") for r in range(1, ctx.n)})
    return args


def _fn_args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    _fifos(ctx)
    delay = _delay(ctx)
    return {
        r: (r, str(ctx.workdir), ctx.n, bool(ctx.params["ignore_term"]), delay)
        for r in range(ctx.n)
    }


async def aio_bin(ctx: RepContext) -> dict[str, float]:
    """aioelastic: binary workers, wait() until the failure is in hand."""
    core = aio_core()
    async with core.start_processes(
        name=NAME,
        entrypoint=_bin.executable(),
        args=_bin_args(ctx),
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
        grace_period=ctx.float_param("grace"),
    ) as pc:
        await wait_ready_async(str(ctx.workdir / "armed"), 1)
        result = await pc.wait()
        done = now_ns()
    check_failure(result, "aioelastic")
    return _outcome(ctx, done)


async def aio_fn(ctx: RepContext) -> dict[str, float]:
    """aioelastic: function workers (warm fork server), wait() until the failure is in hand."""
    core = aio_core()
    from benchmarks.programs import _fn_light

    async with core.start_processes(
        name=NAME,
        entrypoint=_fn_light.fail_or_sleep,
        args=_fn_args(ctx),
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
        start_method="forkserver",
        grace_period=ctx.float_param("grace"),
    ) as pc:
        await wait_ready_async(str(ctx.workdir / "armed"), 1)
        result = await pc.wait()
        done = now_ns()
    check_failure(result, "aioelastic")
    return _outcome(ctx, done)


def _torch_elastic(
    ctx: RepContext, entrypoint: Any, args: dict[int, tuple[Any, ...]], **kwargs: Any
) -> dict[str, float]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    pc = start_processes(
        name=NAME,
        entrypoint=entrypoint,
        args=args,
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx)),
        **kwargs,
    )
    pids = list(pc.pids().values())
    try:
        wait_ready(ctx.workdir / "armed", 1)
        with Watchdog(ctx.float_param("limit"), lambda: pids):
            result = pc.wait()
            done = now_ns()
    finally:
        pc.close()
    check_failure(result, "torch.elastic")
    return _outcome(ctx, done)


def torch_elastic_bin(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic: binary workers, default wait()."""
    return _torch_elastic(ctx, _bin.executable(), _bin_args(ctx))


def torch_elastic_fn(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic: function workers (fork server), default wait()."""
    from benchmarks.programs import _fn_light

    preload_torch_if_asked(ctx)
    return _torch_elastic(ctx, _fn_light.fail_or_sleep, _fn_args(ctx), start_method="forkserver")


def torch_mp_fn(ctx: RepContext) -> dict[str, float]:
    """torch.multiprocessing: join(grace_period=grace) until it raises the failure."""
    mp = torch_mp()
    from benchmarks.programs import _fn_light

    preload_torch_if_asked(ctx)
    args = _fn_args(ctx)[0][1:]
    pc = mp.start_processes(
        _fn_light.fail_or_sleep, args=args, nprocs=ctx.n, join=False, start_method="forkserver"
    )
    assert pc is not None
    pids = list(pc.pids())
    # join's grace_period is torch.mp's knob for SIGTERM-ignoring workers; with None (its
    # default) it sends SIGTERM at once, which is what the cooperative case wants.
    grace = ctx.float_param("grace") if ctx.params["ignore_term"] else None
    done = None
    wait_ready(ctx.workdir / "armed", 1)
    with Watchdog(ctx.float_param("limit"), lambda: pids):
        try:
            while not pc.join(grace_period=grace):
                pass
        except mp.ProcessExitedException:
            done = now_ns()
    if done is None:
        raise RuntimeError("torch.mp: expected a failed run")
    return _outcome(ctx, done)


def _close_args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    fifo = make_fifo(ctx.workdir / "ready")
    return {r: _bin.argv("sleep", fifo, 1) for r in range(ctx.n)}


async def aio_close_bin(ctx: RepContext) -> dict[str, float]:
    """aioelastic: close(grace_period=grace) of N running SIGTERM-ignoring binaries."""
    core = aio_core()
    grace = ctx.float_param("grace")
    async with core.start_processes(
        name=NAME,
        entrypoint=_bin.executable(),
        args=_close_args(ctx),
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
    ) as pc:
        await wait_ready_async(str(ctx.workdir / "ready"), ctx.n)
        start = now_ns()
        await pc.close(grace_period=grace)
        elapsed = seconds(now_ns() - start)
    return {"seconds": elapsed, "beyond_grace": elapsed - grace}


def torch_elastic_close_bin(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic: close(timeout=grace) of N running SIGTERM-ignoring binaries."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    grace = ctx.float_param("grace")
    pc = start_processes(
        name=NAME,
        entrypoint=_bin.executable(),
        args=_close_args(ctx),
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx)),
    )
    try:
        wait_ready(ctx.workdir / "ready", ctx.n)
        start = now_ns()
        pc.close(timeout=grace)  # type: ignore[arg-type]  # annotated int, any number works
        elapsed = seconds(now_ns() - start)
    finally:
        pc.close()
    return {"seconds": elapsed, "beyond_grace": elapsed - grace}
