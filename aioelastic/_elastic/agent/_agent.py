"""The elastic agent: rendezvous, start the local workers, watch them, restart them.

One agent runs per node. Each attempt goes: join a rendezvous round through torch's handler
(`._rdzv_node`), agree on worker ranks, start the local workers as one group through the
core's `start_processes` (its own ``attempt_{n}`` log directory), then wait for whichever
comes first:

* the group's outcome (``ctx.wait()``, which returns the moment every worker succeeded or
  the first one failed, already stopped siblings included): success ends the run after the
  exit barrier; a failure restarts the group if restarts are left;
* a node waiting to join (``num_nodes_waiting() > 0``): the group is stopped and everyone
  re-rendezvouses, without using a restart. This is the one thing checked periodically,
  every ``monitor_interval``, because torch's rendezvous state lives in a store that has
  no notifications (`._agent_watch`).

Stopping is always the core's teardown (``ctx.close()``); the agent never signals a
worker itself.

Differences from torch's ``LocalElasticAgent`` that matter: failures and success are acted
on when the exit is seen instead of on the next ``monitor_interval`` tick; every attempt,
membership changes included, logs to a new directory and none is ever deleted; optional
backoff between restarts (`RestartBackoff`) and exit codes that are never retried
(``no_retry_exit_codes``); the exit barrier timeout is a constructor argument that
`elastic_launch` exposes; signals are handled only for the run's duration and a second
one skips the grace period; lifecycle events (`events`).

The types the agent runs and reports (`WorkerSpec`, `WorkerGroup`, `RunResult`, ...) are
in `._agent_types`; each worker's environment is built by `._agent_env`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from ..._core.aio._backend import require_asyncio
from ..._core.aio._signals import SignalReceived, SignalScope, handle_signals
from ..._core.group._options import GroupOptions, keyword_signature
from ..._core.group._pcontext import PContext
from ..._core.group._processes import start_processes
from ..._core.hangs._guard import stack_requests
from ..._core.hangs._stall import StallReport
from ..._core.output import _log_root as log_root
from ..._core.output._std import Std
from ..._core.output._stream import DEFAULT_BUFFER, OutputHub, OutputItem, OutputStream
from ..._core.process._exit_status import signal_text
from ..._core.reports._failures import ProcessFailure
from ..._core.reports._results import RunProcsResult
from ..channel._job_channel import AttemptEnd, EndReason, JobChannel, end_of_failure
from ..channel._job_stacks import JobStacks, RankStack
from ..observe._event_hub import EventHub
from ..observe._events import (
    AgentEvent,
    EventStream,
    FailureReason,
    GroupRestarting,
    GroupStopping,
    RendezvousCompleted,
    RunFailed,
    RunSucceeded,
    StopReason,
    WorkerFailed,
    WorkersStarted,
)
from ..observe._metrics import observed
from ..rendezvous._node import LocalRendezvous, NodeRendezvous, Rendezvous
from ..settings._config import AgentConfig
from ._env import worker_env
from ._types import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
    substitute_local_rank,
)
from ._watch import MembershipChange, PeerEnded, Watched, watch_attempt

__all__ = ["LocalElasticAgent"]

logger = logging.getLogger("aioelastic.agent")


class LocalElasticAgent:
    """Runs this node's workers through rendezvous, failures and membership changes.

    Example::

        spec = WorkerSpec(role="trainer", local_world_size=4, entrypoint=train,
                          args=("--epochs", "3"), max_restarts=3)
        agent = LocalElasticAgent(spec, start_method="forkserver", log_dir="/tmp/run1")
        result = await agent.run()
        if result.is_failed():
            ...  # result.failures: {global_rank: ProcessFailure}

    Args:
        spec: what to run.
        start_method: ``spawn``, ``fork`` or ``forkserver`` for function workers.
        log_dir: root of the logs; attempt ``n`` writes
            ``{log_dir}/attempt_{n}/{local_rank}/{stdout.log,stderr.log,error.json}``. A
            fresh temporary directory when None (see `log_dir`). Must hold no attempt yet.
        redirects: streams written to log files (`Std`, or per local rank).
        tee: streams also shown on the console with a ``[{role}{local_rank}]:`` prefix.
        shutdown_timeout: grace period, seconds, between SIGTERM and SIGKILL when the
            agent stops its workers.
        exit_barrier_timeout: after its workers succeeded, how long the agent waits for
            the other nodes to finish theirs (torch's barrier; torch hard-codes 300 s
            for torchrun).
        signals_to_handle: signals that stop the run, as torch names them
            (``"SIGTERM,SIGINT,SIGHUP,SIGQUIT"``); ``""`` handles none (a host program
            that handles signals itself; cancel ``run()`` instead). ``None``: torch's
            ``TORCHELASTIC_SIGNALS_TO_HANDLE`` from the environment, else that default.
            When given it is also exported to workers, as torchrun does. On the first
            signal the workers get that same signal and the grace period; a second one SIGKILLs
            them at once; ``run()`` then raises `SignalReceived` (``exit_code`` is
            ``128 + N``). Handlers are installed only while ``run()`` runs, only on the
            main thread, and the previous ones are restored.
        run_id: the job id of the single-node rendezvous the agent makes itself when the
            spec has no ``rdzv_handler`` (default: a fresh UUID; ``"none"`` with
            ``master_port``, torchrun's default).
        metrics_port: serve Prometheus metrics and ``/health`` on this port (0: any free
            one) at ``metrics_host`` while ``run()`` runs; needs ``aioelastic[metrics]``.
        metrics_host: the address the metrics and health ports bind (loopback by default).
        options: the options of each attempt's group of workers, a `GroupOptions`:
            whenever the agent stops its workers (a failure, a signal, a restart) it is
            with their grace period and stop order; a stall is a failure like any other,
            restarted per ``max_restarts``, every rank's stack in its failure
            (``TORCHELASTIC_HEALTH_CHECK_PORT`` serves a liveness answer, docs/hangs.md);
            the console filters take global ranks across nodes; each node collapses its
            own ranks' lines; restarts reuse the warm fork server.
        **group_options: any field of `GroupOptions` by torch's name for it
            (``log_line_prefix_template``, the console filters, ``forkserver_preload``,
            ``stall_timeout``...), as before the record existed; ``redirects``, ``tee``
            and ``shutdown_timeout`` (its grace period) above are fields of it too. A
            value at its default leaves the field of ``options``; a field set differently
            in both places is a TypeError.

    Without a ``rdzv_handler`` the agent runs one node: torchrun's ``--standalone`` (torch's
    ``c10d`` on ``localhost:0``, the agent hosting the workers' store), or ``static`` at
    ``master_port`` when that is given. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    (torch's switch: workers host their own store) or without torch installed it needs no
    store, and so no torch at all: see `LocalRendezvous`.

    Raises:
        ValueError, TypeError: on misuse, naming the bad value.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        start_method: str = "spawn",
        log_dir: str | os.PathLike[str] | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        shutdown_timeout: float = 30.0,
        *,
        exit_barrier_timeout: float = 300.0,
        signals_to_handle: str | None = None,
        run_id: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        options: GroupOptions | None = None,
        _event_hub: EventHub | None = None,
        _config: AgentConfig | None = None,
        **group_options: Any,
    ) -> None:
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec must be an aioelastic WorkerSpec, got {type(spec).__name__}")
        # Checked now, not after a rendezvous that peers would then wait on in vain.
        self._config = _config or AgentConfig.build(
            nprocs=spec.local_world_size,
            start_method=start_method,
            log_dir=log_dir,
            exit_barrier_timeout=exit_barrier_timeout,
            signals_to_handle=signals_to_handle,
            run_id=run_id,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            options=options,
            redirects=redirects,
            tee=tee,
            shutdown_timeout=shutdown_timeout,
            **group_options,
        )
        self._spec = spec
        self._group = WorkerGroup(spec)
        # elastic_launch hands in its own hub: its subscribers exist before the agent does.
        self._hub = EventHub() if _event_hub is None else _event_hub
        self._output = OutputHub()
        self._log_root: Path | None = None
        self._ctx: PContext | None = None
        self._channel: JobChannel | None = None
        self._signal_scope: SignalScope | None = None
        self._started = False
        self._remaining_restarts = spec.max_restarts
        self._restart_count = 0
        self._attempt = 0
        self._run_id = ""

    # help() shows the options' keyword arguments, which come from GroupOptions' table.
    setattr(  # noqa: B010  (a function's __signature__ is not known to type checkers)
        __init__,
        "__signature__",
        keyword_signature(__init__, torch=True, skip=("redirects", "tee", "shutdown_timeout")),
    )

    # -- public surface ----------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"<LocalElasticAgent role={self._spec.role!r} "
            f"local_world_size={self._spec.local_world_size} "
            f"state={self._group.state.name} restarts={self._restart_count}>"
        )

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The worker group (a live object: its state and workers change as the run goes)."""
        return self._group

    def events(self) -> EventStream:
        """Subscribe to this agent's lifecycle events (see `aioelastic._elastic.observe._events`).

        Call it before ``run()`` to see every event; the iteration ends after the run's
        last event. Each call makes an independent subscriber.
        """
        return self._hub.subscribe()

    def output(
        self, *, replay: bool = True, buffer: int = DEFAULT_BUFFER
    ) -> OutputStream[OutputItem]:
        """Subscribe to the workers' output across attempts (see `PContext.output`).

        Items carry the worker's global ``rank`` and the ``attempt`` (its restart count).
        With ``replay``, a subscriber starts with the current attempt's output still held.
        The iteration ends after the run's last output.
        """
        return self._output.subscribe(replay=replay, buffer=buffer)

    def timeline(
        self, *, replay: bool = True, buffer: int = DEFAULT_BUFFER
    ) -> OutputStream[OutputItem | AgentEvent]:
        """:meth:`output` and the lifecycle events of :meth:`events`, in one stream.

        For a consumer that wants one timeline (a log view that shows "worker 1 failed,
        restarting" between the lines): events arrive in the order they happened
        relative to the output, and are never dropped for a slow reader.
        """
        return self._output.subscribe(replay=replay, buffer=buffer, events=True)

    @property
    def log_dir(self) -> Path | None:
        """The log root in use: ``log_dir``, or the temporary one made by ``run()``."""
        return self._log_root

    async def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers until they succeed, or fail with no restart left.

        Args:
            role: accepted for torch compatibility; the spec's role is used.

        Returns:
            `RunResult`: ``SUCCEEDED`` with return values, or ``FAILED`` with failures,
            keyed by global rank.

        Raises:
            SignalReceived: a handled signal stopped the run (workers already stopped);
                ``exit_code`` is ``128 + N``.
            RendezvousError: torch's, when a rendezvous fails (timeout, closed).
            RuntimeError: ``run()`` was already called on this agent.
        """
        if self._started:
            raise RuntimeError("this agent already ran; make a new LocalElasticAgent")
        require_asyncio("LocalElasticAgent.run()")
        self._started = True
        try:
            self._prepare_log_root()
            async with AsyncExitStack() as stack:
                rdzv = await self._open_rendezvous()
                stack.push_async_callback(rdzv.aclose)
                self._run_id = rdzv.run_id
                config = self._config
                await stack.enter_async_context(
                    observed(
                        self.events(),
                        metrics_port=config.metrics_port,
                        health_port=config.health_port,
                        host=config.metrics_host,
                        last_output=lambda: self._ctx.last_output_times() if self._ctx else {},
                    )
                )
                await stack.enter_async_context(stack_requests(self._dump_stacks))
                if not self._config.signals:
                    return await self._invoke_run(rdzv)
                scope = await stack.enter_async_context(handle_signals(self._config.signals))
                self._signal_scope = scope
                await stack.enter_async_context(scope.escalate(self._kill_now))
                return await scope.run_until_signal(self._invoke_run(rdzv))
        except SignalReceived as e:
            self._group.state = WorkerState.STOPPED
            self._emit(RunFailed, reason=FailureReason.SIGNAL, detail=signal_text(e.signum))
            raise
        except anyio.get_cancelled_exc_class():
            self._group.state = WorkerState.STOPPED
            self._emit(RunFailed, reason=FailureReason.CANCELLED)
            raise
        except Exception as e:
            self._group.state = WorkerState.UNKNOWN
            self._emit(RunFailed, reason=FailureReason.ERROR, detail=f"{type(e).__name__}: {e}")
            raise
        finally:
            self._signal_scope = None
            self._group.store = None
            self._hub.close()
            self._output.close()
            self._drop_empty_temporary_logs()

    async def _dump_stacks(self) -> str | dict[int, str]:
        """``kill -URG`` on the agent: every rank's stacks across the job (docs/hangs.md).

        On several nodes the grouped report, also written to the log directory
        (``stacks-<time>.txt``); on one node each local rank's stack, as before.
        """
        channel, ctx = self._channel, self._ctx
        if channel is None or channel.nodes == 1:
            return await ctx.dump_stacks() if ctx is not None else {}
        return self._keep_report("stacks", (await self.job_stacks()).format())

    async def _tell_stall(self, stall: StallReport) -> str:
        """This node's workers stalled: the report with every rank's stack across the job.

        The stacks this node took when it found the stall, and those of every other node,
        asked for through the store as for ``kill -URG`` (a node that does not answer
        within `STACKS_TIMEOUT` seconds is named); on one node, its own ranks grouped the
        same way. Ranks are global. Also written to the log directory (``stall-<time>.txt``).
        """
        workers = self._group.workers
        pids = self._ctx.pids() if self._ctx is not None else {}
        own = [
            (workers[lr].global_rank, pids.get(lr, -1), text)
            for lr, text in sorted(stall.stacks.items())
        ]

        async def taken() -> list[tuple[int, int, str]]:
            return own

        channel = self._channel
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
        return self._keep_report("stall", text)

    def _keep_report(self, kind: str, report: str) -> str:
        """``report``, also written to the log root as ``{kind}-<time>.txt`` (it says where)."""
        if self._log_root is None:
            return report
        name = time.strftime(f"{kind}-%Y%m%d-%H%M%S.txt")
        try:
            (self._log_root / name).write_text(report)
        except OSError as e:
            return report + f"(not written to {self._log_root}: {e})\n"
        return report + f"(also in {self._log_root / name})\n"

    async def job_stacks(self) -> JobStacks:
        """Every running rank's stack on every node of the job, grouped (`JobStacks`).

        On several nodes the other nodes are asked through the rendezvous store and each
        answers within a beat with its own ranks' stacks; a node that does not answer
        within `STACKS_TIMEOUT` seconds is named as missing. Without workers running, an
        empty report.
        """
        channel = self._channel
        if channel is not None and self._ctx is not None:
            return await channel.gather_stacks(self._capture_stacks)
        stacks = [
            RankStack(rank, self._group.group_rank or 0, socket.gethostname(), pid, text)
            for rank, pid, text in await self._capture_stacks()
        ]
        return JobStacks(tuple(stacks))

    async def _capture_stacks(self) -> list[tuple[int, int, str]]:
        """This node's running workers' stacks: ``[(global rank, pid, text), ...]``."""
        ctx = self._ctx
        if ctx is None:
            return []
        workers = self._group.workers
        pids = ctx.pids()
        stacks = await ctx.dump_stacks()
        return [
            (workers[lr].global_rank, pids.get(lr, -1), text) for lr, text in sorted(stacks.items())
        ]

    # -- the run -----------------------------------------------------------------------

    def _prepare_log_root(self) -> None:
        if self._config.log_dir is None:
            self._log_root = log_root.make_temporary(self._spec.role)
            logger.info("agent logs are in %s", self._log_root)
            return
        root = self._config.log_dir
        if root.exists() and not root.is_dir():
            raise ValueError(f"log_dir={str(root)!r} is a file; give a directory")
        if root.is_dir():
            taken = sorted(p.name for p in root.iterdir() if p.name.startswith("attempt_"))
            if taken:
                raise ValueError(
                    f"log_dir={str(root)!r} already holds {taken[0]} of an earlier run; an "
                    "agent never overwrites logs: give each run a new log_dir"
                )
        root.mkdir(parents=True, exist_ok=True)
        self._log_root = root

    def _drop_empty_temporary_logs(self) -> None:
        """Remove a temporary log root that received no file (see `_core.output._log_root`)."""
        if self._config.log_dir is None and self._log_root is not None:
            log_root.remove_if_empty(self._log_root, f"agent {self._spec.role!r}")

    async def _open_rendezvous(self) -> NodeRendezvous:
        spec = self._spec
        if spec.rdzv_handler is not None:
            return Rendezvous(spec.rdzv_handler, local_addr=spec.local_addr)
        # One node has no other agent to meet: no agent store, and so no torch at all.
        # Worker 0 hosts the workers' store (TORCHELASTIC_USE_AGENT_STORE=False), as under
        # torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. The launcher then starts in
        # a fraction of torchrun's time, which spends most of it importing torch.
        # torchrun's run id is "none" for a static node (its --rdzv-id default) and a
        # fresh UUID for a standalone one.
        run_id = self._config.run_id or ("none" if spec.master_port is not None else None)
        return LocalRendezvous(run_id, spec.local_addr)

    async def _invoke_run(self, rdzv: NodeRendezvous) -> RunResult:
        spec = self._spec
        group = self._group
        while True:
            if not await self._rendezvous(rdzv):
                # A spare node the job never needed: torch ends it quietly, and so do we.
                group.state = WorkerState.SUCCEEDED
                self._emit(RunSucceeded, global_ranks=())
                return RunResult(WorkerState.SUCCEEDED)
            channel = self._channel
            try:
                watched = await self._run_attempt(rdzv)
                outcome = watched.outcome
                failed = None
                if isinstance(outcome, RunProcsResult | PeerEnded) and (
                    isinstance(outcome, PeerEnded) or outcome.is_failed()
                ):
                    failed = await self._settle_attempt(rdzv, watched, channel)
            finally:
                self._channel = None
                if channel is not None:
                    channel.close()
            if isinstance(outcome, RunProcsResult) and not outcome.is_failed():
                group.state = WorkerState.SUCCEEDED
                await rdzv.exit_barrier(self._config.exit_barrier_timeout)
                values = {
                    group.workers[lr].global_rank: v for lr, v in outcome.return_values.items()
                }
                self._emit(RunSucceeded, global_ranks=tuple(sorted(values)))
                return RunResult(WorkerState.SUCCEEDED, return_values=values)
            delay = 0.0
            if isinstance(outcome, MembershipChange):
                reason = StopReason.MEMBERSHIP_CHANGE
            else:
                if failed is not None:
                    return failed
                reason = (
                    StopReason.PEER_ENDED
                    if isinstance(outcome, PeerEnded)
                    else StopReason.WORKER_FAILED
                )
                self._remaining_restarts -= 1
                self._restart_count += 1
                if spec.restart_backoff is not None:
                    delay = spec.restart_backoff.delay(self._restart_count)
            self._attempt += 1
            self._emit(
                GroupRestarting,
                reason=reason,
                delay=delay,
                restarts_left=self._remaining_restarts,
            )
            if delay > 0:
                await anyio.sleep(delay)

    async def _settle_attempt(
        self, rdzv: NodeRendezvous, watched: Watched, channel: JobChannel | None
    ) -> RunResult | None:
        """After a failed attempt: the run's failed result, or ``None`` to restart.

        Every node decides alike: the job's restart count is the same on all of them, and
        an end that is final anywhere (an exit code never retried, the store lost) is
        final everywhere.
        """
        spec = self._spec
        group = self._group
        outcome = watched.outcome
        failures: dict[int, ProcessFailure] = {}
        fatal: list[ProcessFailure] = []
        if isinstance(outcome, RunProcsResult):
            failures = {group.workers[lr].global_rank: f for lr, f in outcome.failures.items()}
            if channel is not None:
                # Named as the other nodes name this one (--local-addr), in every report.
                for failure in failures.values():
                    failure.host = failure.host or channel.host
            fatal = [f for f in failures.values() if f.exitcode in spec.no_retry_exit_codes]
            cause = watched.cause
        else:
            assert isinstance(outcome, PeerEnded)
            cause = outcome.cause
        elsewhere = cause is not None and (
            cause.node != group.group_rank or cause.reason != EndReason.WORKER_FAILED
        )
        if cause is not None:
            rdzv.attempt_ended(cause)
            if elsewhere:
                # Another node's end is the root cause: the report leads with it.
                failures[cause.rank if cause.rank is not None else -1] = cause.as_failure()
        if not (fatal or (cause is not None and cause.final) or self._remaining_restarts == 0):
            return None
        group.state = WorkerState.FAILED
        if channel is not None and cause is not None:
            # This node leaves the job: not before the others know why (it may host
            # the store they read it from).
            await channel.linger(cause)
        if fatal:
            why = FailureReason.NO_RETRY_EXIT_CODE
            detail = f"exit code {fatal[0].exitcode} is in no_retry_exit_codes"
        elif cause is not None and cause.reason == EndReason.STORE_LOST:
            why, detail = FailureReason.STORE_LOST, cause.describe()
        elif self._remaining_restarts == 0:
            why = FailureReason.RESTARTS_EXHAUSTED
            detail = f"max_restarts={spec.max_restarts} used up"
            if cause is not None and elsewhere:
                detail += f"; last: {cause.describe()}"
        else:
            assert cause is not None
            why, detail = FailureReason.PEER_FAILED, cause.describe()
        self._emit(RunFailed, reason=why, failures=failures, detail=detail)
        return RunResult(WorkerState.FAILED, failures=failures)

    async def _rendezvous(self, rdzv: NodeRendezvous) -> bool:
        """Join the next round and take its ranks; False when this node is not needed."""
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
            return False
        if outcome.restart_count is not None:
            # The job's count, the same on every node: a node that keeps failing cannot
            # give the job more attempts than max_restarts (torch counts per node).
            self._restart_count = outcome.restart_count
            self._remaining_restarts = max(0, spec.max_restarts - outcome.restart_count)
        self._channel = outcome.channel
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
        self._emit(
            RendezvousCompleted,
            group_rank=outcome.group_rank,
            group_world_size=outcome.group_world_size,
            world_size=outcome.world_size,
            master_addr=outcome.master_addr,
            master_port=outcome.master_port,
            global_ranks=tuple(w.global_rank for w in group.workers),
        )
        return True

    async def _run_attempt(self, rdzv: NodeRendezvous) -> Watched:
        spec = self._spec
        group = self._group
        assert self._log_root is not None
        channel = self._channel
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
        self._output.new_attempt()
        ctx.tell_stalls_with(self._tell_stall)
        ctx.share_output(
            self._output,
            {w.local_rank: w.global_rank for w in group.workers},
            self._restart_count,
        )
        self._ctx = ctx
        try:
            if channel is not None:
                await channel.open()
            async with ctx:
                for lr, pid in ctx.pids().items():
                    group.workers[lr].id = pid
                group.state = WorkerState.HEALTHY
                self._emit(
                    WorkersStarted,
                    pids={group.workers[lr].global_rank: p for lr, p in ctx.pids().items()},
                )
                try:
                    watched = await watch_attempt(
                        ctx,
                        rdzv,
                        spec.monitor_interval,
                        channel,
                        self._end_of,
                        self._capture_stacks,
                    )
                except BaseException as e:
                    interruption = self._interruption(e)
                    self._emit(GroupStopping, **interruption)
                    end = None
                    if channel is not None:
                        with anyio.CancelScope(shield=True):
                            end = await channel.end(self._end_of_interruption(interruption), 2.0)
                    scope = self._signal_scope
                    if scope is not None and scope.first is not None:
                        # As torchrun: the workers get the signal the launcher received
                        # (Ctrl-C arrives as SIGINT, a checkpointing SIGUSR1 as SIGUSR1).
                        await ctx.close(death_sig=scope.first)
                    if channel is not None and end is not None:
                        await ctx.close()
                        with anyio.CancelScope(shield=True):
                            await channel.linger(end, 2.0)
                    raise
                outcome = watched.outcome
                if isinstance(outcome, MembershipChange):
                    self._emit(
                        GroupStopping,
                        reason=StopReason.MEMBERSHIP_CHANGE,
                        detail=f"{outcome.nodes_waiting} node(s) waiting to join",
                    )
                elif isinstance(outcome, PeerEnded):
                    self._emit(
                        GroupStopping, reason=StopReason.PEER_ENDED, detail=outcome.cause.describe()
                    )
                elif outcome.is_failed():
                    for lr, failure in sorted(
                        outcome.failures.items(), key=lambda i: i[1].timestamp
                    ):
                        self._emit_failure(lr, failure)
                    self._emit(GroupStopping, reason=StopReason.WORKER_FAILED)
                elif channel is not None:
                    await channel.finish()
                await ctx.close()
                if not isinstance(outcome, RunProcsResult) or outcome.is_failed():
                    group.state = WorkerState.STOPPED
                if channel is not None and watched.cause is not None:
                    # Read again once stopped: another node's end that came after this
                    # one's may be final (an exit code it never retries).
                    watched.cause = await channel.cause(watched.cause)
                return watched
        finally:
            self._ctx = None
            for worker in group.workers:
                worker.id = None

    def _end_of(self, failures: Mapping[int, ProcessFailure]) -> AttemptEnd:
        """What the other nodes are told when this node's workers failed (by local rank)."""
        group = self._group
        assert self._channel is not None
        local_rank, failure = min(failures.items(), key=lambda i: (i[1].timestamp, i[0]))
        final = (
            any(f.exitcode in self._spec.no_retry_exit_codes for f in failures.values())
            or self._remaining_restarts == 0
        )
        return end_of_failure(
            group.group_rank or 0,
            self._channel.host,
            group.workers[local_rank].global_rank,
            local_rank,
            failure,
            final=final,
        )

    def _end_of_interruption(self, interruption: Mapping[str, Any]) -> AttemptEnd:
        """What the other nodes are told when this node stops for a signal or an error."""
        reason = interruption["reason"]
        return AttemptEnd(
            node=self._group.group_rank or 0,
            host=self._channel.host if self._channel is not None else "",
            reason={
                StopReason.SIGNAL: EndReason.SIGNAL,
                StopReason.CANCELLED: EndReason.CANCELLED,
            }.get(reason, EndReason.ERROR),
            detail=interruption.get("detail", ""),
            exitcode=-signal.Signals[interruption["detail"]].value
            if reason == StopReason.SIGNAL
            else 1,
            timestamp=time.time(),
        )

    # -- helpers -----------------------------------------------------------------------

    async def _kill_now(self, sig: signal.Signals) -> None:
        """A second signal: skip the rest of the grace period."""
        ctx = self._ctx
        if ctx is not None:
            logger.warning("second %s: killing the workers now", sig.name)
            await ctx.close(death_sig=signal.SIGKILL)

    def _interruption(self, error: BaseException) -> dict[str, Any]:
        scope = self._signal_scope
        if scope is not None and scope.first is not None:
            return {"reason": StopReason.SIGNAL, "detail": scope.first.name}
        if isinstance(error, anyio.get_cancelled_exc_class()):
            return {"reason": StopReason.CANCELLED}
        return {"reason": StopReason.ERROR, "detail": f"{type(error).__name__}: {error}"}

    def _emit_failure(self, local_rank: int, failure: ProcessFailure) -> None:
        signal_name = failure.signal_name() if failure.exitcode < 0 else None
        self._publish(
            WorkerFailed(
                timestamp=failure.timestamp,
                role=self._spec.role,
                run_id=self._run_id,
                attempt=self._attempt,
                restart_count=self._restart_count,
                global_rank=self._group.workers[local_rank].global_rank,
                local_rank=local_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                signal=signal_name,
                message=failure.message,
                failure=failure,
            )
        )

    def _emit(self, kind: type[AgentEvent], **fields: Any) -> None:
        self._publish(
            kind(
                timestamp=time.time(),
                role=self._spec.role,
                run_id=self._run_id,
                attempt=self._attempt,
                restart_count=self._restart_count,
                **fields,
            )
        )

    def _publish(self, event: AgentEvent) -> None:
        self._hub.emit(event)
        self._output.event(event)
