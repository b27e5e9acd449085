"""l. A burst of jobs in one event loop: how late the loop runs its timers while K start at once.

What a service sees when a queue drains: K ``start_processes`` groups entered at the same
instant in one anyio task group, each awaited to its end, while a task sleeping 5 ms at a
time measures how late it wakes (the worst case of the whole burst, from the first start
to the last group's end). Target: under 20 ms after the first start in the process.

- *binaries*: K groups of 2 ``/bin/sh`` workers (each prints a line and exits).
- *streamed*: the same, each worker printing 200 lines, every group read by its own
  ``ctx.output()`` subscriber (what a service streaming logs to its clients does).
- *functions*: K groups of 8 function workers (a no-op) from the warm fork server, which
  preloaded their module.
- *first start*: one group of 2 ``/bin/sh`` in a fresh process that imported
  ``aioelastic`` and nothing else of it: the lazy imports, the watchdog's start and the
  sweep of stale log roots fall in it (target: under 60 ms).

torch has no equivalent: its ``start_processes`` and ``wait`` block the caller.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

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
from benchmarks.programs import _fn_light
from benchmarks.programs._clock import seconds

LATENESS = Metric("lateness", "ms worst loop lateness", scale=1000.0)
#: The same lateness without the moments the loop's thread waited for a core (its run
#: delay in ``/proc/thread-self/schedstat``): the loop's own work and the system calls it
#: blocked in. Not its CPU time alone, which hid a loop blocked in ``sendmsg`` for 30-100 ms.
LOOP_HELD = Metric(
    "loop_held", "ms the loop held a due timer back (its work and blocking calls)", scale=1000.0
)
#: The ticker's period: a service's own timers (keep-alives, request deadlines).
TICK = 0.005
_LINES = 200


def _script(lines: int) -> str:
    if lines <= 1:
        return "echo one line"
    return f'i=0; while [ $i -lt {lines} ]; do echo "line $i"; i=$((i+1)); done'


def _run_delay() -> float:
    """Seconds this thread has waited for a core so far; 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def _measured(jobs: list[Callable[[], Awaitable[None]]]) -> dict[str, float]:
    """Run ``jobs`` at once beside a ticker; the ticker's worst lateness and the wall time."""
    import anyio

    worst = worst_held = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal worst, worst_held
        while not done.is_set():
            before, delay = time.monotonic(), _run_delay()
            await anyio.sleep(TICK)
            late = time.monotonic() - before - TICK
            worst = max(worst, late)
            worst_held = max(worst_held, late - (_run_delay() - delay))

    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker)
        await anyio.sleep(0)  # the ticker's first sleep is under way
        start = time.monotonic_ns()
        try:
            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(job)
        finally:
            done.set()
        elapsed = time.monotonic_ns() - start
    return {"lateness": worst, "loop_held": max(0.0, worst_held), "seconds": seconds(elapsed)}


def _group_jobs(ctx: RepContext, kind: str, lines: int, stream: bool) -> list[Any]:
    import aioelastic

    size = ctx.int_param("group_size")

    async def one(k: int) -> None:
        if kind == "binary":
            what: dict[str, Any] = {
                "entrypoint": "/bin/sh",
                "args": {r: ("-c", _script(lines)) for r in range(size)},
            }
        else:
            # The worker's module preloaded, as a knowledgeable user does: a worker then
            # imports nothing, and the burst measures starts, not imports.
            what = {
                "entrypoint": _fn_light.noop,
                "args": {r: (r, str(ctx.workdir)) for r in range(size)},
                "start_method": "forkserver",
                "forkserver_preload": ("benchmarks.programs._fn_light",),
            }
        async with aioelastic.start_processes(
            name=f"burst{k}",
            envs={r: {} for r in range(size)},
            log_dir=str(ctx.workdir / f"g{k}"),
            redirects=aioelastic.Std.ALL,
            **what,
        ) as pc:
            if stream:
                seen = 0
                async with pc.output() as items:
                    async for item in items:
                        seen += 1 + item.missed
                if seen != size * lines:
                    raise RuntimeError(f"group {k}: {seen} lines seen, {size * lines} written")
            result = await pc.wait()
        if result is None or result.is_failed():
            raise RuntimeError(f"group {k} failed: {result}")

    return [lambda k=k: one(k) for k in range(ctx.n)]


async def aio_binaries(ctx: RepContext) -> dict[str, float]:
    """K groups of /bin/sh workers at once (warm process)."""
    return await _measured(_group_jobs(ctx, "binary", 1, stream=False))


async def aio_streamed(ctx: RepContext) -> dict[str, float]:
    """K groups of /bin/sh workers printing 200 lines each, every group subscribed."""
    return await _measured(_group_jobs(ctx, "binary", _LINES, stream=True))


async def aio_functions(ctx: RepContext) -> dict[str, float]:
    """K groups of function workers from the warm fork server."""
    return await _measured(_group_jobs(ctx, "function", 1, stream=False))


def aio_first_start(ctx: RepContext) -> dict[str, float]:
    """K groups at once in a fresh process that imported only ``aioelastic``."""
    import compileall

    import aioelastic

    # As installed from a wheel, whose bytecode pip compiles at install: an editable
    # checkout (run with PYTHONDONTWRITEBYTECODE, as here) would compile every module at
    # its first import, inside the measured start.
    compileall.compile_dir(Path(aioelastic.__file__).parent, quiet=1)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.measures.burst", str(ctx.n), str(ctx.workdir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"first-start run failed ({out.returncode}): {out.stderr[-2000:]}")
    sample: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return sample


