"""One worker's record: its rank, process, files, I/O pumps and what became of it.

The supervisor keeps one :class:`WorkerProcess` per local rank — never several
dictionaries keyed by rank; torch-shaped ``dict[int, ...]`` views are built only at the
API boundary (:class:`~aioelastic.RunProcsResult`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..aio._lazy_event import LazyEvent
from ..child._result_pipe import ResultReceiver
from ..output._logs import StreamPump
from ..reports._failures import ProcessFailure
from ..start._launchers import Launched


@dataclass(eq=False)
class WorkerProcess:
    """A started worker, from launch to reaping."""

    local_rank: int
    launched: Launched
    error_file: str
    stdout_path: str
    stderr_path: str
    stdout: StreamPump
    stderr: StreamPump
    result: ResultReceiver | None
    #: Exit code once exited (negative: killed by that signal).
    returncode: int | None = None
    #: Wall-clock time at which the supervisor saw the exit.
    exit_time: float | None = None
    #: The supervisor signalled it before it exited: its exit is not its own failure.
    signalled: bool = False
    reaped: bool = False
    #: Set once the exit is recorded (``returncode`` known), whatever went wrong after.
    exited: LazyEvent = field(default_factory=LazyEvent)
    #: Set once the outcome below is final (``failure`` or ``return_value`` or neither).
    settled: LazyEvent = field(default_factory=LazyEvent)
    #: How it failed, if it did.
    failure: ProcessFailure | None = None
    #: Whether it exited 0 with its return value received (``None`` for a binary).
    succeeded: bool = False
    return_value: Any = None
    #: What went wrong in the supervisor while handling this worker (its exit status,
    #: output or return value could not be fully taken in), for its failure report.
    faults: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        if self.returncode is None:
            state = "running"
        elif self.failure is not None:
            state = f"failed exitcode={self.returncode}"
        elif self.settled.is_set():
            state = f"{'succeeded' if self.succeeded else 'stopped'} exitcode={self.returncode}"
        else:
            state = f"exited exitcode={self.returncode}"
        return f"<WorkerProcess local_rank={self.local_rank} pid={self.pid} {state}>"

    @property
    def pid(self) -> int:
        """The worker's pid, which is also its process-group id."""
        return self.launched.pid

    def drain_output(self) -> None:
        """Take in everything the worker wrote before it exited (bounded)."""
        for pump in (self.stdout, self.stderr):
            pump.drain(max_chunks=1024)
        if self.result is not None:
            self.result.drain()

    def log_faults(self) -> list[str]:
        """The log-file write errors of its two streams, as report lines."""
        return [f for f in (self.stdout.log_fault(), self.stderr.log_fault()) if f]
