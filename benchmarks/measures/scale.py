"""j. Scale: what each worker costs the supervisor as N grows, and many groups in one loop.

- *cost*: N x ``python -S -c pass`` from a supervisor that imported torch, start call to
  every exit seen, per worker: aioelastic ``run_processes``; torch ``start_processes`` +
  ``wait(period=0.01)``; the floor ``posix_spawn`` + ``waitpid``. (``binary`` (i) does the
  same with ``/bin/true``.)
- *memory*: the supervisor tree's memory per running worker (see
  :mod:`benchmarks.programs._scale_mem`), N x ``/bin/sleep``, each sample in a fresh supervisor.
- *groups*: K = N/4 groups of 4 ``/bin/true`` at once, to the last group's result: ours, K
  ``start_processes`` contexts in one anyio task group; torch's API is synchronous, so K
  threads each run ``start_processes`` + ``wait(period=0.01)``; the floor, N
  ``posix_spawn`` + ``waitpid``.
- *lateness*: how late a task sleeping 1 ms at a time wakes, worst case, while one group of
  N ``/bin/sh`` workers starts and tees 10 lines each (stdout and stderr) to the
  supervisor's console. No torch equivalent (its API blocks the caller).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks.harness._spec import SECONDS, Group, Measure, Metric, RepContext, Row, System
from benchmarks.measures._common import NAME, aio_core, aio_std, check_success, envs_for, log_dir
from benchmarks.measures.binary import PER_WORKER, _torch_loaded
from benchmarks.programs._clock import now_ns, seconds

TRUE = "/bin/true"
KB_PER_WORKER = Metric("kb_per_worker", "kB per worker")
LATENESS = Metric("lateness", "ms worst loop lateness", scale=1000.0)
#: What a tee'd worker of the lateness group runs: 10 lines on each stream.
_CHATTY = 'for i in 0 1 2 3 4 5 6 7 8 9; do echo "out $i"; echo "err $i" >&2; done'


def _python_s() -> list[str]:
    return [sys.executable, "-S", "-c", "pass"]


def _metrics(n: int, elapsed_ns: int) -> dict[str, float]:
    return {"seconds": seconds(elapsed_ns), "per_worker": seconds(elapsed_ns) / n}


def _spawn_all(argv: list[str], n: int) -> None:
    env = dict(os.environ)
    pids = [os.posix_spawn(argv[0], argv, env) for _ in range(n)]
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"{argv} exited with status {status}")


def floor_python(ctx: RepContext) -> dict[str, float]:
    """N x posix_spawn of ``python -S -c pass`` from a torch-loaded process, to the last reap."""
    _torch_loaded()
    start = now_ns()
    _spawn_all(_python_s(), ctx.n)
    return _metrics(ctx.n, now_ns() - start)


def floor_true(ctx: RepContext) -> dict[str, float]:
    """N x posix_spawn of /bin/true from a torch-loaded process, to the last reap."""
    _torch_loaded()
    start = now_ns()
    _spawn_all([TRUE], ctx.n)
    return _metrics(ctx.n, now_ns() - start)


async def aio_python(ctx: RepContext) -> dict[str, float]:
    """aioelastic ``run_processes`` of N ``python -S -c pass``."""
    _torch_loaded()
    core = aio_core()
    argv = _python_s()
    start = now_ns()
    result = await core.run_processes(
        name=NAME,
        entrypoint=argv[0],
        args={r: tuple(argv[1:]) for r in range(ctx.n)},
        envs=envs_for(ctx.n),
        log_dir=log_dir(ctx),
    )
    elapsed = now_ns() - start
    check_success(result, "aioelastic")
    return _metrics(ctx.n, elapsed)


def _torch_run(argv: list[str], n: int, directory: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    pc = start_processes(
        name=NAME,
        entrypoint=argv[0],
        args={r: tuple(argv[1:]) for r in range(n)},
        envs=envs_for(n),
        logs_specs=DefaultLogsSpecs(log_dir=directory),
    )
    try:
        return pc.wait(period=0.01)
    finally:
        pc.close()


def torch_python(ctx: RepContext) -> dict[str, float]:
    """torch ``start_processes`` + ``wait(period=0.01)`` of N ``python -S -c pass``."""
    _torch_loaded()
    start = now_ns()
    result = _torch_run(_python_s(), ctx.n, log_dir(ctx))
    elapsed = now_ns() - start
    check_success(result, "torch.elastic")
    return _metrics(ctx.n, elapsed)


#: The program that takes one memory sample in a fresh supervisor.
_SCALE_MEM = "benchmarks.programs._scale_mem"


def _fresh_supervisor(ctx: RepContext, side: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", _SCALE_MEM, side, str(ctx.n), str(ctx.workdir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{_SCALE_MEM} {side} exited {out.returncode}:\n{out.stderr}")
    sample: dict[str, float] = json.loads(out.stdout.splitlines()[-1])
    return sample


def aio_memory(ctx: RepContext) -> dict[str, float]:
    """Memory per worker of a fresh aioelastic supervisor (and its watchdog)."""
    aio_core()  # n/a rather than an error if the package is missing
    return _fresh_supervisor(ctx, "aioelastic")


def torch_memory(ctx: RepContext) -> dict[str, float]:
    """Memory per worker of a fresh torch ``start_processes`` supervisor."""
    return _fresh_supervisor(ctx, "torch")


async def aio_groups(ctx: RepContext) -> dict[str, float]:
    """K = N/size ``start_processes`` groups of /bin/true side by side in one task group."""
    import anyio

    _torch_loaded()
    core = aio_core()
    size = ctx.int_param("group_size")
    failed: list[int] = []

    async def one(k: int) -> None:
        async with core.start_processes(
            name=NAME,
            entrypoint=TRUE,
            args={r: () for r in range(size)},
            envs=envs_for(size),
            log_dir=ctx.workdir / f"g{k}",
        ) as pc:
            result = await pc.wait()
        if result is None or result.is_failed():
            failed.append(k)

    start = now_ns()
    async with anyio.create_task_group() as tg:
        for k in range(_groups(ctx)):
            tg.start_soon(one, k)
    elapsed = now_ns() - start
    if failed:
        raise RuntimeError(f"aioelastic: groups {failed} failed")
    return _metrics(ctx.n, elapsed)


def torch_groups(ctx: RepContext) -> dict[str, float]:
    """K threads, each running ``start_processes`` + ``wait(period=0.01)`` of one group."""
    _torch_loaded()
    size = ctx.int_param("group_size")
    errors: list[BaseException] = []

    def one(k: int) -> None:
        try:
            check_success(_torch_run([TRUE], size, str(ctx.workdir / f"g{k}")), "torch")
        except BaseException as exc:  # reported after the join, with its group
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(_groups(ctx))]
    start = now_ns()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = now_ns() - start
    if errors:
        raise RuntimeError(f"torch.elastic: {len(errors)} groups failed") from errors[0]
    return _metrics(ctx.n, elapsed)


def _groups(ctx: RepContext) -> int:
    size = ctx.int_param("group_size")
    if ctx.n % size:
        raise ValueError(f"N={ctx.n} is not a multiple of the group size {size}; pick --ns so")
    return ctx.n // size


async def aio_lateness(ctx: RepContext) -> dict[str, float]:
    """Worst wake-up lateness of a 1 ms sleeper while N tee'd workers start and print."""
    import anyio

    core = aio_core()
    std = aio_std()
    worst = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            before = time.monotonic()
            await anyio.sleep(0.001)
            worst = max(worst, time.monotonic() - before - 0.001)

    start = now_ns()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        # The ticker's first sleep is under way before the start call.
        await anyio.sleep(0)
        try:
            result = await core.run_processes(
                name=NAME,
                entrypoint="/bin/sh",
                args={r: ("-c", _CHATTY) for r in range(ctx.n)},
                envs=envs_for(ctx.n),
                log_dir=log_dir(ctx),
                tee=std.ALL,
            )
        finally:
            done.set()
    elapsed = now_ns() - start
    check_success(result, "aioelastic")
    return {"lateness": worst, "seconds": seconds(elapsed)}


