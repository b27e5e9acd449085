"""`spawn`: ``torch.multiprocessing.spawn`` for async code, on top of `run_processes`.

Same contract as torch's: ``fn(i, *args)`` runs in ``nprocs`` new processes; the first
failure stops the others and is raised as `ProcessRaisedException` (the child raised; its
traceback is in the message) or `ProcessExitedException` (it exited non-zero or was
killed by a signal). The exception classes keep torch's shapes and attribute names
(``error_index``, ``error_pid``, ``exit_code``, ``signal_name``) so ``except`` clauses
written for torch read the same; ``pid`` is an alias of ``error_pid``.

Differences from torch, on purpose:

* it returns the workers' return values by index (torch returns None);
* the grace period is the time between SIGTERM and SIGKILL, honoured as given (torch
  waits that long before SIGTERM and then again, or a hard-coded 30 s when it is None);
  None means 30 s here too;
* stopping reaches each worker's whole process group (data loader workers, shells), and
  cancelling the awaiting task stops every worker;
* fork and forkserver are real options (torch's ``spawn`` warns and uses spawn).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._core.group._processes import run_processes
from .._core.process import _values as values
from .._core.process._exit_status import exit_description
from .._core.reports._failures import ChildFailedError, ProcessFailure, failure_traceback

__all__ = [
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "spawn",
]

DEFAULT_GRACE_PERIOD = 30.0
"""torch's hard-coded wait between SIGTERM and SIGKILL, our default for None."""


class ProcessException(Exception):
    """A worker started by `spawn` failed (torch's base class of the two below).

    Args:
        msg: the message.
        error_index: the index ``i`` of the failed worker.
        error_pid: its process id.

    Attributes:
        msg: the message.
        error_index: the index of the failed worker (the first to fail).
        error_pid: its process id (torch's name).
    """

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    @property
    def pid(self) -> int:
        """The failed worker's process id (same as ``error_pid``)."""
        return self.error_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """A worker raised an exception; the message ends with its traceback."""


class ProcessExitedException(ProcessException):
    """A worker exited with a non-zero code or was killed by a signal.

    Args:
        msg: the message.
        error_index: the index of the failed worker.
        error_pid: its process id.
        exit_code: its exit status, negative when killed by signal ``-exit_code``.
        signal_name: that signal's name (``"SIGKILL"``), None when it exited by itself.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name),
        )


async def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    start_method: str = "spawn",
    grace_period: float | None = None,
) -> list[Any]:
    """Run ``fn(i, *args)`` for ``i`` in ``range(nprocs)``, each in a new process.

    Example::

        def train(i, lr):
            ...
            return loss

        losses = await aioelastic.spawn(train, args=(0.1,), nprocs=4)

    Args:
        fn: a picklable top-level function (for ``"spawn"`` and ``"forkserver"``).
        args: the arguments after the index, a tuple or list.
        nprocs: how many processes, at least 1.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        grace_period: seconds between SIGTERM and SIGKILL when the others are stopped
            after a failure; None means 30 s (torch's value).

    Returns:
        The return values, ``values[i]`` from process ``i``.

    Raises:
        ProcessRaisedException: a worker raised; ``str(exc)`` holds its traceback.
        ProcessExitedException: a worker exited non-zero or was killed by a signal.
        TypeError: ``fn`` is not callable or ``args`` is not a tuple or list.
        ValueError: ``nprocs`` < 1, or a bad start method or grace period.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable (called as fn(i, *args)), got {fn!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be a tuple or list (fn is called as fn(i, *args)), got {args!r}; "
            "for one argument write args=(value,)"
        )
    nprocs = values.field("nprocs", values.positive_int, nprocs)
    result = await run_processes(
        name=getattr(fn, "__name__", "spawn"),
        entrypoint=fn,
        args={i: (i, *args) for i in range(nprocs)},
        envs={i: {} for i in range(nprocs)},
        start_method=start_method,
        grace_period=DEFAULT_GRACE_PERIOD if grace_period is None else grace_period,
    )
    if result.is_failed():
        index, failure = ChildFailedError("spawn", result.failures).get_first_failure()
        raise _exception_for(index, failure)
    return [result.return_values[i] for i in range(nprocs)]


def _exception_for(index: int, failure: ProcessFailure) -> ProcessException:
    # An error file exists only when the worker raised (torch's test too).
    if failure.error_file_data:
        return ProcessRaisedException(
            f"\n\n-- Process {index:d} terminated with the following error:\n"
            f"{failure_traceback(failure)}",
            index,
            failure.pid,
        )
    if failure.exitcode < 0:
        name = failure.signal_name()
        if not name.startswith("SIG"):
            name = f"<Unknown signal {-failure.exitcode}>"
        return ProcessExitedException(
            f"process {index:d} terminated with signal {name}{_stderr_tail(failure)}",
            index,
            failure.pid,
            exit_code=failure.exitcode,
            signal_name=name,
        )
    return ProcessExitedException(
        f"process {index:d} terminated with exit code {failure.exitcode:d}{_stderr_tail(failure)}",
        index,
        failure.pid,
        exit_code=failure.exitcode,
    )


def _stderr_tail(failure: ProcessFailure) -> str:
    # Without an error file, failure.message is the worker's last stderr lines, or only a
    # restatement of the exit status when it printed nothing (then it adds nothing).
    detail = failure.message.strip("\n")
    if not detail.strip() or detail == exit_description(failure.exitcode):
        return ""
    return f"; its last lines on stderr:\n{detail}"
