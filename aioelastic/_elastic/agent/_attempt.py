"""One attempt of this node's workers: their environment, their start, the watch, the stop,
and what the attempt's end settles.

An `Attempt` is made after each completed rendezvous, with the round's ranks already in
the worker group. `Attempt.run` builds each worker's environment (`worker_env`), starts the
group through the core's `start_processes` in its own ``attempt_{n}`` log directory, and
watches it (`watch_attempt`) until the group's outcome, another node's end or a membership
change; then it stops the group through the core's teardown (``ctx.close()``: the agent
never signals a worker itself). An `Interruption` (a signal, a cancellation, an error of
the agent's) stops the group too, the other nodes told first. After a failed attempt
`Attempt.settle` gathers the failures and the job's root cause and asks the restart budget
(`RestartBudget.decide`, in `._budget`) whether the run restarts or ends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from signal import Signals

import anyio

from ..._core.aio._signals import SignalScope
from ..._core.group._pcontext import PContext
from ..._core.group._processes import start_processes
from ..._core.hangs._stall import StallTeller
from ..._core.output._stream import OutputHub
from ..._core.reports._failures import ProcessFailure
from ..._core.reports._results import RunProcsResult
from ..channel._attempt_end import AttemptEnd, end_of_failure
from ..channel._job_channel import JobChannel
from ..channel._stack_gathering import Capture
from ..observe._events import (
    EndReason,
    GroupStopping,
    RunFailed,
    StopReason,
    WorkersStarted,
)
from ..rendezvous._node import NodeRendezvous
from ..settings._config import AgentConfig
from ._budget import RestartBudget
from ._emitter import Emitter
from ._env import worker_env
from ._types import RunResult, WorkerGroup, WorkerState, substitute_local_rank
from ._watch import MembershipChange, PeerEnded, Watched, watch_attempt

__all__ = ["Attempt", "Interruption"]


@dataclass(frozen=True)
class Interruption:
    """Why this node stops an attempt whose workers still run: not their outcome.

    Attributes:
        reason: `StopReason.SIGNAL`, `StopReason.CANCELLED` or `StopReason.ERROR`.
        signal: the signal that stopped the run, when one did.
        detail: the signal's name, or the agent's error (``"ValueError: ..."``).
    """

    reason: StopReason
    signal: Signals | None = None
    detail: str = ""

    @classmethod
    def of(cls, error: BaseException, first_signal: Signals | None) -> Interruption:
        """What ``error``, raised into the watch, means (``first_signal``: a signal came)."""
        if first_signal is not None:
            return cls(StopReason.SIGNAL, first_signal, first_signal.name)
        if isinstance(error, anyio.get_cancelled_exc_class()):
            return cls(StopReason.CANCELLED)
        return cls(StopReason.ERROR, detail=f"{type(error).__name__}: {error}")

    def end_of(self, node: int, host: str) -> AttemptEnd:
        """What the other nodes are told: node ``node`` (at ``host``) ended the attempt."""
        return AttemptEnd(
            node=node,
            host=host,
            reason=self.reason.end_reason,
            detail=self.detail,
            exitcode=-self.signal.value if self.signal is not None else 1,
            timestamp=time.time(),
        )


class Attempt:
    """One attempt of this node's workers, from its rendezvous to its settling.

    Args:
        group: the worker group, with the round's ranks.
        config: the agent's settings.
        budget: the run's restarts (read for this attempt's number and restart count).
        emitter: where the attempt's events go.
        output: the agent's output hub, spanning attempts.
        rdzv: the rendezvous the attempt came from.
        channel: the round's channel to the other nodes, None without a store.
        log_root: the agent's log root; the attempt logs to ``attempt_{n}`` in it.
        signals: the agent's signal handling while ``run()`` runs, if any.
        tell_stall: makes the report of a stall of these workers (the job's stacks).
        capture: this node's stacks, for another node that asks for the job's.
    """

    def __init__(
        self,
        *,
        group: WorkerGroup,
        config: AgentConfig,
        budget: RestartBudget,
        emitter: Emitter,
        output: OutputHub,
        rdzv: NodeRendezvous,
        channel: JobChannel | None,
        log_root: Path,
        signals: SignalScope | None,
        tell_stall: StallTeller,
        capture: Capture,
    ) -> None:
        self._group = group
        self._spec = group.spec
        self._config = config
        self._budget = budget
        self._attempt = budget.attempt
        self._restart_count = budget.restart_count
        self._emitter = emitter
        self._output = output
        self._rdzv = rdzv
        self._log_root = log_root
        self._signals = signals
        self._tell_stall = tell_stall
        self._capture = capture
        #: The round's channel to the other nodes, None without a store.
        self.channel = channel
        #: The attempt's group while it runs.
        self.ctx: PContext | None = None

    async def run(self) -> Watched:
        """Start the workers, watch them, stop them; what the watch saw.

        Raises:
            BaseException: what interrupted the watch (a cancellation, a signal's, an error
                of the agent's), once the workers are stopped and the other nodes told.
        """
        group = self._group
        ctx = self._start(self._rdzv)
        self._output.new_attempt()
        ctx.tell_stalls_with(self._tell_stall)
        ctx.share_output(
            self._output,
            {w.local_rank: w.global_rank for w in group.workers},
            self._restart_count,
        )
        self.ctx = ctx
        try:
            if self.channel is not None:
                await self.channel.open()
            async with ctx:
                self._started(ctx)
                try:
                    watched = await watch_attempt(
                        ctx,
                        self._rdzv,
                        self._spec.monitor_interval,
                        self.channel,
                        self.end_of,
                        self._capture,
                    )
                except BaseException as e:
                    # Whatever ends the watch early, KeyboardInterrupt or SystemExit raised
                    # in the loop's thread included, still owes the other nodes why this one
                    # leaves and the workers the signal the launcher got; re-raised as is.
                    await self._interrupted(ctx, Interruption.of(e, self._first_signal()))
                    raise
                return await self._stopped(ctx, watched)
        finally:
            self.ctx = None
            for worker in group.workers:
                worker.id = None

    def _start(self, rdzv: NodeRendezvous) -> PContext:
        """The attempt's group, made (``async with`` starts it)."""
        spec = self._spec
        group = self._group
        envs = {
            w.local_rank: worker_env(
                group,
                w,
                restart_count=self._restart_count,
                run_id=rdzv.run_id,
                use_agent_store=rdzv.use_agent_store,
                signals_to_handle=self._config.exported_signals,
            )
            for w in group.workers
        }
        ctx = start_processes(
            name=spec.role,
            entrypoint=spec.entrypoint,
            args={
                w.local_rank: substitute_local_rank(spec.args, w.local_rank) for w in group.workers
            },
            envs=envs,
            log_dir=self._log_root / f"attempt_{self._attempt}",
            start_method=self._config.start_method,
            options=self._config.options,
        )
        return ctx

    def _started(self, ctx: PContext) -> None:
        group = self._group
        for lr, pid in ctx.pids().items():
            group.workers[lr].id = pid
        group.state = WorkerState.HEALTHY
        self._emitter.emit(
            WorkersStarted,
            pids={group.workers[lr].global_rank: p for lr, p in ctx.pids().items()},
        )

    def _first_signal(self) -> Signals | None:
        return self._signals.first if self._signals is not None else None

    async def _interrupted(self, ctx: PContext, interruption: Interruption) -> None:
        """Stop the workers for ``interruption``, the other nodes told first."""
        self._emitter.emit(GroupStopping, reason=interruption.reason, detail=interruption.detail)
        channel = self.channel
        end = None
        if channel is not None:
            with anyio.CancelScope(shield=True):
                end = await channel.end(interruption.end_of(self._node(), channel.host), 2.0)
        # A signal that came while the other nodes were told counts too.
        signum = interruption.signal or self._first_signal()
        if signum is not None:
            # As torchrun: the workers get the signal the launcher received (Ctrl-C
            # arrives as SIGINT, a checkpointing SIGUSR1 as SIGUSR1).
            await ctx.close(death_sig=signum)
        if channel is not None and end is not None:
            await ctx.close()
            with anyio.CancelScope(shield=True):
                await channel.linger(end, 2.0)

    async def _stopped(self, ctx: PContext, watched: Watched) -> Watched:
        """Stop the workers after the watch saw ``watched``; it, with the cause read again."""
        group = self._group
        channel = self.channel
        outcome = watched.outcome
        if isinstance(outcome, MembershipChange):
            detail = f"{outcome.nodes_waiting} node(s) waiting to join"
            self._emitter.emit(GroupStopping, reason=watched.stop_reason, detail=detail)
        elif isinstance(outcome, PeerEnded):
            detail = outcome.cause.describe()
            self._emitter.emit(GroupStopping, reason=watched.stop_reason, detail=detail)
        elif outcome.is_failed():
            for lr, failure in sorted(outcome.failures.items(), key=lambda i: i[1].timestamp):
                self._emitter.worker_failed(group.workers[lr].global_rank, lr, failure)
            self._emitter.emit(GroupStopping, reason=watched.stop_reason)
        elif channel is not None:
            await channel.finish()
        await ctx.close()
        if not watched.succeeded:
            group.state = WorkerState.STOPPED
        if channel is not None and watched.cause is not None:
            # Read again once stopped: another node's end that came after this
            # one's may be final (an exit code it never retries).
            watched.cause = await channel.cause(watched.cause)
        return watched

    def end_of(self, failures: Mapping[int, ProcessFailure]) -> AttemptEnd:
        """What the other nodes are told when this node's workers failed (by local rank)."""
        group = self._group
        assert self.channel is not None
        local_rank, failure = min(failures.items(), key=lambda i: (i[1].timestamp, i[0]))
        final = (
            any(f.exitcode in self._spec.no_retry_exit_codes for f in failures.values())
            or self._budget.exhausted
        )
        return end_of_failure(
            self._node(),
            self.channel.host,
            group.workers[local_rank].global_rank,
            local_rank,
            failure,
            final=final,
        )

    def _node(self) -> int:
        return self._group.group_rank or 0

    async def settle(self, watched: Watched) -> RunResult | None:
        """After a failed attempt: the run's failed result, or ``None`` to restart.

        The decision is the restart budget's (`RestartBudget.decide`); here the failures
        and the job's root cause are gathered for it, and a node that leaves the job
        waits until the others heard why.
        """
        group = self._group
        failures, fatal, cause = self._failures(watched)
        elsewhere = cause is not None and (
            cause.node != group.group_rank or cause.reason is not EndReason.WORKER_FAILED
        )
        if cause is not None:
            self._rdzv.attempt_ended(cause)
            if elsewhere:
                # Another node's end is the root cause: the report leads with it.
                failures[cause.rank if cause.rank is not None else -1] = cause.as_failure()
        give_up = self._budget.decide(fatal, cause, elsewhere)
        if give_up is None:
            return None
        group.state = WorkerState.FAILED
        if self.channel is not None and cause is not None:
            # This node leaves the job: not before the others know why (it may host
            # the store they read it from).
            await self.channel.linger(cause)
        self._emitter.emit(
            RunFailed, reason=give_up.reason, failures=failures, detail=give_up.detail
        )
        return RunResult(WorkerState.FAILED, failures=failures)

    def _failures(
        self, watched: Watched
    ) -> tuple[dict[int, ProcessFailure], ProcessFailure | None, AttemptEnd | None]:
        """The failures by global rank, the first never retried, and the root cause."""
        outcome = watched.outcome
        if isinstance(outcome, PeerEnded):
            return {}, None, outcome.cause
        assert isinstance(outcome, RunProcsResult)
        failures = {self._group.workers[lr].global_rank: f for lr, f in outcome.failures.items()}
        if self.channel is not None:
            # Named as the other nodes name this one (--local-addr), in every report.
            for failure in failures.values():
                failure.host = failure.host or self.channel.host
        retried_never = self._spec.no_retry_exit_codes
        fatal = [f for f in failures.values() if f.exitcode in retried_never]
        return failures, (fatal[0] if fatal else None), watched.cause
