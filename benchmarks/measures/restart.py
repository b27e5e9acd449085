"""e. Agent restart: from a worker's failure to every worker of the next attempt in user code.

One single-node elastic job per repetition, through each side's ``elastic_launch`` (torch's
drives its ``LocalElasticAgent``): static rendezvous on 127.0.0.1, ``max_restarts=1``,
``monitor_interval=0.1`` (torchrun's default). Workers are functions whose module imports
torch (:func:`benchmarks.programs._fn_torch.restart`): on attempt 0, local rank 0 exits 1 once all
run (stamping the clock just before), the others sleep until stopped; on attempt 1 every
worker stamps the clock as its first line and returns.

The time covers: noticing the failure, stopping the siblings, the new rendezvous, and
starting N workers that import torch; with a preloaded fork server that import is already
done in the server, so a restart costs forks.
"""

from __future__ import annotations

import time

from benchmarks.harness._spec import (
    SECONDS,
    Claim,
    Group,
    Measure,
    Metric,
    Params,
    RepContext,
    Row,
    System,
)
from benchmarks.measures._common import aio, aio_core, set_stdlib_forkserver_preload
from benchmarks.programs._clock import now_ns, read_stamp, read_stamps, seconds
from benchmarks.programs._ready import make_fifo

PRELOAD = ("torch",)
#: What a knowledgeable torch user preloads: torch, the worker's own module and the module
#: of torch's elastic wrapper that every worker runs (``_wrap``).
FULL_PRELOAD = (
    "torch",
    "benchmarks.programs._fn_torch",
    "torch.distributed.elastic.multiprocessing.api",
)


def _preload(ctx: RepContext) -> tuple[str, ...]:
    value = ctx.params.get("preload")
    if value == "full":
        return FULL_PRELOAD
    return PRELOAD if value else ()


def _outcome(ctx: RepContext) -> dict[str, float]:
    failed = read_stamp(ctx.workdir / "fail")
    return {"seconds": seconds(max(read_stamps(ctx.workdir, "start", ctx.n)) - failed)}


def _common(ctx: RepContext) -> dict[str, object]:
    from aioelastic import free_port

    make_fifo(ctx.workdir / "ready")
    return {
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": ctx.n,
        "run_id": f"bench-{ctx.workdir.name}",
        "role": "bench",
        "rdzv_backend": "static",
        "rdzv_endpoint": f"127.0.0.1:{free_port()}",
        "rdzv_configs": {"rank": 0},
        "max_restarts": 1,
        "monitor_interval": float(ctx.params.get("monitor_interval", 0.1)),
        "start_method": ctx.str_param("start_method"),
    }


async def aio_agent(ctx: RepContext) -> dict[str, float]:
    """aioelastic's ``elastic_launch`` (its LocalElasticAgent), and where the time went.

    Besides the restart's total, the parts the agent's events mark: *detection* (the
    failing worker's stamp to its exit seen), *teardown* (to the group stopped and
    closed: the siblings' exits, the failure's report), *rendezvous* (the next round)
    and *start* (to the last worker of attempt 1 in user code). Then a *warm start* of
    the same N workers from the same fork server (its spares), and *vs_parts*: the
    restart over warm start + detection + teardown, what a restart cannot avoid.
    """
    import anyio

    launch = aio("aioelastic._elastic.launch._elastic_launch")
    from benchmarks.programs import _fn_torch

    # Our fork server imports only what it is asked to: torch's wrapper module is not ours.
    preload = tuple(m for m in _preload(ctx) if not m.startswith("torch.distributed"))
    config = launch.LaunchConfig(
        **_common(ctx), log_dir=str(ctx.workdir / "logs"), forkserver_preload=preload
    )
    job = launch.elastic_launch(config, _fn_torch.restart)
    events = job.events()
    # Events carry time.time(); the stamps CLOCK_MONOTONIC.
    offset_ns = now_ns() - time.time_ns()
    marks: dict[str, int] = {}

    async def note() -> None:
        async for event in events:
            if event.attempt == 1 or event.kind == "worker_failed":
                marks.setdefault(event.kind, int(event.timestamp * 1e9) + offset_ns)

    async with anyio.create_task_group() as tg:
        tg.start_soon(note)
        await job(str(ctx.workdir))
    sample = _outcome(ctx)
    if ctx.str_param("start_method") != "forkserver":
        return sample
    failed = read_stamp(ctx.workdir / "fail")
    seen, stopped = marks["worker_failed"], marks["group_restarting"]
    met = marks["rendezvous_completed"]
    started = max(read_stamps(ctx.workdir, "start", ctx.n))
    sample |= {
        "detection": seconds(seen - failed),
        "teardown": seconds(stopped - seen),
        "rendezvous": seconds(met - stopped),
        "start": seconds(started - met),
    }
    warm = await _warm_start(ctx, preload)
    sample["warm_start"] = warm
    sample["vs_parts"] = sample["seconds"] / (warm + sample["detection"] + sample["teardown"])
    return sample