def _first_start_main(k: int, workdir: str) -> None:
    import asyncio
    from pathlib import Path

    import anyio

    import aioelastic  # noqa: F401  (what a service has imported: the package, not its parts)

    async def main() -> dict[str, float]:
        # The service's own loop and task groups exist already (anyio's backend loaded).
        async with anyio.create_task_group():
            pass
        ctx = RepContext(n=k, params={"group_size": 2}, workdir=Path(workdir), quick=False)
        return await _measured(_group_jobs(ctx, "binary", 1, stream=False))

    print(json.dumps(asyncio.run(main())))


_OURS_BIN = "aioelastic/binary, K groups of 2 /bin/sh at once (no torch equivalent)"
_OURS_STREAM = "aioelastic/binary, K groups of 2 /bin/sh x 200 lines, each subscribed"
_OURS_FN = "aioelastic/forkserver, K groups of 8 functions at once (warm server)"
_OURS_FIRST = "aioelastic/binary, first start in a fresh process (imports, watchdog)"


def _group(
    name: str,
    label: str,
    impl: str,
    case: str,
    ns: tuple[int, ...],
    quick_n: int,
    recorded: float,
    *,
    group_size: int = 2,
    target: float = 0.020,
    loaded: float | None = None,
    headline_n: int | None = None,
    warm: bool = True,
) -> Group:
    """One burst case: ours alone; what the loop held back checked in ``--quick``.

    The wall-clock lateness is the target's measure, shown in the recorded run. ``--quick``
    checks the lateness the loop's thread caused itself (its work and the system calls it
    blocked in, without its waits for a core): on a shared CI machine the wall clock also
    counts the moments the thread waited for a core behind the workers just started. It
    checks the median of 3 at ``quick_n``, where the recorded run's figure is ``recorded``
    (see :class:`~benchmarks.harness._spec.Claim`): every recorded figure here is within
    the target with the allowance, so the bound is the target, or ``loaded`` where a
    loaded machine does not hold the target. Its blocking calls (pipes, files, the
    watchdog's replies) and its imports take longer there, not only its waits for a core.
    """
    return Group(
        name=name,
        systems=(System(label, "aioelastic", f"benchmarks.measures.burst:{impl}"),),
        rows=(
            Row(
                f"{case} (target < {target * 1000:g} ms)",
                label,
                headline_n=headline_n,
                metrics=("lateness", "seconds"),
            ),
            Row(
                f"{case}: what the loop held back",
                label,
                metric="loop_held",
                metrics=("loop_held",),
                quick_max=Claim(quick_n, recorded=recorded, target=target, loaded=loaded),
            ),
        ),
        ns=ns,
        quick_ns=(quick_n,),
        default_reps=5,
        quick_reps=3,
        params={"group_size": group_size},
        warmup=warm,
        quick_warmup=warm,
        rep_timeout=150.0,
    )


MEASURE = Measure(
    name="burst",
    letter="l",
    title="a burst of K jobs started at once in one event loop: the loop's worst lateness",
    metrics=(LATENESS, LOOP_HELD, SECONDS),
    notes=(
        "N = K, the number of groups entered at the same instant in one anyio task group, "
        "each awaited to its end; lateness: worst wake-up delay of a task sleeping 5 ms at "
        "a time, from the first start to the last end (target: < 20 ms in a warm process, "
        "< 60 ms for the first start in a fresh one); loop_held: the same without the "
        "moments the loop's thread waited for a core (its run delay, from "
        "/proc/thread-self/schedstat): its own work and the system calls it blocked in "
        "(what `--quick` checks). seconds: the "
        "whole burst. torch has no "
        "equivalent: its API blocks the caller."
    ),
    groups=(
        _group(
            "binaries",
            _OURS_BIN,
            "aio_binaries",
            "K groups of 2 /bin/sh at once",
            (1, 8, 16, 64),
            64,
            0.0115,
            loaded=0.040,  # single quick runs at a load average of 4-7: 21.9, 32.5 ms
            headline_n=64,
        ),
        _group(
            "streamed",
            _OURS_STREAM,
            "aio_streamed",
            "K groups streaming output() at once",
            (64,),
            64,
            0.0115,
            loaded=0.055,  # single quick runs at a load average of 4-7: 41.8, 36.4 ms
        ),
        _group(
            "functions",
            _OURS_FN,
            "aio_functions",
            "K groups of 8 fork-server functions",
            (16,),
            16,
            0.0069,
            group_size=8,  # single quick runs at a load average of 4-7: 9.5, 13.6 ms
        ),
        _group(
            "first",
            _OURS_FIRST,
            "aio_first_start",
            "first start in a fresh process",
            (1,),
            1,
            0.0367,
            target=0.060,
            loaded=0.090,  # single quick runs at a load average of 4-7: 71.9, 71.8 ms
            headline_n=1,
            warm=False,
        ),
    ),
)


if __name__ == "__main__":
    _first_start_main(int(sys.argv[1]), sys.argv[2])
