"""`launch`: the small "run func on N local workers with the torch.distributed env" helper.

Many training codebases carry a helper ``launch(func, args, nprocs, master_addr,
master_port)`` that starts ``nprocs`` processes running ``func(args)`` with ``WORLD_SIZE,
RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT`` set, raises ``WorkerError`` when one fails and
``MainProcessError`` when the launcher itself is interrupted. This is that helper for async
code, with the same names and exceptions, minus its defects:

* the environment goes to each worker through `start_processes` (``envs``); the parent's
  ``os.environ`` is never touched (the usual helper sets and restores it, racing with
  every other task of an async program);
* SIGINT/SIGTERM are handled only while `launch` runs, through the event loop
  (`handle_signals`), and the previous handlers are restored afterwards; a second signal
  while stopping skips the rest of the grace period;
* stopping reaches each worker's whole process group, so grandchildren stop too;
* it returns the workers' return values by rank (the usual helper returns None).
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
from collections.abc import Callable
from typing import Any

from .._core.aio._backend import require_asyncio
from .._core.aio._signals import DEFAULT_SIGNALS, SignalReceived, handle_signals
from .._core.group._processes import start_processes
from .._core.process import _values as values
from .._core.process._exit_status import signal_text
from .._core.reports._failures import ChildFailedError

__all__ = ["MainProcessError", "WorkerError", "free_port", "launch"]


class WorkerError(multiprocessing.ProcessError):
    """A worker started by `launch` failed; the others have been stopped.

    ``__cause__`` is a `ChildFailedError` with the full report (tracebacks, stderr tails).

    Args:
        exitcode: the failed worker's exit status (negative: killed by that signal).
        worker_id: its rank.
        msg: the message; by default ``"worker[<id>] failed with exitcode=<code>"``.

    Attributes:
        exitcode: the failed worker's exit status.
        worker_id: its rank.
    """

    def __init__(self, exitcode: int, worker_id: int, msg: str | None = None) -> None:
        if msg is None:
            msg = f"worker[{worker_id}] failed with exitcode={exitcode}"
        super().__init__(msg)
        self.msg = msg
        self.exitcode = exitcode
        self.worker_id = worker_id

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.exitcode, self.worker_id, self.msg)


class MainProcessError(multiprocessing.ProcessError):
    """The process running `launch` received ``signal_no``; every worker has been stopped.

    Args:
        signal_no: the signal number.

    Attributes:
        signal_no: the signal number; a program usually exits with ``128 + signal_no``.
    """

    def __init__(self, signal_no: int) -> None:
        self.signal_no = signal_no
        name = signal_text(signal_no)
        description = signal.strsignal(signal_no) or name
        super().__init__(f"{name} received, exiting due to {description}.")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.signal_no,)


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago, for ``MASTER_PORT``.

    The port is found by binding port 0 and closing the socket again, so another process
    may take it before the rendezvous does; retry on "address already in use".

    Returns:
        The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        port: int = sock.getsockname()[1]
        return port


async def launch(
    func: Callable[[Any], Any],
    args: Any,
    nprocs: int,
    master_addr: str = "localhost",
    master_port: int | None = None,
    *,
    start_method: str = "spawn",
    grace_period: float = 30.0,
) -> list[Any]:
    """Run ``func(args)`` in ``nprocs`` local workers set up for ``torch.distributed``.

    Worker ``r`` gets ``WORLD_SIZE=nprocs``, ``RANK=r``, ``LOCAL_RANK=r``,
    ``MASTER_ADDR=master_addr`` and ``MASTER_PORT`` in its environment, so
    ``torch.distributed.init_process_group(backend)`` (``env://``) works as is.

    While it runs, SIGINT and SIGTERM to this process stop every worker (SIGTERM to each
    worker's process group, the grace period, then SIGKILL) and raise `MainProcessError`;
    another SIGINT/SIGTERM while they stop sends SIGKILL at once. The previous signal
    handlers are back when `launch` returns or raises. Off the main thread no handler can
    be installed (a RuntimeWarning says so) and signals stay the host's business; the
    workers still stop when `launch` is cancelled and die if this thread dies.

    Example::

        def train(cfg):
            torch.distributed.init_process_group("gloo")
            ...

        await aioelastic.launch(train, cfg, nprocs=4)

    Args:
        func: a picklable top-level function (for ``"spawn"`` and ``"forkserver"``),
            called with ``args`` as its one argument.
        args: passed as is to every worker.
        nprocs: how many workers, at least 1.
        master_addr: the rendezvous host for ``torch.distributed``.
        master_port: the rendezvous port; None or 0 picks one with `free_port`.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        grace_period: seconds between SIGTERM and SIGKILL when stopping the workers.

    Returns:
        The workers' return values, ``values[r]`` from rank ``r``.

    Raises:
        WorkerError: a worker failed (the first one, by time); the others were stopped.
        MainProcessError: this process got SIGINT or SIGTERM; the workers were stopped.
        TypeError: ``func`` is not callable.
        ValueError: a bad ``nprocs``, ``master_addr``, ``master_port``, ``start_method``
            or grace period.
    """
    require_asyncio("launch()")
    if not callable(func):
        raise TypeError(f"func must be callable (called as func(args)), got {func!r}")
    nprocs = values.field("nprocs", values.positive_int, nprocs)
    if not isinstance(master_addr, str) or not master_addr:
        raise ValueError(f"master_addr must be a non-empty host name, got {master_addr!r}")
    if master_port is not None:
        master_port = values.field("master_port", values.port, master_port)
    # Port 0 asks for any free port, as everywhere else; workers need the actual number.
    master_port = master_port or free_port()
    ctx = start_processes(
        name=getattr(func, "__name__", "launch"),
        entrypoint=func,
        args={rank: (args,) for rank in range(nprocs)},
        envs={
            rank: {
                "WORLD_SIZE": str(nprocs),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
            for rank in range(nprocs)
        },
        start_method=start_method,
        grace_period=grace_period,
    )

    async def kill_now(sig: signal.Signals) -> None:
        await ctx.close(signal.SIGKILL, 0)

    try:
        # The escalation wraps the whole context so that it covers every way out of it:
        # leaving the block by the signal, by a failure or by cancellation all end in
        # ctx.close() (in __aexit__), which a second signal cuts short.
        async with handle_signals(DEFAULT_SIGNALS) as sigs, sigs.escalate(kill_now), ctx:
            result = await sigs.run_until_signal(ctx.wait())
    except SignalReceived as e:
        raise MainProcessError(e.signum) from e
    if result is None:  # pragma: no cover - wait() without a timeout always has a result
        raise RuntimeError("PContext.wait() returned None without a timeout")
    if result.is_failed():
        report = ChildFailedError(ctx.name, result.failures)
        rank, failure = report.get_first_failure()
        raise WorkerError(failure.exitcode, rank) from report
    return [result.return_values[rank] for rank in range(nprocs)]
