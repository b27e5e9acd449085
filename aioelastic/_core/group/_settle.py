"""What became of a worker: its exit recorded, then its outcome settled and reported.

Functions over one :class:`~..worker._process.WorkerProcess` record, called by the group
(:class:`~._pcontext.PContext`) from a worker's exit callback. The one rule of the exit
path: the exit is always recorded, with the real exit status, and the outcome always
settled; a fault while reading the status, the output, the return value or the error file
becomes part of this rank's failure instead of escaping. Only the failure report, which
reads the error file, takes a task (and a thread hop when there is a file to read).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping

import anyio
import anyio.to_thread

from ..child._error_file import NOT_AVAILABLE
from ..process._exit_status import exit_description
from ..reports._failures import ProcessFailure
from ..reports._results import RunProcsResult
from ..start._exit_watch import ExitNotSeen, ExitOutcome
from ..worker._process import WorkerProcess
from ..worker._teardown import CHILDREN_KILL_TIMEOUT

logger = logging.getLogger("aioelastic")

#: How long building a failure report (reading the error file, off the event loop) may
#: take. Past it the report is made without the file: an error file replaced by a FIFO
#: or a hung network filesystem must not hold up the exit path.
REPORT_TIMEOUT = 10.0
#: Exit code reported for a worker whose exit status the kernel would not give (it was
#: reaped behind our back); its failure message says so.
UNKNOWN_EXIT_CODE = 1


def record_exit(
    worker: WorkerProcess, outcome: ExitOutcome, forget_pid: Callable[[int], None]
) -> None:
    """Record the exit of ``worker`` (``returncode``, ``exit_time``, its last output).

    Never raises: a status that could not be read, or output that could not be taken in,
    is kept in ``worker.faults``. ``forget_pid`` (the hang guard's) is told the pid exited.
    Sets ``worker.exited``.
    """
    if isinstance(outcome, ExitNotSeen):
        worker.returncode = UNKNOWN_EXIT_CODE
        worker.faults.append(
            f"was not seen exiting {CHILDREN_KILL_TIMEOUT:g} s after SIGKILL "
            "(uninterruptible sleep, or a stopped fork server or watchdog?); "
            "its exit status is unknown"
        )
    elif isinstance(outcome, Exception):
        worker.returncode = UNKNOWN_EXIT_CODE
        worker.faults.append(
            f"exited, but its exit status could not be read ({outcome}); "
            "was SIGCHLD ignored by another part of this process?"
        )
    else:
        worker.returncode = outcome
    worker.exit_time = time.time()
    try:
        forget_pid(worker.pid)
        worker.drain_output()
    except Exception as exc:
        worker.faults.append(f"its output could not be read to the end ({exc!r})")
    worker.exited.set()


def settle_success(worker: WorkerProcess, hang_texts: Mapping[int, str]) -> list[str] | None:
    """Settle ``worker`` as succeeded (or stopped): ``None``; else its problems.

    ``hang_texts``: why a rank was found hung (timer expiry, stall), by local rank.
    """
    assert worker.returncode is not None
    problems = list(worker.faults)
    if worker.returncode == 0 and not problems:
        problem = collect_return_value(worker)
        # A worker we stopped may exit 0 without a value (a SIGTERM handler that
        # calls os._exit(0)): stopped, not failed.
        if problem is not None and not worker.signalled:
            problems.append(problem)
    if not problems and not own_failure(worker, hang_texts):
        # A log file that could not be written (full disk) is reported with the
        # group's result (see group_result), not as a failure now: the other workers
        # are not stopped for it.
        worker.succeeded = worker.returncode == 0
        return None
    return problems


def own_failure(worker: WorkerProcess, hang_texts: Mapping[int, str]) -> bool:
    """Whether the exit of ``worker`` is its own failure (not a stop by the supervisor)."""
    # A rank the hang guard killed (timer expiry, stall) failed, though we signalled it.
    hang = hang_texts.get(worker.local_rank)
    return worker.returncode != 0 and (not worker.signalled or hang is not None)


def collect_return_value(worker: WorkerProcess) -> str | None:
    """Unpickle the return value of ``worker`` into it: ``None``, or what went wrong."""
    if worker.result is None:
        return None
    if not worker.result.complete:
        return worker.result.incomplete_reason()
    try:
        worker.return_value = pickle.loads(worker.result.payload())
    except BaseException as exc:
        # Unpickling runs code chosen by the worker's objects (``__reduce__``): it can
        # raise SystemExit or KeyboardInterrupt here, in the supervisor. Either is
        # this rank's failure, never the supervisor's exit.
        return f"its return value could not be unpickled by the supervisor: {exc!r}"
    return None


async def report_failure(
    worker: WorkerProcess, problems: list[str], hang_texts: Mapping[int, str]
) -> None:
    """Build the failure report of ``worker`` into ``worker.failure``; never raises."""
    try:
        problems = problems + worker.log_faults()
        worker.succeeded = False
        worker.return_value = None
        own = own_failure(worker, hang_texts)
        failure = await build_failure(worker)
        if problems:
            text = "; ".join(problems)
            if own:
                failure.message = f"{failure.message}\n(worker {worker.local_rank} also: {text})"
            else:
                failure.message = f"worker {worker.local_rank} {text}"
        hang = hang_texts.get(worker.local_rank)
        if hang is not None:
            failure.message = f"{hang.rstrip()}\n{failure.message}"
        worker.failure = failure
    except Exception as exc:
        logger.exception("aioelastic: reporting the exit of worker %d", worker.local_rank)
        worker.failure = unreported(worker, exc)


async def build_failure(worker: WorkerProcess) -> ProcessFailure:
    """The rank's failure report, with its error file read off the event loop (bounded)."""
    assert worker.returncode is not None
    assert worker.exit_time is not None
    build = functools.partial(
        ProcessFailure.from_exit,
        local_rank=worker.local_rank,
        pid=worker.pid,
        exitcode=worker.returncode,
        error_file=worker.error_file,
        exit_time=worker.exit_time,
        stderr_tail=worker.stderr.tail_lines(),
    )
    try:
        os.lstat(worker.error_file)
    except FileNotFoundError:
        # No error file (a binary's usual failure, a crash): nothing to read, so no
        # thread hop on the way to the report. The path is in our own log directory,
        # which the loop writes to anyway.
        return build()
    except OSError:
        pass
    fault = f"timed out after {REPORT_TIMEOUT:g} s"
    with anyio.move_on_after(REPORT_TIMEOUT):
        try:
            # Abandoned on timeout: a read blocked on a FIFO ends when the thread
            # does, not before; it holds no lock of ours.
            return await anyio.to_thread.run_sync(build, abandon_on_cancel=True)
        except Exception as exc:
            fault = repr(exc)
    failure = bare_failure(worker, "")
    failure.message = (
        f"{failure.message} (its error file {worker.error_file} could not be read: {fault})"
    )
    return failure


def bare_failure(worker: WorkerProcess, message: str) -> ProcessFailure:
    """A failure report made without the error file."""
    assert worker.returncode is not None
    return ProcessFailure(
        local_rank=worker.local_rank,
        pid=worker.pid,
        exitcode=worker.returncode,
        error_file=NOT_AVAILABLE,
        message=message or exit_description(worker.returncode),
        timestamp=worker.exit_time or time.time(),
    )


def unreported(worker: WorkerProcess, exc: BaseException) -> ProcessFailure:
    """The failure of a worker whose report could not be built (``exc`` says why)."""
    return bare_failure(worker, f"worker {worker.local_rank} exit could not be reported: {exc!r}")


def group_result(workers: list[WorkerProcess], nprocs: int) -> RunProcsResult:
    """The group's result from its workers' records (sorted by local rank).

    A worker that succeeded but whose log file could not be written to the end (a full
    disk, the file size limit) is settled as failed here: the run's record is incomplete,
    so the result must not say success.
    """
    for worker in workers:
        faults = worker.log_faults()
        if worker.failure is None and faults and worker.returncode is not None:
            text = "; ".join(faults)
            worker.failure = bare_failure(worker, f"worker {worker.local_rank} {text}")
            worker.succeeded = False
    failures = {w.local_rank: w.failure for w in workers if w.failure is not None}
    # Neither failed nor all succeeded: close() ended the group first.
    stopped = not failures and sum(w.succeeded for w in workers) < nprocs
    return RunProcsResult(
        return_values={}
        if failures or stopped
        else {w.local_rank: w.return_value for w in workers},
        failures=failures,
        stdouts={w.local_rank: w.stdout_path for w in workers},
        stderrs={w.local_rank: w.stderr_path for w in workers},
        stopped=stopped,
    )
