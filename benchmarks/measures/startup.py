"""a. Startup: from the call that starts N workers to the last of them running user code.

Function workers live in a module that imports torch (:mod:`benchmarks.programs._fn_torch`), as a
training script's do; each stamps the clock as its first line. Binary workers are
``python -S -c`` stamping the clock (:mod:`benchmarks.programs._bin`). The clock starts right before
the start call, after every import the supervisor itself needs.

The fork-server variants run after a warm-up repetition, so their server is already up
(and, with the preload, has torch imported): that is the steady state of a long-lived
supervisor and of every restart; the warm-up's cold number is kept in the JSON.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness._spec import (
    SECONDS,
    Claim,
    Group,
    Kind,
    Measure,
    Params,
    RepContext,
    Row,
    System,
)
from benchmarks.measures._common import (
    NAME,
    aio_core,
    check_success,
    envs_for,
    log_dir,
    set_stdlib_forkserver_preload,
    torch_mp,
)
from benchmarks.measures._systems import binary_pair, binary_row
from benchmarks.programs import _bin
from benchmarks.programs._clock import now_ns, read_stamps, seconds

PRELOAD = ("torch",)
#: What a knowledgeable user preloads: torch and the worker's own module; torch's side also
#: the module of its elastic wrapper that every worker runs (``_wrap``).
OURS_FULL = ("torch", "benchmarks.programs._fn_torch")
TORCH_FULL = (*OURS_FULL, "torch.distributed.elastic.multiprocessing.api")


def _preload(ctx: RepContext, full: tuple[str, ...]) -> tuple[str, ...]:
    value = ctx.params.get("preload")
    if value == "full":
        return full
    return PRELOAD if value else ()


def _stop_our_fork_server(preload: tuple[str, ...]) -> None:
    # Cold: the next start pays for the server's interpreter and its imports again.
    # stop() waits for the old server's exit, as the stdlib's _stop() does on torch's
    # side: with close() it would still be exiting during the timed start.
    from aioelastic._core.start import _forkserver

    _forkserver.fork_server(preload).stop()
    _forkserver.servers().pop(preload, None)


def _stop_stdlib_fork_server() -> None:
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # type: ignore[attr-defined]


def _elapsed(ctx: RepContext, start: int) -> dict[str, float]:
    return {"seconds": seconds(max(read_stamps(ctx.workdir, "start", ctx.n)) - start)}


def _fn_args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    return {r: (r, str(ctx.workdir)) for r in range(ctx.n)}


async def aio_fn(ctx: RepContext) -> dict[str, float]:
    """aioelastic start_processes with a torch-importing function."""
    core = aio_core()
    from benchmarks.programs import _fn_torch

    preload = _preload(ctx, OURS_FULL)
    if ctx.params.get("cold"):
        _stop_our_fork_server(preload)
    start = now_ns()
    async with core.start_processes(
        name=NAME,
        entrypoint=_fn_torch.stamp,
        args=_fn_args(ctx),
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
        start_method=ctx.str_param("start_method"),
        forkserver_preload=preload,
    ) as pc:
        result = await pc.wait()
    check_success(result, "aioelastic")
    return _elapsed(ctx, start)


def torch_elastic_fn(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic start_processes with a torch-importing function."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from benchmarks.programs import _fn_torch

    if ctx.params.get("preload"):
        set_stdlib_forkserver_preload(list(_preload(ctx, TORCH_FULL)))
    if ctx.params.get("cold"):
        _stop_stdlib_fork_server()
    start = now_ns()
    pc = start_processes(
        name=NAME,
        entrypoint=_fn_torch.stamp,
        args=_fn_args(ctx),
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx)),
        start_method=ctx.str_param("start_method"),
    )
    try:
        # Not timed: a short period only makes the repetitions go faster.
        result = pc.wait(period=0.02)
    finally:
        pc.close()
    check_success(result, "torch.elastic")
    return _elapsed(ctx, start)


def torch_mp_fn(ctx: RepContext) -> dict[str, float]:
    """torch.multiprocessing.start_processes with a torch-importing function."""
    mp = torch_mp()
    from benchmarks.programs import _fn_torch

    if ctx.params.get("preload"):
        set_stdlib_forkserver_preload(list(PRELOAD))
    start = now_ns()
    mp.start_processes(
        _fn_torch.stamp,
        args=(str(ctx.workdir),),
        nprocs=ctx.n,
        join=True,
        start_method=ctx.str_param("start_method"),
    )
    return _elapsed(ctx, start)


def _bin_args(ctx: RepContext) -> dict[int, tuple[Any, ...]]:
    return {r: _bin.argv("stamp", ctx.workdir / f"start{r}") for r in range(ctx.n)}


async def aio_bin(ctx: RepContext) -> dict[str, float]:
    """aioelastic start_processes with ``python -S`` binaries."""
    core = aio_core()
    start = now_ns()
    async with core.start_processes(
        name=NAME,
        entrypoint=_bin.executable(),
        args=_bin_args(ctx),
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
    ) as pc:
        result = await pc.wait()
    check_success(result, "aioelastic")
    return _elapsed(ctx, start)


def torch_elastic_bin(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic start_processes with ``python -S`` binaries."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    start = now_ns()
    pc = start_processes(
        name=NAME,
        entrypoint=_bin.executable(),
        args=_bin_args(ctx),
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx)),
    )
    try:
        result = pc.wait(period=0.02)
    finally:
        pc.close()
    check_success(result, "torch.elastic")
    return _elapsed(ctx, start)


_M = "benchmarks.measures.startup"
_AIO, _EL, _MP = "aioelastic", "torch.elastic", "torch.mp"
_SPAWN: Params = {"start_method": "spawn"}
_FS: Params = {"start_method": "forkserver"}
_FSP: Params = {"start_method": "forkserver", "preload": True}
_FULL: Params = {"start_method": "forkserver", "preload": "full"}
_FULL_COLD: Params = {**_FULL, "cold": True}
_OURS_FULL = "aioelastic/forkserver+preload(torch, worker module)"
_TORCH_FULL = "torch.elastic/stdlib forkserver+preload(torch, worker module, elastic wrapper)"

# Costs on 2 cores: every spawned (or un-preloaded fork-server) worker imports torch,
# about 1 s of wall time per worker once the cores are busy, so 32 such workers take
# ~35 s per repetition. Hence: the un-preloaded fork server (which costs what spawn
# costs) only up to N=4 with 2 repetitions, torch.multiprocessing spawn up to 8 (it
# costs what torch.distributed.elastic's spawn costs), and few repetitions at N >= 16
# (see _REPS); the preloaded fork servers are cheap: 5 repetitions at every N.
_REPS = {1: 3, 2: 3, 4: 3, 8: 3, 16: 2, 32: 1}
_CHEAP = {n: 5 for n in (1, 2, 4, 8, 16, 32)}
_FEW = {1: 2, 2: 2, 4: 2}


def _fn(family: str, variant: str, params: Params, **kwargs: Any) -> System:
    # Own driver processes: these import torch in the supervisor (the worker module does)
    # and, for torch's fork server, set a preload list; other measures' systems with the
    # same label run in processes that must not have either.
    impl = {_AIO: "aio_fn", _EL: "torch_elastic_fn", _MP: "torch_mp_fn"}[family]
    kind: Kind = "aioelastic" if family == _AIO else "torch"
    label = f"{family}/{variant}"
    return System(label, kind, f"{_M}:{impl}", params, driver=f"startup-fn {label}", **kwargs)


def _fair(label: str, impl: str, params: Params, state: str) -> System:
    # One driver per system: cold repetitions stop the server that warm ones keep. A cold
    # repetition imports torch in a new server (seconds): 3 of them, N <= 8, not in --quick.
    kind: Kind = "aioelastic" if label.startswith(_AIO) else "torch"
    full = f"{label} {state}"
    if state == "cold":
        return System(
            full,
            kind,
            f"{_M}:{impl}",
            params,
            max_n=8,
            quick=False,
            reps={n: 3 for n in (1, 2, 4, 8)},
            driver=f"startup-fn {full}",
        )
    return System(full, kind, f"{_M}:{impl}", params, reps=_CHEAP, driver=f"startup-fn {full}")


MEASURE = Measure(
    name="startup",
    letter="a",
    title="call to all N workers running user code",
    metrics=(SECONDS,),
    notes=(
        "fn: function workers whose module imports torch. forkserver+preload: aioelastic's "
        "`forkserver_preload=('torch',)`; torch's side uses the stdlib "
        "`multiprocessing.set_forkserver_preload(['torch'])` (torch has no parameter for it). "
        "Fork servers are warm (one warm-up repetition first); a warm aioelastic server "
        "keeps as many spare workers, forked ahead while it is idle (between repetitions), "
        "as the group it last started, and hands the next start's requests to them. The "
        "fair rows: both sides "
        "preload torch and the worker's module (torch also its elastic wrapper's module), "
        "warm against warm and cold (server stopped before each repetition, untimed) "
        "against cold. bin: `python -S -c` binaries."
    ),
    groups=(
        Group(
            name="fn",
            systems=(
                _fair(_OURS_FULL, "aio_fn", _FULL, "warm"),
                _fair(_TORCH_FULL, "torch_elastic_fn", _FULL, "warm"),
                _fair(_OURS_FULL, "aio_fn", _FULL_COLD, "cold"),
                _fair(_TORCH_FULL, "torch_elastic_fn", _FULL_COLD, "cold"),
                _fn(_AIO, "spawn", _SPAWN),
                _fn(_EL, "spawn", _SPAWN),
                _fn(_MP, "spawn", _SPAWN, max_n=8, quick=False),
                _fn(_AIO, "forkserver", _FS, max_n=4, quick=False, reps=_FEW),
                _fn(_EL, "forkserver", _FS, max_n=4, quick=False, reps=_FEW),
                _fn(_MP, "forkserver", _FS, max_n=4, quick=False, reps=_FEW),
                _fn(_AIO, "forkserver+preload", _FSP, reps=_CHEAP),
                _fn(_EL, "forkserver+preload", _FSP, reps=_CHEAP),
                _fn(_MP, "forkserver+preload", _FSP, reps=_CHEAP, quick=False),
            ),
            rows=(
                Row(
                    "fn fair: full preload, warm vs warm",
                    f"{_OURS_FULL} warm",
                    f"{_TORCH_FULL} warm",
                    # Target: 1.5x. A quick run at a load average of 5-6: 5.35x.
                    quick_min_ratio=Claim(1, recorded=7.04, target=1.5),
                    headline_n=8,
                ),
                Row(
                    "fn fair: full preload, cold vs cold",
                    f"{_OURS_FULL} cold",
                    f"{_TORCH_FULL} cold",
                    headline_n=8,
                ),
                Row("fn spawn", f"{_AIO}/spawn", f"{_EL}/spawn"),
                Row("fn spawn", f"{_AIO}/spawn", f"{_MP}/spawn"),
                Row("fn forkserver", f"{_AIO}/forkserver", f"{_EL}/forkserver"),
                Row("fn forkserver", f"{_AIO}/forkserver", f"{_MP}/forkserver"),
                Row(
                    "fn forkserver+preload",
                    f"{_AIO}/forkserver+preload",
                    f"{_EL}/forkserver+preload",
                ),
                Row(
                    "fn forkserver+preload",
                    f"{_AIO}/forkserver+preload",
                    f"{_MP}/forkserver+preload",
                ),
                Row(
                    "fn ours forkserver+preload vs torch-defaults spawn",
                    f"{_AIO}/forkserver+preload",
                    f"{_EL}/spawn",
                    headline_n=8,
                ),
            ),
            ns=(1, 2, 4, 8, 16, 32),
            quick_ns=(1,),
            reps=_REPS,
            # The "warm" rows are warm only after a warm-up repetition: without it --quick
            # measured two cold servers and printed them as warm.
            quick_warmup=True,
        ),
        Group(
            name="bin",
            systems=binary_pair(_M),
            rows=(binary_row("bin python -S"),),
            ns=(1, 2, 4, 8, 16, 32),
            quick_ns=(1, 2),
            default_reps=5,
        ),
    ),
)
