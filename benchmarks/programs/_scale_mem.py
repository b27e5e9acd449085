"""A fresh supervisor for one memory sample of the scale measure.

``python -m benchmarks.programs._scale_mem SIDE N DIR`` (SIDE ``aioelastic`` or ``torch``) imports
torch (as a training controller has, and so that both sides start from the same heap) and
its side, runs one warm-up group of one worker (so the watchdog, fork servers and first-use
allocations exist), reads the supervisor tree's memory, starts N workers that sleep, reads
it again while they run, stops them and prints ``{"kb_per_worker": ..., "tree_kb": ...}``.

A fresh process per sample, because a long-lived one keeps the memory of its previous
repetitions in its allocator's free lists and would show the next N as nearly free.
The *supervisor tree* is this process and every descendant that is not a worker (nor a
worker's descendant): aioelastic's watchdog process, a fork server; torch has none. Its
memory is the sum of ``VmRSS`` from ``/proc``; pages shared between those processes count
once per process, which a difference of two readings cancels out.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path

from benchmarks.programs._clock import WORKER_TTL_S

SLEEP = "/bin/sleep"


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's), from ``/proc``; empty once it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(x) for x in f.read().split())
        except FileNotFoundError:
            continue
    return found


def rss_kb(pid: int) -> int:
    """``VmRSS`` of ``pid`` in kB (0 once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def tree_kb(root: int, workers: Collection[int]) -> int:
    """Memory of ``root`` and its descendants, leaving out ``workers`` and their subtrees."""
    total = 0
    pending = [root]
    while pending:
        pid = pending.pop()
        if pid in workers:
            continue
        total += rss_kb(pid)
        pending.extend(children(pid))
    return total


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {r: {"LOCAL_RANK": str(r)} for r in range(n)}


def _args(n: int) -> dict[int, tuple[str, ...]]:
    return {r: (str(WORKER_TTL_S),) for r in range(n)}


async def _aioelastic(n: int, directory: Path) -> dict[str, float]:
    from aioelastic._core.group._processes import run_processes, start_processes

    warm = await run_processes(
        name="warm", entrypoint="/bin/true", args={0: ()}, envs=_envs(1), log_dir=directory / "w"
    )
    if warm is None or warm.is_failed():
        raise RuntimeError(f"warm-up run failed: {warm!r}")
    before = tree_kb(os.getpid(), ())
    async with start_processes(
        name="bench",
        entrypoint=SLEEP,
        args=_args(n),
        envs=_envs(n),
        log_dir=directory / "n",
        grace_period=5.0,
    ) as ctx:
        during = tree_kb(os.getpid(), set(ctx.pids().values()))
    return {"kb_per_worker": (during - before) / n, "tree_kb": float(during)}


def _torch(n: int, directory: Path) -> dict[str, float]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    warm = start_processes(
        name="warm",
        entrypoint="/bin/true",
        args={0: ()},
        envs=_envs(1),
        logs_specs=DefaultLogsSpecs(log_dir=str(directory / "w")),
    )
    try:
        warm.wait(period=0.01)
    finally:
        warm.close()
    before = tree_kb(os.getpid(), ())
    pc = start_processes(
        name="bench",
        entrypoint=SLEEP,
        args=_args(n),
        envs=_envs(n),
        logs_specs=DefaultLogsSpecs(log_dir=str(directory / "n")),
    )
    try:
        during = tree_kb(os.getpid(), set(pc.pids().values()))
    finally:
        pc.close(timeout=5.0)
    return {"kb_per_worker": (during - before) / n, "tree_kb": float(during)}


def main() -> None:
    """See the module docstring."""
    side, n, directory = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    import torch

    assert torch.__version__  # the import is the point: the supervisor's heap holds torch
    if side == "aioelastic":
        import anyio

        sample = anyio.run(_aioelastic, n, directory)
    elif side == "torch":
        sample = _torch(n, directory)
    else:
        raise SystemExit(f"unknown side {side!r}: use aioelastic or torch")
    print(json.dumps(sample), flush=True)


if __name__ == "__main__":
    main()
