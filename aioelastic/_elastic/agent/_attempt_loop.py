"""The attempt loop: join a round, run its attempt, then end the run or go round again.

`AttemptLoop.run` is the agent's run once its rendezvous, metrics and signal handling are
open. Each turn joins the next rendezvous round and takes the round's worker ranks, runs
one `Attempt` (`._attempt`), and then:

* ends the run when the workers succeeded (after the exit barrier), or when, after a
  failure, the restart budget gives up (`RestartBudget.decide`, in `._budget`: where a
  restart is decided);
* else goes round again: a failure here or on another node spends a restart (and waits
  for its backoff), a membership change spends none (`RestartBudget.restart`).
"""

from __future__ import annotations

import anyio

from ..._core.aio._signals import SignalScope
from ..._core.output._stream import OutputHub
from ..._core.reports._results import RunProcsResult
from ..observe._events import GroupRestarting, RendezvousCompleted, RunSucceeded
from ..rendezvous._node import NodeRendezvous, RendezvousOutcome
from ..settings._config import AgentConfig
from ._attempt import Attempt
from ._budget import RestartBudget
from ._emitter import Emitter
from ._reports import Reports
from ._types import RunResult, Worker, WorkerGroup, WorkerState

__all__ = ["AttemptLoop"]


class AttemptLoop:
    """The agent's attempts, one after the other (see the module documentation).

    Args:
        group: the worker group, given each round's ranks.
        config: the agent's settings.
        budget: the run's restarts.
        emitter: where the events go.
        output: the agent's output hub, spanning attempts.
        reports: the agent's stack and stall reports (and its log root).
    """

    def __init__(
        self,
        group: WorkerGroup,
        config: AgentConfig,
        budget: RestartBudget,
        emitter: Emitter,
        output: OutputHub,
        reports: Reports,
    ) -> None:
        self._group = group
        self._spec = group.spec
        self._config = config
        self._budget = budget
        self._emitter = emitter
        self._output = output
        self._reports = reports
        #: The attempt from its round's rendezvous to its settling, None in between.
        self.running: Attempt | None = None

    async def run(self, rdzv: NodeRendezvous, signals: SignalScope | None) -> RunResult:
        """Attempt after attempt until one succeeds or the restart budget gives up."""
        group = self._group
        while True:
            joined = await self._join(rdzv)
            if joined is None:
                # A spare node the job never needed: torch ends it quietly, and so do we.
                group.state = WorkerState.SUCCEEDED
                self._emitter.emit(RunSucceeded, global_ranks=())
                return RunResult(WorkerState.SUCCEEDED)
            attempt = self.running = self._attempt(rdzv, joined, signals)
            try:
                watched = await attempt.run()
                failed = await attempt.settle(watched) if watched.failed else None
            finally:
                self.running = None
                if joined.channel is not None:
                    joined.channel.close()
            if isinstance(watched.outcome, RunProcsResult) and watched.succeeded:
                return await self._succeeded(rdzv, watched.outcome)
            if failed is not None:
                return failed
            reason = watched.stop_reason
            delay = self._budget.restart(reason, self._spec.restart_backoff)
            self._emitter.emit(
                GroupRestarting,
                reason=reason,
                delay=delay,
                restarts_left=self._budget.remaining,
            )
            if delay > 0:
                await anyio.sleep(delay)

    async def _succeeded(self, rdzv: NodeRendezvous, outcome: RunProcsResult) -> RunResult:
        """Every local worker succeeded: the run's result, once every node finished."""
        group = self._group
        group.state = WorkerState.SUCCEEDED
        await rdzv.exit_barrier(self._config.exit_barrier_timeout)
        values = {group.workers[lr].global_rank: v for lr, v in outcome.return_values.items()}
        self._emitter.emit(RunSucceeded, global_ranks=tuple(sorted(values)))
        return RunResult(WorkerState.SUCCEEDED, return_values=values)

    def _attempt(
        self, rdzv: NodeRendezvous, joined: RendezvousOutcome, signals: SignalScope | None
    ) -> Attempt:
        """The attempt of the round ``joined``."""
        assert self._reports.log_root is not None
        return Attempt(
            group=self._group,
            config=self._config,
            budget=self._budget,
            emitter=self._emitter,
            output=self._output,
            rdzv=rdzv,
            channel=joined.channel,
            log_root=self._reports.log_root,
            signals=signals,
            tell_stall=self._reports.stall,
            capture=self._reports.capture,
        )

    async def _join(self, rdzv: NodeRendezvous) -> RendezvousOutcome | None:
        """Join the next round and take its ranks; None when this node is not needed."""
        spec = self._spec
        group = self._group
        # A fixed port without an address is torchrun's static single node: 127.0.0.1.
        master_addr = spec.master_addr
        if master_addr is None and spec.master_port is not None:
            master_addr = "127.0.0.1"
        outcome = await rdzv.next_rendezvous(
            spec.role, spec.local_world_size, master_addr=master_addr, master_port=spec.master_port
        )
        if outcome is None:
            return None
        self._budget.agree(outcome.restart_count)
        group.store = outcome.store
        group.group_rank = outcome.group_rank
        group.group_world_size = outcome.group_world_size
        group.master_addr = outcome.master_addr
        group.master_port = outcome.master_port
        group.workers = [
            Worker(
                local_rank=lr,
                global_rank=outcome.base_global_rank + lr,
                role_rank=outcome.base_role_rank + lr,
                world_size=outcome.world_size,
                role_world_size=outcome.role_world_size,
            )
            for lr in range(spec.local_world_size)
        ]
        self._emitter.emit(
            RendezvousCompleted,
            group_rank=outcome.group_rank,
            group_world_size=outcome.group_world_size,
            world_size=outcome.world_size,
            master_addr=outcome.master_addr,
            master_port=outcome.master_port,
            global_ranks=tuple(w.global_rank for w in group.workers),
        )
        return outcome