async def _warm_start(ctx: RepContext, preload: tuple[str, ...]) -> float:
    """N workers of the restart's kind from the same warm fork server, to all in user code."""
    core = aio_core()
    from benchmarks.programs import _fn_torch

    directory = ctx.workdir / "warm"
    directory.mkdir()
    began = now_ns()
    result = await core.run_processes(
        name="warm",
        entrypoint=_fn_torch.stamp,
        args={r: (r, str(directory)) for r in range(ctx.n)},
        envs={r: {} for r in range(ctx.n)},
        log_dir=str(ctx.workdir / "warm-logs"),
        start_method="forkserver",
        forkserver_preload=preload,
    )
    if result.is_failed():
        raise RuntimeError(f"the warm start failed: {result.failures}")
    return seconds(max(read_stamps(directory, "start", ctx.n)) - began)


def torch_agent(ctx: RepContext) -> dict[str, float]:
    """torch's ``elastic_launch`` (its LocalElasticAgent)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from benchmarks.programs import _fn_torch

    if _preload(ctx):
        set_stdlib_forkserver_preload(list(_preload(ctx)))
    config = LaunchConfig(
        **_common(ctx),  # type: ignore[arg-type]
        logs_specs=DefaultLogsSpecs(log_dir=str(ctx.workdir / "logs")),
    )
    elastic_launch(config, _fn_torch.restart)(str(ctx.workdir))
    return _outcome(ctx)


#: Where a restart's time goes (ours, fork server): see aio_agent.
PARTS = (
    Metric("detection", "ms detection", scale=1000.0, ratio=False),
    Metric("teardown", "ms teardown", scale=1000.0, ratio=False),
    Metric("rendezvous", "ms rendezvous", scale=1000.0, ratio=False),
    Metric("start", "ms start", scale=1000.0, ratio=False),
    Metric("warm_start", "ms warm start of N", scale=1000.0, ratio=False),
    Metric("vs_parts", "x (warm start + detection + teardown)", ratio=False),
)

_M = "benchmarks.measures.restart"
_SPAWN: Params = {"start_method": "spawn"}
_FSP: Params = {"start_method": "forkserver", "preload": True}
_FULL: Params = {"start_method": "forkserver", "preload": "full", "monitor_interval": 0.01}
# Own driver names: the agent systems leave state (an imported worker module, a fork
# server with its preload list) that must not leak into other measures' systems.
# A spawn repetition starts N torch-importing workers twice (attempt 0 and 1): ~2N s of
# wall time on 2 cores, hence few repetitions and N <= 8; the preloaded ones are cheap.
_CHEAP = {1: 5, 4: 5, 8: 5, 16: 5}
#: The fair row's sides: a restart's time varies by +-10% from one to the next here.
_FAIR_REPS = {1: 9, 4: 9, 8: 9, 16: 9}
_SPAWN_REPS = {1: 3, 4: 3, 8: 2}

_OURS_FULL = "aioelastic/forkserver+preload(torch, worker module) monitor_interval=0.01"
_TORCH_FULL = (
    "torch.elastic/stdlib forkserver+preload(torch, worker module, elastic wrapper) "
    "monitor_interval=0.01"
)

MEASURE = Measure(
    name="restart",
    letter="e",
    title="agent restart: a worker's failure to all workers of the next attempt in user code",
    metrics=(SECONDS, *PARTS),
    notes=(
        "Single-node elastic_launch, static rendezvous, max_restarts=1, monitor_interval=0.1; "
        "workers import torch. forkserver+preload: aioelastic's `forkserver_preload=('torch',)`, "
        "torch's side the stdlib `set_forkserver_preload(['torch'])`. The fair row: both "
        "preload torch and the worker's module (torch also its elastic wrapper's module) and "
        "torch's agent polls every 0.01 s. Ours with a fork server also shows where the "
        "restart went: detection (failing worker's stamp to its exit seen), teardown (to the "
        "group stopped and closed), rendezvous, start (to the last worker in user code), a warm "
        "start of the same N from the same server, and vs_parts = restart / (warm start + "
        "detection + teardown) (target <= 1.3)."
    ),
    groups=(
        Group(
            name="agent",
            systems=(
                System(
                    "aioelastic/spawn",
                    "aioelastic",
                    f"{_M}:aio_agent",
                    _SPAWN,
                    max_n=8,
                    quick=False,
                    reps=_SPAWN_REPS,
                    driver="agent aioelastic/spawn",
                ),
                System(
                    "torch.elastic/spawn",
                    "torch",
                    f"{_M}:torch_agent",
                    _SPAWN,
                    max_n=8,
                    quick=False,
                    reps=_SPAWN_REPS,
                    driver="agent torch.elastic/spawn",
                ),
                System(
                    "aioelastic/forkserver+preload",
                    "aioelastic",
                    f"{_M}:aio_agent",
                    _FSP,
                    reps=_CHEAP,
                    quick=False,
                    driver="agent aioelastic/forkserver+preload",
                ),
                System(
                    _OURS_FULL,
                    "aioelastic",
                    f"{_M}:aio_agent",
                    _FULL,
                    reps=_FAIR_REPS,
                    driver="agent aioelastic/full-preload",
                ),
                System(
                    _TORCH_FULL,
                    "torch",
                    f"{_M}:torch_agent",
                    _FULL,
                    reps=_FAIR_REPS,
                    driver="agent torch.elastic/full-preload",
                ),
                System(
                    "torch.elastic/forkserver+preload",
                    "torch",
                    f"{_M}:torch_agent",
                    _FSP,
                    reps=_CHEAP,
                    quick=False,
                    driver="agent torch.elastic/forkserver+preload",
                ),
            ),
            rows=(
                Row(
                    "fair: full preload, monitor_interval=0.01",
                    _OURS_FULL,
                    _TORCH_FULL,
                    # Target: 2x at N=4 and 8 (issue 28). Quick runs: 3.1x and 4.7x, and
                    # 3.65x at a load average of 4-5.
                    quick_min_ratio=Claim(4, recorded=2.45, target=2.0),
                    headline_n=4,
                    metrics=tuple(m.name for m in (SECONDS, *PARTS) if m.name != "vs_parts"),
                ),
                Row(
                    "fair: restart over its unavoidable parts (target <= 1.3)",
                    _OURS_FULL,
                    metric="vs_parts",
                    metrics=("vs_parts",),
                    # A quick run at a load average of 4-5: 1.20.
                    quick_max=Claim(4, recorded=1.00, target=1.3),
                ),
                Row("spawn", "aioelastic/spawn", "torch.elastic/spawn", metrics=("seconds",)),
                Row(
                    "forkserver+preload",
                    "aioelastic/forkserver+preload",
                    "torch.elastic/forkserver+preload",
                    metrics=("seconds",),
                ),
                Row(
                    "ours forkserver+preload vs torch-defaults spawn",
                    "aioelastic/forkserver+preload",
                    "torch.elastic/spawn",
                    headline_n=4,
                    metrics=("seconds",),
                ),
            ),
            ns=(1, 4, 8, 16),
            # --quick checks the fair row: warm servers, 3 repetitions, N=4 (a restart
            # at N=1 is mostly rendezvous, the same on both sides).
            quick_ns=(4,),
            quick_reps=3,
            quick_warmup=True,
            default_reps=3,
            # The first elastic run in a process pays one-time imports and set-up inside
            # the restart (torch: about 2 s more); the warm-up keeps them out.
            warmup=True,
            rep_timeout=240.0,
        ),
    ),
)