_M = "benchmarks.measures.scale"
FLOOR = "floor/posix_spawn (torch loaded)"
OURS = "aioelastic/binary (torch loaded)"
TORCH = "torch.elastic/binary wait(period=0.01) (torch loaded)"
TORCH_THREADS = "torch.elastic/binary, a thread per group, wait(period=0.01) (torch loaded)"
OURS_TASKS = "aioelastic/binary, a task per group (torch loaded)"
OURS_MEM = "aioelastic (fresh supervisor + watchdog)"
TORCH_MEM = "torch.elastic (fresh supervisor)"
OURS_TEE = "aioelastic/binary, tee (no torch equivalent)"

# The drivers are binary's: same imports (torch), same state.
_DRIVERS = {"floor": "binary floor", "ours": "binary aioelastic", "torch": "binary torch"}

MEASURE = Measure(
    name="scale",
    letter="j",
    title="per-worker cost and memory as N grows; many groups in one event loop",
    metrics=(PER_WORKER, SECONDS, KB_PER_WORKER, LATENESS),
    notes=(
        "Every system runs in a driver that imported torch. cost: N x `python -S -c pass`, "
        "call to every exit seen (per_worker = total / N); torch: `start_processes` + "
        "`wait(period=0.01)`; floor: `os.posix_spawn` + `waitpid`. memory: a fresh supervisor "
        "(torch imported) per sample, N x `/bin/sleep` running; the growth of the summed "
        "VmRSS of the supervisor and its non-worker descendants (our watchdog) over a warm "
        "1-worker baseline, per worker. groups: N/4 groups of 4 `/bin/true` at once (ours: one "
        "`start_processes` per group in one anyio task group; torch: a thread per group). "
        "lateness: worst wake-up delay of a task sleeping 1 ms at a time while one group of N "
        "`/bin/sh` workers starts and tees 10 lines per stream (target < 10 ms; torch has no "
        "equivalent: its API blocks the caller)."
    ),
    groups=(
        Group(
            name="cost",
            systems=(
                System(FLOOR, "floor", f"{_M}:floor_python", driver=_DRIVERS["floor"]),
                System(OURS, "aioelastic", f"{_M}:aio_python", driver=_DRIVERS["ours"]),
                System(TORCH, "torch", f"{_M}:torch_python", driver=_DRIVERS["torch"]),
            ),
            rows=(
                Row("python -S", OURS, TORCH),
                Row("python -S vs floor", OURS, FLOOR),
            ),
            ns=(8, 32, 128, 256),
            quick_ns=(8,),
            # A python -S start costs ~10 ms of CPU: 256 of them ~3 s on 2 cores.
            reps={8: 5, 32: 3},
            default_reps=2,
            rep_timeout=120.0,
        ),
        Group(
            name="memory",
            systems=(
                System(OURS_MEM, "aioelastic", f"{_M}:aio_memory", driver=_DRIVERS["ours"]),
                System(TORCH_MEM, "torch", f"{_M}:torch_memory", driver=_DRIVERS["torch"]),
            ),
            rows=(Row("/bin/sleep running", OURS_MEM, TORCH_MEM),),
            ns=(8, 32, 128, 256),
            quick_ns=(8,),
            # Each sample starts a fresh interpreter (torch's imports torch: ~1.5 s).
            default_reps=2,
            warmup=False,
            rep_timeout=150.0,
        ),
        Group(
            name="groups",
            systems=(
                System(FLOOR, "floor", f"{_M}:floor_true", driver=_DRIVERS["floor"]),
                System(OURS_TASKS, "aioelastic", f"{_M}:aio_groups", driver=_DRIVERS["ours"]),
                System(TORCH_THREADS, "torch", f"{_M}:torch_groups", driver=_DRIVERS["torch"]),
            ),
            rows=(
                Row("groups of 4 /bin/true at once", OURS_TASKS, TORCH_THREADS),
                Row("groups of 4 /bin/true at once vs floor", OURS_TASKS, FLOOR),
            ),
            ns=(256,),
            quick_ns=(16,),
            default_reps=3,
            params={"group_size": 4},
            rep_timeout=120.0,
        ),
        Group(
            name="lateness",
            systems=(
                System(OURS_TEE, "aioelastic", f"{_M}:aio_lateness", driver=_DRIVERS["ours"]),
            ),
            rows=(Row("N /bin/sh workers start and tee (target < 10 ms)", OURS_TEE),),
            ns=(256,),
            quick_ns=(16,),
            default_reps=3,
            rep_timeout=120.0,
        ),
    ),
)
