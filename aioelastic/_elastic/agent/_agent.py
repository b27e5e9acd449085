"""The elastic agent: rendezvous, start the local workers, watch them, restart them.

One agent runs per node. Its run opens the log root, the rendezvous, the metrics and the
signal handling, then goes through a loop of attempts (`._attempt_loop`): join a rendezvous
round through torch's handler (`aioelastic._elastic.rendezvous._node`) and take the round's
worker ranks, then run one `Attempt` (`._attempt`: the workers' environment, their start as
one group in their own ``attempt_{n}`` log directory, the watch, the stop), which ends with
whichever comes first:

* the group's outcome (``ctx.wait()``, which returns the moment every worker succeeded or
  the first one failed, already stopped siblings included): success ends the run after the
  exit barrier; after a failure the restart budget decides (`RestartBudget.decide`, in
  `._budget`: where a restart is decided) whether the group restarts;
* another node ending the attempt, or vanishing (the round's `JobChannel`): a failure here
  too, told by the node that ended it first;
* a node waiting to join (``num_nodes_waiting() > 0``): the group is stopped and everyone
  re-rendezvouses, without using a restart. This is the one thing checked periodically,
  every ``monitor_interval``, because torch's rendezvous state lives in a store that has
  no notifications (`._watch`).

Stopping is always the core's teardown (``ctx.close()``); the agent never signals a
worker itself. Stack and stall reports are `._reports`'; events leave through `._emitter`.

Differences from torch's ``LocalElasticAgent`` that matter: failures and success are acted
on when the exit is seen instead of on the next ``monitor_interval`` tick; every attempt,
membership changes included, logs to a new directory and none is ever deleted; optional
backoff between restarts (`RestartBackoff`) and exit codes that are never retried
(``no_retry_exit_codes``); the exit barrier timeout is a constructor argument that
`elastic_launch` exposes; signals are handled only for the run's duration and a second
one skips the grace period; lifecycle events (`events`).

The types the agent runs and reports (`WorkerSpec`, `WorkerGroup`, `RunResult`, ...) are
in `._types`; each worker's environment is built by `._env`.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from ..._core.aio._backend import require_asyncio
from ..._core.aio._signals import SignalReceived, handle_signals
from ..._core.group._options import GroupOptions, keyword_signature
from ..._core.group._pcontext import PContext
from ..._core.hangs._guard import stack_requests
from ..._core.output._std import Std
from ..._core.output._stream import DEFAULT_BUFFER, OutputHub, OutputItem, OutputStream
from ..._core.process._exit_status import signal_text
from ..channel._job_stacks import JobStacks
from ..observe._event_hub import EventHub
from ..observe._events import AgentEvent, EventStream, FailureReason, RunFailed
from ..observe._metrics import observed
from ..rendezvous._node import LocalRendezvous, NodeRendezvous, Rendezvous
from ..settings._config import AgentConfig
from ._attempt_loop import AttemptLoop
from ._budget import RestartBudget
from ._emitter import Emitter
from ._reports import Reports, drop_if_empty, open_log_root
from ._types import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState

__all__ = ["LocalElasticAgent"]

logger = logging.getLogger("aioelastic.agent")

#: Signals whose default action would end the run, held while it runs (see ``run``).
_HELD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


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
        replace_lost_nodes: False: when a lost node leaves fewer nodes than the
            rendezvous' ``min_nodes``, ``run()`` raises `NodeLostError` naming it, instead
            of waiting for a node to replace it (where none can: a SLURM step).
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
        replace_lost_nodes: bool = True,
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
            replace_lost_nodes=replace_lost_nodes,
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
        self._budget = RestartBudget.of(spec.max_restarts)
        self._emitter = Emitter(self._hub, self._output, spec.role, self._budget)
        self._reports = Reports(self._group, lambda: self._loop.running)
        self._loop = AttemptLoop(
            self._group, self._config, self._budget, self._emitter, self._output, self._reports
        )
        self._started = False

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
            f"state={self._group.state.name} restarts={self._budget.restart_count}>"
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
        return self._reports.log_root

    async def job_stacks(self) -> JobStacks:
        """Every running rank's stack on every node of the job, grouped (`JobStacks`).

        On several nodes the other nodes are asked through the rendezvous store and each
        answers within a beat with its own ranks' stacks; a node that does not answer
        within `STACKS_TIMEOUT` seconds is named as missing. Without workers running, an
        empty report.
        """
        return await self._reports.job_stacks()

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
            self._reports.log_root = open_log_root(self._config.log_dir, self._spec.role)
            async with AsyncExitStack() as stack:
                rdzv = await self._open(stack)
                if not self._config.signals:
                    return await self._loop.run(rdzv, None)
                scope = await stack.enter_async_context(handle_signals(self._config.signals))
                await stack.enter_async_context(scope.escalate(self._kill_now))
                # SIGUSR1/SIGUSR2's default action ends a process: a scheduler's checkpoint
                # request (SLURM's --signal, sent to every process of the job, the workers
                # included) would kill the launcher and with it every worker. Held for the
                # whole run, between attempts too, unless they stop it; the group passes
                # them on to its workers only when its forward_signals name them.
                held = [s for s in _HELD_SIGNALS if s not in self._config.signals]
                if held:
                    await stack.enter_async_context(handle_signals(held))
                return await scope.run_until_signal(self._loop.run(rdzv, scope))
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
            self._group.store = None
            self._hub.close()
            self._output.close()
            drop_if_empty(self._config.log_dir, self._reports.log_root, self._spec.role)

    # -- the run -----------------------------------------------------------------------

    @property
    def _ctx(self) -> PContext | None:
        """The running attempt's group, if any."""
        running = self._loop.running
        return running.ctx if running is not None else None

    async def _open(self, stack: AsyncExitStack) -> NodeRendezvous:
        """Open the rendezvous, the metrics and the stack requests, closed by ``stack``."""
        rdzv = await self._open_rendezvous()
        stack.push_async_callback(rdzv.aclose)
        self._emitter.run_id = rdzv.run_id
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
        await stack.enter_async_context(stack_requests(self._reports.dump_stacks))
        return rdzv

    async def _open_rendezvous(self) -> NodeRendezvous:
        spec = self._spec
        if spec.rdzv_handler is not None:
            return Rendezvous(
                spec.rdzv_handler,
                local_addr=spec.local_addr,
                replace_lost_nodes=self._config.replace_lost_nodes,
            )
        # One node has no other agent to meet: no agent store, and so no torch at all.
        # Worker 0 hosts the workers' store (TORCHELASTIC_USE_AGENT_STORE=False), as under
        # torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. The launcher then starts in
        # a fraction of torchrun's time, which spends most of it importing torch.
        # torchrun's run id is "none" for a static node (its --rdzv-id default) and a
        # fresh UUID for a standalone one.
        run_id = self._config.run_id or ("none" if spec.master_port is not None else None)
        return LocalRendezvous(run_id, spec.local_addr)

    async def _kill_now(self, sig: signal.Signals) -> None:
        """A second signal: skip the rest of the grace period."""
        ctx = self._ctx
        if ctx is not None:
            logger.warning("second %s: killing the workers now", sig.name)
            await ctx.close(death_sig=signal.SIGKILL)

    def _emit(self, kind: type[AgentEvent], **fields: object) -> None:
        self._emitter.emit(kind, **fields)
