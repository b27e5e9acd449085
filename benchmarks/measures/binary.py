"""i. Binary workers from a supervisor that imported torch, against the floor.

Every real training controller has torch imported, and a supervisor that forks itself
to start a binary pays for its whole address space: this measure runs every system in a
driver that imported torch first. One repetition: N x ``/bin/true``, from the start call
until the caller has every exit. ``per_worker`` is that time divided by N.

- floor: ``os.posix_spawn`` (vfork+exec) N times, then ``waitpid`` each, in a
  torch-loaded process: no supervisor at all.
- aioelastic: ``run_processes``.
- torch.elastic, period=0.01: ``start_processes`` + ``wait(period=0.01)``, the setting a
  user who cares about latency picks; torch-defaults: ``wait()`` (period 1 s).

Group ``bin tee``: the same job with both streams of every worker tee'd (``tee=3``: to a
log file each and to the console, line by line with the rank's prefix), on both sides
configured alike, torch at ``wait(period=0.01)``. Ours by default already reads every
worker's output (to keep each line whole at the console); torch reads it only when told
to, with a thread tailing each log file.
"""

from __future__ import annotations

import os

from benchmarks.harness._spec import (
    SECONDS,
    Claim,
    Group,
    Measure,
    Metric,
    RepContext,
    Row,
    System,
)
from benchmarks.measures._common import (
    NAME,
    aio_core,
    aio_std,
    check_success,
    envs_for,
    log_dir,
)
from benchmarks.programs._clock import now_ns, seconds

TRUE = "/bin/true"
PER_WORKER = Metric("per_worker", "ms", scale=1000.0)


def _torch_loaded() -> None:
    import torch

    assert torch.__version__  # the import is the point: the supervisor's image holds torch


def _metrics(ctx: RepContext, elapsed_ns: int) -> dict[str, float]:
    return {"seconds": seconds(elapsed_ns), "per_worker": seconds(elapsed_ns) / ctx.n}


def spawn_and_reap(n: int, env: dict[str, str]) -> None:
    """The floor's work: ``os.posix_spawn`` of /bin/true ``n`` times, then ``waitpid`` each."""
    argv = [TRUE]
    pids = [os.posix_spawn(TRUE, argv, env) for _ in range(n)]
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"{TRUE} exited with status {status}")


def floor_spawn(ctx: RepContext) -> dict[str, float]:
    """N x posix_spawn of /bin/true from a torch-loaded process, to the last exit reaped."""
    _torch_loaded()
    env = dict(os.environ)
    start = now_ns()
    spawn_and_reap(ctx.n, env)
    return _metrics(ctx, now_ns() - start)


async def aio_bin(ctx: RepContext) -> dict[str, float]:
    """aioelastic run_processes of N /bin/true from a torch-loaded process."""
    _torch_loaded()
    core = aio_core()
    tee = aio_std().ALL if ctx.params.get("tee") == "all" else aio_std().NONE
    start = now_ns()
    result = await core.run_processes(
        name=NAME,
        entrypoint=TRUE,
        args={r: () for r in range(ctx.n)},
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
        tee=tee,
    )
    elapsed = now_ns() - start
    check_success(result, "aioelastic")
    return _metrics(ctx, elapsed)


def torch_bin(ctx: RepContext) -> dict[str, float]:
    """torch.distributed.elastic start_processes + wait(period) of N /bin/true."""
    _torch_loaded()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    period = ctx.params.get("period")
    tee = Std.ALL if ctx.params.get("tee") == "all" else Std.NONE
    start = now_ns()
    pc = start_processes(
        name=NAME,
        entrypoint=TRUE,
        args={r: () for r in range(ctx.n)},
        envs=envs_for(ctx.n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir(ctx), tee=tee),
    )
    try:
        result = pc.wait() if period is None else pc.wait(period=float(period))
    finally:
        pc.close()
    elapsed = now_ns() - start
    check_success(result, "torch.elastic")
    return _metrics(ctx, elapsed)


