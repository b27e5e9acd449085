"""Where the CPU of N binary workers goes, per process, for aioelastic and torch.

``python -m benchmarks.cpu_split [--n 256] [--reps 10]`` starts N ``/bin/true`` from a
torch-loaded supervisor, as measure i does, ``--reps`` times for each side (sides
alternating, one warm-up each), and prints the CPU time per worker spent by:

- the supervisor's own process (``RUSAGE_SELF``);
- aioelastic's watchdog, which spawns and reaps binaries (``/proc/PID/stat``);
- the workers themselves (their exec and exit: ``RUSAGE_CHILDREN`` of whoever reaped
  them, the supervisor for torch, the watchdog for us);

and, as a third side, the floor of measure i: ``os.posix_spawn`` N times, then ``waitpid``
each, no supervisor (its "supervisor" share is the spawning alone, which torch's
supervisor does with ``Popen`` and our watchdog with ``posix_spawn``);

the part of the supervisor's CPU spent in Python's garbage collector (a mean over the
repetitions: a full collection of a torch-loaded heap costs ~80 ms and comes every few
runs), with the number of full collections; the wall time; the sum of the three shares;
and the part of the machine's core time left idle meanwhile (``/proc/stat``, a mean). On a
machine with few cores a job of many short workers is bound by the sum: its wall time is
about the sum divided by the cores (the last line, for each side), divided again by the
part not idle, which is why this split says more than the wall time alone. ``/proc``
counts in clock ticks (10 ms): use N >= 128 and several repetitions. The log directories
go where the benchmark's go (tmpfs when there is one).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

from aioelastic._core.process._platform import children_of, proc_stat
from benchmarks.harness._run_dir import run_parent
from benchmarks.measures.binary import TRUE, spawn_and_reap

_TICK = os.sysconf("SC_CLK_TCK")


#: The generation a full collection collects.
_OLDEST = len(gc.get_threshold()) - 1


class _Collections:
    """Time spent in the garbage collector, and full collections, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._began
        self.full += info["generation"] == _OLDEST

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _self_and_children() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _proc_times(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of ``pid``."""
    fields = proc_stat(pid)
    if fields is None:
        raise RuntimeError(f"pid {pid} is gone")
    utime, stime, cutime, cstime = (int(x) / _TICK for x in fields[11:15])
    return utime + stime, cutime + cstime


def _idle_seconds() -> float:
    """Idle (and I/O wait) time of all the machine's cores so far, from ``/proc/stat``."""
    with open("/proc/stat", "rb") as stat:
        fields = stat.readline().split()  # "cpu user nice system idle iowait ..."
    return (int(fields[4]) + int(fields[5])) / _TICK


def _wait_reaped(pid: int, timeout: float = 10.0) -> None:
    """Until ``pid`` has no child left: the watchdog reaps a released worker on its own."""
    deadline = time.monotonic() + timeout
    while children_of(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the watchdog (pid {pid}) still has children after {timeout} s")
        time.sleep(0.001)  # no event tells when another process reaps its child


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {rank: {"LOCAL_RANK": str(rank)} for rank in range(n)}


def _measure(run: Callable[[], object]) -> dict[str, float]:
    """``run()``'s wall time, the cores' idle time meanwhile, and this process's CPU:
    its own (``supervisor``), its reaped children's (``workers``), its collector's."""
    self0, kids0 = _self_and_children()
    idle0, start = _idle_seconds(), time.monotonic()
    with _Collections() as collections:
        run()
    wall, idle = time.monotonic() - start, _idle_seconds() - idle0
    self1, kids1 = _self_and_children()
    return {
        "wall": wall,
        "supervisor": self1 - self0,
        "helper": 0.0,
        "workers": kids1 - kids0,
        "gc": collections.seconds,
        "full": collections.full,
        "idle": idle,
    }


def _ours(n: int, log_dir: str) -> dict[str, float]:
    from aioelastic._core.group._processes import run_processes
    from aioelastic._core.start._watchdog import watchdog

    async def run() -> None:
        result = await run_processes(
            name="bench", entrypoint=TRUE, args={r: () for r in range(n)}, envs=_envs(n),
            log_dir=log_dir,
        )  # fmt: skip
        if result.is_failed():
            raise RuntimeError(f"aioelastic: {result.failures}")

    pid = watchdog.pid
    helper0 = _proc_times(pid) if pid else (0.0, 0.0)
    sample = _measure(lambda: asyncio.run(run()))
    pid = watchdog.pid
    assert pid is not None
    _wait_reaped(pid)
    helper1 = _proc_times(pid)
    # The watchdog spawns and reaps the workers: their CPU is its children's.
    sample["helper"] = helper1[0] - helper0[0]
    sample["workers"] = helper1[1] - helper0[1]
    return sample


def _torch(n: int, log_dir: str) -> dict[str, float]:
    return _measure(lambda: _torch_run(n, log_dir))


def _floor(n: int, log_dir: str) -> dict[str, float]:
    env = dict(os.environ)
    return _measure(lambda: spawn_and_reap(n, env))


def _torch_run(n: int, log_dir: str) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    pc = start_processes(
        name="bench", entrypoint=TRUE, args={r: () for r in range(n)}, envs=_envs(n),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )  # fmt: skip
    try:
        result = pc.wait(period=0.01)
    finally:
        pc.close()
    if result is None or result.is_failed():
        raise RuntimeError(f"torch: {result}")


def main() -> None:
    """Print the split (see the module documentation)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_split")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    import torch

    assert torch.__version__  # the supervisor's image holds torch, as a controller's does
    sides: dict[str, Callable[[int, str], dict[str, float]]] = {
        "aioelastic run_processes": _ours,
        "torch start_processes + wait(period=0.01)": _torch,
        "floor: posix_spawn + waitpid": _floor,
    }
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    # Where measure i makes its log directories: tmpfs, so that no side's share is the
    # disk's cost of allocating a directory (see run_parent).
    with tempfile.TemporaryDirectory(dir=run_parent(None)) as root:
        for rep in range(args.reps + 1):
            for name, side in sides.items():
                sample = side(args.n, os.path.join(root, f"{len(samples[name])}-{rep}"))
                if rep:  # the first is a warm-up (the watchdog's start, lazy imports)
                    samples[name].append(sample)
    cores = os.cpu_count() or 1
    print(f"N={args.n} x {TRUE}, torch loaded; medians of {args.reps}, ms per worker:")
    print("(of the supervisor's: in the garbage collector, a mean; full collections in all;")
    print(f" sum: supervisor + helper + workers; idle: % of the {cores} cores idle, a mean)")
    print(
        f"{'side':45} {'wall':>8} {'supervisor':>11} {'of it gc':>9} {'full':>5} "
        f"{'helper':>8} {'workers':>8} {'sum':>8} {'idle':>6}"
    )
    floors = []
    for name, runs in samples.items():
        for run in runs:
            run["sum"] = run["supervisor"] + run["helper"] + run["workers"]
        med = {key: statistics.median(run[key] for run in runs) * 1000 / args.n for key in runs[0]}
        in_gc = statistics.mean(run["gc"] for run in runs) * 1000 / args.n
        full = sum(int(run["full"]) for run in runs)
        idle = statistics.mean(run["idle"] / (run["wall"] * cores) for run in runs) * 100
        print(
            f"{name:45} {med['wall']:8.3f} {med['supervisor']:11.3f} {in_gc:9.3f} {full:5d} "
            f"{med['helper']:8.3f} {med['workers']:8.3f} {med['sum']:8.3f} {idle:5.0f}%"
        )
        floors.append(f"{name.split()[0].rstrip(':')} {med['sum'] / cores:.3f}")
    print(f"CPU-bound floor (sum / {cores} cores), ms per worker: {', '.join(floors)}")


if __name__ == "__main__":
    main()
