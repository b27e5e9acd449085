"""One worker's record: its rank, process, files, I/O pumps and what became of it.

The supervisor keeps one :class:`WorkerProcess` per local rank instead of several
dictionaries keyed by rank; torch-shaped ``dict[int, ...]`` views are built only at the
API boundary (:class:`~aioelastic.RunProcsResult`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from ._launchers import Launched
from ._logs import StreamPump
from ._result_pipe import ResultReceiver


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
    exited: anyio.Event = field(default_factory=anyio.Event)

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
