"""Workers and child supervisors for the environment-fault tests (tests/core/group/test_faults.py).

``python -m tests.children.faults CASE ...`` runs a supervisor in a process of its own,
after putting the fault in place (a signal disposition, a resource limit), and prints
one JSON line per run to stderr: what ``run_processes`` returned or raised.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

import aioelastic
from aioelastic._core.process import _platform
from aioelastic._core.process._platform import children_of
from aioelastic._core.start._watchdog import watchdog
from tests.children import core
from tests.support.waits import ReadyFifo


def _interrupt() -> None:
    raise KeyboardInterrupt


class ExitsTheSupervisor:
    """A return value whose unpickling raises SystemExit(3) in whoever unpickles it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (sys.exit, (3,))


class InterruptsTheSupervisor:
    """A return value whose unpickling raises KeyboardInterrupt."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_interrupt, ())


def returns_exit() -> ExitsTheSupervisor:
    return ExitsTheSupervisor()


def returns_interrupt() -> InterruptsTheSupervisor:
    return InterruptsTheSupervisor()


def write_bytes(count: int) -> int:
    """Write ``count`` bytes to stdout in lines of 100 bytes; return the count."""
    line = "x" * 99 + "\n"
    for _ in range(count // 100):
        sys.stdout.write(line)
    sys.stdout.flush()
    return count


def print_lines(count: int) -> int:
    for i in range(count):
        print(f"line {i}", flush=True)
    return count


def _describe(result: aioelastic.RunProcsResult) -> dict[str, Any]:
    return {
        "exitcodes": {str(r): f.exitcode for r, f in result.failures.items()},
        "messages": {str(r): f.message for r, f in result.failures.items()},
        "return_values": {str(r): repr(v) for r, v in result.return_values.items()},
        "failed": result.is_failed(),
    }


async def _run(name: str, fn: Any, args: tuple[Any, ...], **kwargs: Any) -> None:
    try:
        result = await aioelastic.run_processes(name, fn, {0: args}, {0: {}}, **kwargs)
        line = _describe(result)
    except Exception as exc:
        line = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(line), file=sys.stderr, flush=True)


async def sigchld_ignored(method: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    await _run("ok", core.exit_with, (0,), start_method=method)
    await _run("three", core.exit_with, (3,), start_method=method)
    await _run("killed", core.kill_self, (signal.SIGKILL,), start_method=method)
    default = signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    print(json.dumps({"sigchld_default": default}), file=sys.stderr)


async def sigchld_ignored_thread() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    await anyio.to_thread.run_sync(anyio.run, _run, "thread", core.exit_with, (0,))
    left = set(children_of(os.getpid())) - {watchdog.pid}
    print(json.dumps({"children": sorted(left)}), file=sys.stderr, flush=True)


async def fsize(limit: str, log_dir: str) -> None:
    # Python ignores SIGXFSZ at startup, so a write past the limit fails with EFBIG.
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
    await _run("big", write_bytes, (100_000,), log_dir=log_dir, redirects=aioelastic.Std.OUT)


def _innermost_function(exc: BaseException) -> str:
    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return traceback.extract_tb(cause.__traceback__)[-1].name


def grandchild_ignoring_term(fifo: str, then_exit: bool = False) -> None:
    """Start a grandchild (in our group) that ignores SIGTERM, say ready, block (or exit)."""
    child = subprocess.Popen(
        ["sleep", "1000"], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)
    )
    with open(fifo, "w") as f:
        f.write(f"ready {child.pid}\n")
    if not then_exit:
        threading.Event().wait()


async def teardown_without_fds(directory: str, workers: str = "running") -> None:
    """Start workers with grandchildren, then take every free fd away and close().

    ``workers``: ``running`` (close() stops them), or ``exited`` (they return once their
    grandchild runs, and close() comes after wait(): the teardown of a group whose
    workers all ended by themselves). Prints how close() ended, then (limit restored)
    what was left: live or unreaped children and processes of the workers' groups.
    """
    then_exit = workers == "exited"
    ready = ReadyFifo(Path(directory))
    fifo = str(ready.path)
    ctx = aioelastic.start_processes(
        "nofds",
        grandchild_ignoring_term,
        {0: (fifo, then_exit), 1: (fifo, then_exit)},
        {0: {}, 1: {}},
        log_dir=os.path.join(directory, "logs"),
        start_method="fork",
        grace_period=1.0,
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    outcome = "closed"
    async with ctx:
        await ready.lines(2, timeout=30)
        pgids = set(ctx.pids().values())
        if then_exit:
            with anyio.fail_after(30):
                result = await ctx.wait()
            assert result is not None
            assert not result.is_failed(), result
        # Below the lowest free fd number: nothing (pidfd, /proc listing, pipe) can be
        # opened any more, even once the exit path closes some descriptors.
        resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
        try:
            with anyio.fail_after(60):
                await ctx.close()
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ready.close()
    members = _platform.live_group_members(pgids)
    left = set(children_of(os.getpid())) - {watchdog.pid}
    print(
        json.dumps({"close": outcome, "children": sorted(left), "members": sorted(members)}),
        file=sys.stderr,
        flush=True,
    )


async def nofile_sweep(low: str, high: str, nprocs: str, method: str = "spawn") -> None:
    """Run the same group at each RLIMIT_NOFILE from ``low`` to ``high``.

    ``method``: a start method of function workers, or ``binary`` (``/bin/true``).

    One JSON line per limit, then one with what was left behind: live or unreaped
    children and open fds beyond those of the first run (which starts the watchdog).
    """
    n = int(nprocs)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    async def run() -> dict[str, Any]:
        try:
            if method == "binary":
                # Binaries: the watchdog starts them, in batches handed over in slices.
                result = await aioelastic.run_processes(
                    "nofile",
                    "/bin/true",
                    {r: () for r in range(n)},
                    {r: {} for r in range(n)},
                    redirects=aioelastic.Std.ALL,
                )
                return _describe(result)
            result = await aioelastic.run_processes(
                "nofile",
                core.add,
                {r: (r, 1) for r in range(n)},
                {r: {} for r in range(n)},
                start_method=method,
                redirects=aioelastic.Std.ALL,
            )
            return _describe(result)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "in": _innermost_function(exc)}

    await run()
    fds = set(os.listdir("/proc/self/fd"))
    for limit in range(int(low), int(high) + 1):
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        line = await run()
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        print(json.dumps({"limit": limit, **line}), file=sys.stderr, flush=True)
    left = {
        "children": sorted(set(children_of(os.getpid())) - {watchdog.pid}),
        "fds": sorted(set(os.listdir("/proc/self/fd")) - fds),
    }
    print(json.dumps(left), file=sys.stderr, flush=True)


async def tee_lines(count: str) -> None:
    await _run("tee", print_lines, (int(count),), start_method="spawn", tee=aioelastic.Std.ALL)


CASES = {
    "sigchld_ignored": sigchld_ignored,
    "sigchld_ignored_thread": sigchld_ignored_thread,
    "fsize": fsize,
    "teardown_without_fds": teardown_without_fds,
    "nofile_sweep": nofile_sweep,
    "tee_lines": tee_lines,
}

if __name__ == "__main__":
    anyio.run(CASES[sys.argv[1]], *sys.argv[2:])


#: A binary's view of its own signal state, from the kernel.
SHOW_SIGNALS = (
    "for line in open('/proc/self/status'):\n"
    "    if line.startswith(('SigBlk', 'SigIgn')): print(line.strip())"
)


def signal_state() -> tuple[str, str, str, list[int]]:
    """A function worker's view: SIGHUP, SIGUSR2, SIGINT handlers and its blocked mask."""

    def name(handler: Any) -> str:
        return getattr(handler, "name", None) or getattr(handler, "__name__", repr(handler))

    return (
        name(signal.getsignal(signal.SIGHUP)),
        name(signal.getsignal(signal.SIGUSR2)),
        name(signal.getsignal(signal.SIGINT)),
        sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    )


def flood_or_wait(fifo: str, go_fifo: str, count: int) -> str:
    """Rank 0 writes ``count`` bytes and exits; rank 1 says ready, waits for go, says so."""
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("ROLE") == "flood":
        write_bytes(count)
        return "flooded"
    with open(fifo, "w") as f:
        f.write(f"ready {os.getpid()}\n")
    with open(go_fifo) as f:
        f.readline()
    with open(fifo, "w") as f:
        f.write("released\n")
    return "released"