_M = "benchmarks.measures.binary"
FLOOR = "floor/posix_spawn (torch loaded)"
OURS = "aioelastic/binary (torch loaded)"
TORCH_FAST = "torch.elastic/binary wait(period=0.01) (torch loaded)"
TORCH_DEFAULT = "torch.elastic/binary torch-defaults wait() period=1 (torch loaded)"
OURS_TEE = "aioelastic/binary tee=3 (torch loaded)"
TORCH_TEE = "torch.elastic/binary tee=3 wait(period=0.01) (torch loaded)"

MEASURE = Measure(
    name="binary",
    letter="i",
    title="N x /bin/true from a torch-loaded supervisor, call to every exit seen",
    metrics=(PER_WORKER, SECONDS),
    notes=(
        "Every system runs in a driver that imported torch. floor: `os.posix_spawn` + "
        "`waitpid`, no supervisor. torch.elastic: `start_processes` + `wait(period=0.01)`; "
        "torch-defaults: `wait()` (period 1 s). per_worker = total / N. A ratio vs the "
        "floor of 0.5 is the target (ours at most 2x the floor). bin tee: both streams of "
        "every worker tee'd (`tee=3`, log files and prefixed console lines) on both sides, "
        "torch at `wait(period=0.01)`."
    ),
    groups=(
        Group(
            name="bin",
            systems=(
                System(FLOOR, "floor", f"{_M}:floor_spawn", driver="binary floor"),
                System(OURS, "aioelastic", f"{_M}:aio_bin", driver="binary aioelastic"),
                System(
                    TORCH_FAST,
                    "torch",
                    f"{_M}:torch_bin",
                    {"period": 0.01},
                    driver="binary torch",
                ),
                System(
                    TORCH_DEFAULT,
                    "torch",
                    f"{_M}:torch_bin",
                    quick=False,
                    max_n=64,
                    reps={8: 3, 64: 3},
                    driver="binary torch",
                ),
            ),
            rows=(
                Row(
                    "bin, torch period=0.01",
                    OURS,
                    TORCH_FAST,
                    # Target: ahead of torch (quick runs at a load average of 4-7: 1.27x,
                    # 1.43x).
                    quick_min_ratio=Claim(8, recorded=1.96, target=1.0),
                    headline_n=8,
                ),
                Row("bin, torch-defaults", OURS, TORCH_DEFAULT, headline_n=8),
                Row(
                    "bin vs floor (target >= 0.5)",
                    OURS,
                    FLOOR,
                    # Under load the floor, a bare posix_spawn loop, loses less than our
                    # supervisor and its watchdog: quick runs at a load average of 4-7 gave
                    # 0.38 and 0.43, below the recorded 0.60 / 1.5.
                    quick_min_ratio=Claim(8, recorded=0.602, target=0.5, loaded=0.3),
                    headline_n=256,
                ),
            ),
            ns=(8, 32, 64, 128, 256),
            # --quick checks the 8-binary job (the claim against torch); flatness up to
            # N=256 is for the full run.
            quick_ns=(8,),
            # A repetition costs 5-250 ms; a side's repetitions spread by +-20% on this
            # shared 2-core machine, and the median of five moved with it.
            default_reps=9,
            quick_reps=9,
            quick_warmup=True,  # the first start of a supervisor also starts its watchdog
        ),
        Group(
            name="bin tee",
            systems=(
                System(OURS_TEE, "aioelastic", f"{_M}:aio_bin", driver="binary aioelastic"),
                System(
                    TORCH_TEE, "torch", f"{_M}:torch_bin", {"period": 0.01}, driver="binary torch"
                ),
            ),
            rows=(
                Row(
                    "bin tee=3 both, torch period=0.01",
                    OURS_TEE,
                    TORCH_TEE,
                    # No target. Ours, 8 short workers whose output is tee'd, is what a
                    # loaded machine slows most (torch's side is its 0.1 s polling): quick
                    # runs at a load average of 4-7 gave 5.1x and 10.0x.
                    quick_min_ratio=Claim(8, recorded=27.8, loaded=3.0),
                    headline_n=256,
                ),
            ),
            ns=(8, 64, 256),
            quick_ns=(8,),
            params={"tee": "all"},
            # torch's tail threads poll each log file every 0.1 s: its repetitions spread
            # by a period, ours by +-20% as in bin.
            default_reps=7,
            quick_reps=5,
            quick_warmup=True,
        ),
    ),
)
