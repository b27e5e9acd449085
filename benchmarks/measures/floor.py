"""The physical floor: what starting N processes costs on this machine with no supervisor.

- N concurrent ``posix_spawn`` (vfork+exec) of ``/bin/true``, to the last exit reaped: the
  floor of a no-op binary job (measure b).
- the same for ``python -S -c pass``: the floor of a Python binary worker (a, h).
- N ``fork()`` of a process that has torch imported, to the last child running its first
  line: the floor of a fork server with torch preloaded (a, e).
- SIGTERM to N such children, which ran and now wait, to the last one reaped: the
  kernel's share of a restart's teardown (e), the freeing of each child's copy of the
  torch-loaded address space, which no supervisor can shorten.
"""

from __future__ import annotations

import os
import signal
import sys

from benchmarks.harness._spec import SECONDS, Group, Measure, RepContext, Row, System
from benchmarks.programs._clock import now_ns, read_stamps, seconds, write_stamp


def _spawn_and_reap(argv: list[str], n: int) -> dict[str, float]:
    env = dict(os.environ)
    start = now_ns()
    pids = [os.posix_spawn(argv[0], argv, env) for _ in range(n)]
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{argv} exited with status {status}")
    return {"seconds": seconds(now_ns() - start)}


def true(ctx: RepContext) -> dict[str, float]:
    """N x fork+exec of /bin/true, to the last exit."""
    return _spawn_and_reap(["/bin/true"], ctx.n)


def python_s(ctx: RepContext) -> dict[str, float]:
    """N x fork+exec of ``python -S -c pass``, to the last exit."""
    return _spawn_and_reap([sys.executable, "-S", "-c", "pass"], ctx.n)


def fork_torch(ctx: RepContext) -> dict[str, float]:
    """N x fork of a warm torch-loaded process, to the last child running user code."""
    import torch

    assert torch.__version__  # the import is the point: the forked image holds torch
    directory = ctx.workdir
    start = now_ns()
    pids = []
    for rank in range(ctx.n):
        pid = os.fork()
        if pid == 0:
            try:
                write_stamp(directory / f"start{rank}")
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return {"seconds": seconds(max(read_stamps(directory, "start", ctx.n)) - start)}


def stop_torch(ctx: RepContext) -> dict[str, float]:
    """SIGTERM to N running children of a torch-loaded process, to the last one reaped."""
    import torch

    children: list[tuple[int, int]] = []
    try:
        for _ in range(ctx.n):
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(ready_r)
                    # As a worker would: run some torch, then wait to be stopped.
                    torch.ones(16).sum()
                    os.write(ready_w, b"r")
                    signal.pause()
                finally:
                    os._exit(0)
            os.close(ready_w)
            children.append((pid, ready_r))
        for _, ready_r in children:
            if os.read(ready_r, 1) != b"r":
                raise RuntimeError("a forked child died before it was ready")
        start = now_ns()
        for pid, _ in children:
            os.kill(pid, signal.SIGTERM)
        for pid, _ in children:
            os.waitpid(pid, 0)
        return {"seconds": seconds(now_ns() - start)}
    finally:
        for pid, ready_r in children:
            os.close(ready_r)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


_M = "benchmarks.measures.floor"

MEASURE = Measure(
    name="floor",
    letter="floor",
    title="physical floor: N processes with no supervisor",
    metrics=(SECONDS,),
    notes=(
        "true / python -S: N concurrent posix_spawn (vfork+exec) to the last exit reaped. "
        "fork torch: N fork() of a process with torch imported, to the last child's first line. "
        "stop torch: SIGTERM to N such children that ran and wait, to the last one reaped."
    ),
    groups=(
        Group(
            name="floor",
            systems=(
                System("floor/true", "floor", f"{_M}:true"),
                System("floor/python -S", "floor", f"{_M}:python_s"),
                System("floor/fork torch", "floor", f"{_M}:fork_torch"),
                System("floor/stop torch", "floor", f"{_M}:stop_torch"),
            ),
            rows=(
                Row("fork+exec /bin/true, to exit", "floor/true"),
                Row("fork+exec python -S -c pass, to exit", "floor/python -S"),
                Row("fork of a torch-loaded process, to user code", "floor/fork torch"),
                Row("SIGTERM to N torch-loaded children, to the last reaped", "floor/stop torch"),
            ),
            ns=(1, 2, 4, 8, 16, 32),
            quick_ns=(1, 2),
            default_reps=10,
            quick_reps=2,
        ),
    ),
)
