"""What a group of workers shows of itself, besides its lifecycle.

:class:`~._pcontext.PContext` holds the lifecycle (enter, wait, stop, close); what a
caller reads or subscribes to along the way (its name and size, its workers' pids, their
output, their stacks, when they last wrote) and the two hooks an agent sets before the
group is entered are here, as the class it derives from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..hangs._guard import HangGuard
from ..hangs._stall import StallTeller
from ..output._stream import DEFAULT_BUFFER, OutputHub, OutputItem, OutputStream
from ..worker._process import WorkerProcess
from ._starting import OutputTarget
from ._validate import GroupSpec

__all__ = ["GroupViews"]


class GroupViews:
    """The name, size, pids, output and stacks of a group; PContext's base.

    It reads the group's state, set by :class:`~._pcontext.PContext`.
    """

    _spec: GroupSpec
    _workers: list[WorkerProcess]
    _output: OutputTarget
    _hangs: HangGuard
    _stall_teller: StallTeller | None

    @property
    def name(self) -> str:
        """The group's name (used in log prefixes and failure reports)."""
        return self._spec.name

    @property
    def nprocs(self) -> int:
        """Number of local workers."""
        return self._spec.nprocs

    def pids(self) -> dict[int, int]:
        """Pid of each started worker, by local rank."""
        return {w.local_rank: w.pid for w in self._ranked()}

    def output(
        self, *, replay: bool = True, buffer: int = DEFAULT_BUFFER
    ) -> OutputStream[OutputItem]:
        """Subscribe to the workers' output: every line and progress frame, live.

        ``async for item in ctx.output():`` yields an :class:`OutputItem` per line (or
        ``\\r`` frame) of every rank and stream, in the order each rank wrote them, whether
        or not the streams are redirected or tee'd, and ends once every worker's streams
        ended (the workers and their children exited, or the group was closed).
        Subscribe before or after ``async with`` is entered; any number of subscribers
        may read side by side.

        Args:
            replay: Start with what the workers wrote before this call (as much as the
                bounded history holds; ``missed`` on the first item counts what it no
                longer holds). ``False``: only what is written from now on.
            buffer: Items this subscriber may fall behind by; when more arrive, the oldest
                are dropped and the next item's ``missed`` says how many (the log files
                still hold everything). Reading slowly never slows the workers.

        Raises:
            ValueError: ``buffer`` is not a positive number of items.
        """
        return self._output.hub.subscribe(replay=replay, buffer=buffer)

    def share_output(self, hub: OutputHub, ranks: Mapping[int, int], attempt: int) -> None:
        """Publish into ``hub`` (an agent's, spanning attempts) instead of a hub of our own.

        Items then carry the global rank (``ranks``, by local rank) and ``attempt``. Call
        before the group is entered.
        """
        self._output = OutputTarget(hub, ranks, attempt, owned=False)

    def tell_stalls_with(self, teller: StallTeller) -> None:
        """Have ``teller`` make the text printed when the group stalls (``stall_timeout``).

        An elastic agent tells the stacks of every rank of the job this way, not only of
        this group's. ``teller`` is awaited with the group's :class:`StallReport` before
        the group is stopped, for at most ``STALL_TELL_TIMEOUT`` seconds; past that, or if
        it raises, the group's own report is printed. Call before the group is entered.
        """
        self._stall_teller = teller

    def _ranked(self) -> list[WorkerProcess]:
        return sorted(self._workers, key=lambda w: w.local_rank)

    async def dump_stacks(self, timeout: float | None = None) -> dict[int, str]:
        """Every thread's Python stack of each running worker, without stopping them.

        Returns ``{local_rank: text}``; a worker that does not answer within ``timeout``
        seconds (5 by default) maps to a line saying so. See docs/hangs.md.
        """
        running = {w.local_rank: w.pid for w in self._ranked() if w.returncode is None}
        return await self._hangs.dump_stacks(running, timeout)

    def last_output_times(self) -> dict[int, float]:
        """When each running worker last wrote output (``time.time()``), for metrics."""
        offset = time.time() - time.monotonic()
        found = {}
        for worker in self._ranked():
            times = [p.last_output for p in (worker.stdout, worker.stderr)]
            latest = max((t for t in times if t is not None), default=None)
            if worker.returncode is None and latest is not None:
                found[worker.local_rank] = latest + offset
        return found
