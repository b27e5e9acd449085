"""The signals a group passes on to its workers while it runs (``forward_signals``).

A scheduler's request that is not a stop (SLURM's ``--signal=USR1@120``: checkpoint, the
time is nearly up) reaches the launcher; the workers are the ones to act on it. Each
signal is sent to each running worker's *process*, not its process group as a stop is:
a trainer's children (data-loader processes) rarely handle SIGUSR1 and would die of it,
failing the trainer; the trainer hears it and tells them what it wants. A worker that does
not handle it dies of it, which is that worker's failure like any other (the supervisor
did not stop it). Once the group's teardown has begun nothing more is passed on: the
workers are being stopped. Under SLURM every node's launcher receives the signal itself,
so passing it on locally reaches every rank of the job (docs/signals.md).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from contextlib import AsyncExitStack

import anyio
import anyio.abc

from ..aio._signals import SignalScope, handle_signals
from ..process import _platform
from ..worker._process import WorkerProcess

logger = logging.getLogger("aioelastic")


class Forwarding:
    """Passes each of ``signals`` the process receives on to the group's running workers."""

    def __init__(self, signals: Collection[int], workers: Sequence[WorkerProcess], name: str):
        self._signals = signals
        self._workers = workers
        self._name = name
        self._scope: SignalScope | None = None
        self._stopping = False
        self._cancel: anyio.CancelScope | None = None  # made in the loop, by the task

    async def handle(self, stack: AsyncExitStack) -> None:
        """Handle the signals until ``stack`` closes (from before the first worker starts:
        one that comes while they start is passed on once they run)."""
        if self._signals:
            self._scope = await stack.enter_async_context(handle_signals(self._signals))

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Pass them on from now until :meth:`stop` (every worker has started)."""
        if self._scope is not None and not self._stopping:
            tg.start_soon(self._run, self._scope)

    def stop(self) -> None:
        """Pass nothing on any more: the teardown begins."""
        self._stopping = True
        if self._cancel is not None:
            self._cancel.cancel()

    async def _run(self, scope: SignalScope) -> None:
        self._cancel = anyio.CancelScope()
        with self._cancel:
            count = 0
            while not self._stopping:
                count += 1
                sig = await scope.wait(count)
                # Not reaped before the teardown: a pid without a return code is still ours.
                ranks = [
                    w.local_rank
                    for w in self._workers
                    if w.returncode is None and _platform.signal_process(w.pid, sig)
                ]
                logger.info("%s forwarded to local ranks %s of %r", sig.name, ranks, self._name)
