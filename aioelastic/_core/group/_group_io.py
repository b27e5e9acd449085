"""A group's I/O past its pumps: the shielded tasks that move bytes, the console's collapsers.

The pumps read the workers' pipes from loop callbacks; what needs a task (a terminal's
stdin and window size, a result pipe, a large payload fed to a worker) runs here, shielded:
cancelling the group's host task must not cut a transfer in half. After the teardown,
:meth:`GroupIO.finish` ends it all in order: the pipes drained to end-of-file, the tasks
ended, the lines held for their twins printed, the output hub closed, the console flushed.
The loop's reader hub is held open meanwhile (see :mod:`..process._reader_hub`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from ..aio._lazy_event import wait_all
from ..aio._reader_hub import hold_reader_hub
from ..output._collapse import Collapser
from ..output._console import StreamName, console
from ..worker._process import WorkerProcess
from ._starting import OutputTarget
from ._validate import GroupSpec

#: After teardown, how long to wait for the worker pipes to reach end-of-file. Only a
#: descendant that escaped its process group (``setsid``) can keep one open that long.
IO_DRAIN_TIMEOUT = 2.0


class GroupIO:
    """The I/O tasks and console collapsers of one group."""

    def __init__(self) -> None:
        self._scopes: list[anyio.CancelScope] = []
        self._tg: anyio.abc.TaskGroup | None = None
        #: Where identical console lines of several ranks are collapsed, per stream (only
        #: when asked for).
        self.collapsers: dict[StreamName, Collapser] = {}
        self._release_hub: Callable[[], None] | None = None

    def open(self, tg: anyio.abc.TaskGroup, spec: GroupSpec) -> None:
        """Run the I/O tasks in ``tg``; make the collapsers ``spec`` asks for."""
        self._tg = tg
        self._release_hub = hold_reader_hub(asyncio.get_running_loop())
        window = spec.options.collapse_identical_lines
        if window is not None and spec.nprocs > 1:
            self.collapsers = {n: Collapser(console(n), window) for n in ("stdout", "stderr")}

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run an I/O task that outer cancellation cannot interrupt mid-transfer.

        Log pumps must not lose the bytes still in a pipe when the host task is
        cancelled; :meth:`finish` ends them explicitly after a final drain.
        """
        scope = anyio.CancelScope(shield=True)
        self._scopes.append(scope)

        async def run() -> None:
            with scope:
                await fn(*args)

        assert self._tg is not None
        self._tg.start_soon(run)

    async def finish(self, workers: Sequence[WorkerProcess], output: OutputTarget) -> None:
        """End the group's I/O once its workers are gone (bounded, see IO_DRAIN_TIMEOUT)."""
        try:
            await self._finish(workers, output)
        finally:
            if self._release_hub is not None:
                self._release_hub()

    async def _finish(self, workers: Sequence[WorkerProcess], output: OutputTarget) -> None:
        pumps = [p for w in workers for p in (w.stdout, w.stderr)]
        # Every writer is dead now, so the pipes reach end-of-file at once — unless a
        # descendant escaped its process group and still holds one.
        with anyio.move_on_after(IO_DRAIN_TIMEOUT):
            await wait_all(pump.closed for pump in pumps)
        for scope in self._scopes:
            scope.cancel()
        for worker in workers:
            for pump in (worker.stdout, worker.stderr):
                pump.drain(max_chunks=1024)
                pump.finish()
            if worker.result is not None:
                worker.result.close()
            # Closing a worker's pipes and log files is a handful of syscalls; for
            # hundreds of workers, other tasks run in between.
            await anyio.lowlevel.cancel_shielded_checkpoint()
        # Every stream has ended: the lines still held for their twins go out now.
        for collapser in self.collapsers.values():
            collapser.flush()
        if output.owned:
            output.hub.close()
        # Bounded: a console whose reader stopped reading (a paused terminal, a full
        # pipe nobody drains) must not hold up the end of the run.
        with anyio.move_on_after(IO_DRAIN_TIMEOUT):
            for stream in (console("stdout"), console("stderr")):
                await stream.flush()
