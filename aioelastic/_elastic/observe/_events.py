"""Lifecycle events of an elastic agent, consumed as an async iterator.

An orchestration service learns what the agent does without polling it::

    agent = LocalElasticAgent(spec)
    events = agent.events()          # subscribe now, before run() can emit anything

    async def forward() -> None:
        async for event in events:   # ends after the run's last event
            await post(event.kind, event.timestamp, event)

    async with anyio.create_task_group() as tg:
        tg.start_soon(forward)
        result = await agent.run()

Each subscriber has its own unbounded buffer, so a slow consumer never delays the agent
(a restart never waits for an HTTP post) and never misses an event. Events are few: a
handful per attempt. Every event is a frozen dataclass carrying when it happened
(``timestamp``, seconds since the epoch), the role, the run id and the attempt.

The sequence for one run::

    RendezvousCompleted, WorkersStarted,
      [WorkerFailed..., GroupStopping, GroupRestarting, RendezvousCompleted, WorkersStarted]...
    RunSucceeded | RunFailed

A membership change (a node waiting to join) shows as ``GroupStopping`` and
``GroupRestarting`` with reason ``membership_change`` and no ``WorkerFailed``. A signal or a
cancellation shows as ``GroupStopping`` then ``RunFailed`` with reason ``signal`` or
``cancelled``. The last event is always ``RunSucceeded`` or ``RunFailed``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import ClassVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from ..._core.reports._failures import ProcessFailure

__all__ = [
    "AgentEvent",
    "EndReason",
    "EventStream",
    "FailureReason",
    "GroupRestarting",
    "GroupStopping",
    "RendezvousCompleted",
    "RunFailed",
    "RunSucceeded",
    "StopReason",
    "WorkerFailed",
    "WorkersStarted",
]

logger = logging.getLogger("aioelastic.agent")


# Why a run ended, in one family: `EndReason` (what a node tells the others when it ends an
# attempt), `StopReason` (why this node stops its workers) and `FailureReason` (why its run
# ends). A reason the three share has the same value in each, so that each mapping is one
# method here (`StopReason.end_reason`, `EndReason.failure_reason`).


class EndReason(str, enum.Enum):
    """Why a node ended an attempt of the job, as every node is told (`AttemptEnd.reason`).

    The values travel between nodes as JSON (`AttemptEnd.to_json`): a node of another
    version reads them, so a value never changes.
    """

    WORKER_FAILED = "worker_failed"
    """One of the node's workers failed."""
    SIGNAL = "signal"
    """The node's launcher received a signal it handles."""
    CANCELLED = "cancelled"
    """The node's ``agent.run()`` was cancelled."""
    ERROR = "error"
    """The node's agent itself failed."""
    VANISHED = "vanished"
    """The node stopped beating (its launcher killed, its machine lost); told by its watcher."""
    STORE_LOST = "store_lost"
    """The rendezvous store stopped answering."""

    @property
    def verb(self) -> str:
        """How a report says it: ``"node 2 (h) {verb} {detail}"``."""
        return _END_VERBS[self]

    @property
    def failure_reason(self) -> FailureReason:
        """Why this node's run fails when this end, on another node, ends the job."""
        if self is EndReason.STORE_LOST:
            return FailureReason.STORE_LOST
        return FailureReason.PEER_FAILED


_END_VERBS = {
    EndReason.WORKER_FAILED: "failed:",
    EndReason.SIGNAL: "was stopped by",
    EndReason.CANCELLED: "was cancelled:",
    EndReason.ERROR: "failed:",
    EndReason.VANISHED: "vanished:",
    EndReason.STORE_LOST: "lost the rendezvous store:",
}


class StopReason(str, enum.Enum):
    """Why the agent stops its workers before they all finished."""

    WORKER_FAILED = "worker_failed"
    """A worker failed; the others were stopped (and may be restarted)."""
    MEMBERSHIP_CHANGE = "membership_change"
    """Nodes wait to join; everyone re-rendezvouses. Uses no restart."""
    SIGNAL = "signal"
    """The agent received a signal it handles (SIGTERM, SIGINT, ...)."""
    CANCELLED = "cancelled"
    """``agent.run()`` was cancelled by its caller."""
    ERROR = "error"
    """The agent itself failed (e.g. a rendezvous error)."""
    PEER_ENDED = "peer_ended"
    """Another node ended the attempt (its worker failed, it was stopped, it vanished);
    ``detail`` names the node and the root cause. Uses a restart, like a failure here."""

    @property
    def end_reason(self) -> EndReason:
        """What the other nodes are told when this node stops its workers for this reason.

        Raises:
            ValueError: for `MEMBERSHIP_CHANGE` and `PEER_ENDED`, which end no attempt of
                this node's own.
        """
        if self in (StopReason.MEMBERSHIP_CHANGE, StopReason.PEER_ENDED):
            raise ValueError(f"{self!r} ends no attempt of this node's own")
        return EndReason(self.value)


