"""What this node reports beyond its events: stacks, stalls, and the files it keeps of them.

* ``kill -URG`` on the launcher (`Reports.dump_stacks`): on several nodes every rank's stack
  across the job, grouped (`JobStacks`); on one node each local rank's stack.
* a stall of the local workers (`Reports.stall`): the stall's head and every rank's stack
  across the job, the stacks of the other nodes asked for through the store.
* ``agent.job_stacks()`` (`Reports.job_stacks`): the grouped report itself.

A report is also kept in the log root as ``stacks-<time>.txt`` or ``stall-<time>.txt``
(`Reports.keep`). The log root is opened by the agent's run (`open_log_root`): a directory
that holds no attempt of an earlier run, or a fresh temporary one, removed at the end if it
received no file (`drop_if_empty`).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

from ..._core.hangs._stall import StallReport
from ..._core.output import _log_root as log_root
from ..channel._job_stacks import JobStacks, RankStack
from ._attempt import Attempt
from ._types import WorkerGroup

__all__ = ["Reports", "drop_if_empty", "open_log_root"]

logger = logging.getLogger("aioelastic.agent")


class Reports:
    """This node's stack and stall reports, about the attempt running when asked.

    Args:
        group: the worker group (the running workers' global ranks).
        running: the attempt running now, None between attempts.
    """

    def __init__(self, group: WorkerGroup, running: Callable[[], Attempt | None]) -> None:
        self._group = group
        self._running = running
        #: Where reports are kept: the agent's log root once its run opened it.
        self.log_root: Path | None = None

    async def dump_stacks(self) -> str | dict[int, str]:
        """``kill -URG`` on the agent: every rank's stacks across the job (docs/hangs.md).

        On several nodes the grouped report, also written to the log directory
        (``stacks-<time>.txt``); on one node each local rank's stack, as before.
        """
        attempt = self._running()
        channel = attempt.channel if attempt is not None else None
        ctx = attempt.ctx if attempt is not None else None
        if channel is None or channel.nodes == 1:
            return await ctx.dump_stacks() if ctx is not None else {}
        return self.keep("stacks", (await self.job_stacks()).format())

    async def stall(self, stall: StallReport) -> str:
        """This node's workers stalled: the report with every rank's stack across the job.

        The stacks this node took when it found the stall, and those of every other node,
        asked for through the store as for ``kill -URG`` (a node that does not answer
        within `STACKS_TIMEOUT` seconds is named); on one node, its own ranks grouped the
        same way. Ranks are global. Also written to the log directory (``stall-<time>.txt``).
        """
        attempt = self._running()
        workers = self._group.workers
        ctx = attempt.ctx if attempt is not None else None
        pids = ctx.pids() if ctx is not None else {}
        own = [
            (workers[lr].global_rank, pids.get(lr, -1), text)
            for lr, text in sorted(stall.stacks.items())
        ]

        async def taken() -> list[tuple[int, int, str]]:
            return own

        channel = attempt.channel if attempt is not None else None
        if channel is not None and channel.nodes > 1:
            stacks = await channel.gather_stacks(taken)
        else:
            node = self._group.group_rank or 0
            host = channel.host if channel is not None else socket.gethostname()
            stacks = JobStacks(tuple(RankStack(r, node, host, pid, t) for r, pid, t in own))
        ranks = [
            dataclasses.replace(activity, rank=workers[activity.rank].global_rank)
            for activity in stall.ranks
        ]
        text = dataclasses.replace(stall, ranks=ranks).head() + stacks.format()
        return self.keep("stall", text)

    async def job_stacks(self) -> JobStacks:
        """Every running rank's stack on every node of the job, grouped (`JobStacks`).

        See `LocalElasticAgent.job_stacks`.
        """
        attempt = self._running()
        if attempt is not None and attempt.channel is not None and attempt.ctx is not None:
            return await attempt.channel.gather_stacks(self.capture)
        stacks = [
            RankStack(rank, self._group.group_rank or 0, socket.gethostname(), pid, text)
            for rank, pid, text in await self.capture()
        ]
        return JobStacks(tuple(stacks))

    async def capture(self) -> list[tuple[int, int, str]]:
        """This node's running workers' stacks: ``[(global rank, pid, text), ...]``."""
        attempt = self._running()
        ctx = attempt.ctx if attempt is not None else None
        if ctx is None:
            return []
        workers = self._group.workers
        pids = ctx.pids()
        stacks = await ctx.dump_stacks()
        return [
            (workers[lr].global_rank, pids.get(lr, -1), text) for lr, text in sorted(stacks.items())
        ]

    def keep(self, kind: str, report: str) -> str:
        """``report``, also written to the log root as ``{kind}-<time>.txt`` (it says where)."""
        if self.log_root is None:
            return report
        name = time.strftime(f"{kind}-%Y%m%d-%H%M%S.txt")
        try:
            (self.log_root / name).write_text(report)
        except OSError as e:
            return report + f"(not written to {self.log_root}: {e})\n"
        return report + f"(also in {self.log_root / name})\n"


def open_log_root(log_dir: Path | None, role: str) -> Path:
    """The run's log root: ``log_dir`` (made if missing), or a fresh temporary directory.

    Raises:
        ValueError: ``log_dir`` is a file, or holds an attempt of an earlier run.
    """
    if log_dir is None:
        root = log_root.make_temporary(role)
        logger.info("agent logs are in %s", root)
        return root
    if log_dir.exists() and not log_dir.is_dir():
        raise ValueError(f"log_dir={str(log_dir)!r} is a file; give a directory")
    if log_dir.is_dir():
        taken = sorted(p.name for p in log_dir.iterdir() if p.name.startswith("attempt_"))
        if taken:
            raise ValueError(
                f"log_dir={str(log_dir)!r} already holds {taken[0]} of an earlier run; an "
                "agent never overwrites logs: give each run a new log_dir"
            )
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


def drop_if_empty(log_dir: Path | None, root: Path | None, role: str) -> None:
    """Remove a temporary log root that received no file (see `_core.output._log_root`)."""
    if log_dir is None and root is not None:
        log_root.remove_if_empty(root, f"agent {role!r}")