class FailureReason(str, enum.Enum):
    """Why a run ended in failure."""

    RESTARTS_EXHAUSTED = "restarts_exhausted"
    """A worker failed with no restart left (``max_restarts`` used up)."""
    NO_RETRY_EXIT_CODE = "no_retry_exit_code"
    """A worker exited with a code listed in ``no_retry_exit_codes``: never retried."""
    SIGNAL = "signal"
    CANCELLED = "cancelled"
    ERROR = "error"
    PEER_FAILED = "peer_failed"
    """Another node ended the job: an exit code never retried there, or its restarts ran
    out; ``detail`` names the node and the root cause."""
    STORE_LOST = "store_lost"
    """The rendezvous store stopped answering (``c10d``'s single point of failure)."""


@dataclass(frozen=True, kw_only=True)
class AgentEvent:
    """What every event carries.

    Attributes:
        timestamp: when it happened, seconds since the epoch (``time.time()``).
        role: the workers' role.
        run_id: the rendezvous run id.
        attempt: the attempt it belongs to: 0 for the first group of workers, +1 for every
            restart, membership changes included (logs are in ``attempt_{attempt}``).
        restart_count: that attempt's ``TORCHELASTIC_RESTART_COUNT`` (failure restarts
            only).
    """

    kind: ClassVar[str] = "event"
    timestamp: float
    role: str
    run_id: str
    attempt: int
    restart_count: int


@dataclass(frozen=True, kw_only=True)
class RendezvousCompleted(AgentEvent):
    """This node joined a round and its workers have ranks.

    Attributes:
        group_rank: this node's rank among the nodes.
        group_world_size: how many nodes are in the round.
        world_size: how many workers in total.
        master_addr: the store address workers use for their process group.
        master_port: its port.
        global_ranks: this node's workers' global ranks, by local rank.
    """

    kind: ClassVar[str] = "rendezvous_completed"
    group_rank: int
    group_world_size: int
    world_size: int
    master_addr: str
    master_port: int
    global_ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class WorkersStarted(AgentEvent):
    """Every local worker of the attempt has started.

    Attributes:
        pids: ``{global_rank: pid}``.
    """

    kind: ClassVar[str] = "workers_started"
    pids: Mapping[int, int]


@dataclass(frozen=True, kw_only=True)
class WorkerFailed(AgentEvent):
    """A worker failed by itself (siblings stopped because of it are not reported).

    ``timestamp`` is when its exit was seen (or what its error file says).

    Attributes:
        global_rank: its global rank.
        local_rank: its local rank.
        pid: its process id.
        exitcode: its exit status; negative when killed by that signal.
        signal: the signal's name when it was killed by one (``"SIGKILL"``), else None.
        message: the error summary (error file, else the end of its stderr).
        failure: the full `ProcessFailure`.
    """

    kind: ClassVar[str] = "worker_failed"
    global_rank: int
    local_rank: int
    pid: int
    exitcode: int
    signal: str | None
    message: str
    failure: ProcessFailure = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class GroupStopping(AgentEvent):
    """The agent is stopping its workers of this attempt.

    Attributes:
        reason: why.
        detail: a human-readable note (the signal's name, how many nodes wait, ...).
    """

    kind: ClassVar[str] = "group_stopping"
    reason: StopReason
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class GroupRestarting(AgentEvent):
    """The agent re-rendezvouses for a new attempt.

    ``attempt`` and ``restart_count`` are the new attempt's.

    Attributes:
        reason: `StopReason.WORKER_FAILED` or `StopReason.PEER_ENDED` (each uses one of
            the job's restarts) or `StopReason.MEMBERSHIP_CHANGE` (does not).
        delay: the backoff the agent waits before joining, in seconds (0 without backoff,
            and always 0 for a membership change: peers are waiting).
        restarts_left: failure restarts still allowed after this one.
    """

    kind: ClassVar[str] = "group_restarting"
    reason: StopReason
    delay: float
    restarts_left: int


@dataclass(frozen=True, kw_only=True)
class RunSucceeded(AgentEvent):
    """Every local worker finished with exit code 0 (after the exit barrier).

    Attributes:
        global_ranks: the ranks whose return values the run result holds.
    """

    kind: ClassVar[str] = "run_succeeded"
    global_ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class RunFailed(AgentEvent):
    """The run ended without success.

    Attributes:
        reason: why.
        failures: ``{global_rank: ProcessFailure}`` of the last attempt when workers failed;
            empty for a signal, a cancellation or an agent error.
        detail: a human-readable note (the signal, the error).
    """

    kind: ClassVar[str] = "run_failed"
    reason: FailureReason
    failures: Mapping[int, ProcessFailure] = field(default_factory=dict, repr=False)
    detail: str = ""


class EventStream:
    """One subscriber's view of an agent's events: an async iterator.

    Iteration ends after the run's last event. ``aclose()`` (or leaving ``async with``)
    unsubscribes early.
    """

    def __init__(self, receive: MemoryObjectReceiveStream[AgentEvent]) -> None:
        self._receive = receive

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> AgentEvent:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._receive.close()
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop receiving; events already buffered are dropped."""
        self._receive.close()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
