"""One attempt's watch: the group's outcome, another node's end, or a node waiting to join.

The group's outcome is an event (``ctx.wait()`` returns the moment every worker succeeded
or the first one failed). The moment a local worker fails, the other nodes are told through
the round's `JobChannel`, while the local teardown runs; and another node ending the attempt
(or vanishing) is heard on the same channel, whatever the collective backend of the workers
would have noticed. A node waiting to join is polled: torch's rendezvous state lives in a
store that has no notifications, so ``num_nodes_waiting()`` is asked every
``monitor_interval``, and only for a rendezvous whose membership can change at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from ..._core.group._pcontext import PContext
from ..._core.reports._failures import ProcessFailure
from ..._core.reports._results import RunProcsResult
from ..channel._attempt_end import AttemptEnd
from ..channel._job_channel import JobChannel
from ..channel._stack_gathering import Capture
from ..observe._events import StopReason
from ..rendezvous._node import NodeRendezvous

__all__ = ["MembershipChange", "PeerEnded", "Watched", "watch_attempt"]

# The agent's logger: this is the agent's loop, split out of its module.
logger = logging.getLogger("aioelastic.agent")


@dataclass(frozen=True)
class MembershipChange:
    """Nodes are waiting to join: the group stops and every node re-rendezvouses.

    Attributes:
        nodes_waiting: how many, as torch's handler counted them.
    """

    nodes_waiting: int


@dataclass(frozen=True)
class PeerEnded:
    """Another node ended the attempt (or vanished): this node's workers are stopped too.

    Attributes:
        cause: the root cause, as the node that ended the attempt first told it.
    """

    cause: AttemptEnd


@dataclass
class Watched:
    """What one attempt's watch saw.

    Attributes:
        outcome: the local group's outcome, another node's end, or a membership change.
        cause: the attempt's root cause across the job when this node's workers failed
            (this node's own end unless another node ended the attempt first).
    """

    outcome: RunProcsResult | MembershipChange | PeerEnded
    cause: AttemptEnd | None = None

    @property
    def succeeded(self) -> bool:
        """Every local worker succeeded."""
        return isinstance(self.outcome, RunProcsResult) and not self.outcome.is_failed()

    @property
    def failed(self) -> bool:
        """A local worker failed, or another node ended the attempt."""
        return isinstance(self.outcome, PeerEnded) or (
            isinstance(self.outcome, RunProcsResult) and self.outcome.is_failed()
        )

    @property
    def stop_reason(self) -> StopReason:
        """Why the group stopped, unless it succeeded."""
        if isinstance(self.outcome, MembershipChange):
            return StopReason.MEMBERSHIP_CHANGE
        if isinstance(self.outcome, PeerEnded):
            return StopReason.PEER_ENDED
        return StopReason.WORKER_FAILED


async def watch_attempt(
    ctx: PContext,
    rdzv: NodeRendezvous,
    monitor_interval: float,
    channel: JobChannel | None = None,
    end_of: Callable[[dict[int, ProcessFailure]], AttemptEnd] | None = None,
    capture: Capture | None = None,
) -> Watched:
    """The group's outcome, another node's end, or a membership change, whichever is first.

    Args:
        ctx: the attempt's running group.
        rdzv: the rendezvous the attempt came from.
        monitor_interval: seconds between two ``num_nodes_waiting()`` questions.
        channel: the round's channel to the other nodes, if any.
        end_of: what to tell them when local workers failed (by local rank).
        capture: this node's stacks, for another node that asks for the job's.

    Raises:
        Exception: whatever ``ctx.wait()`` raised, as itself.
    """
    watch = _Watch(ctx)
    async with anyio.create_task_group() as tg:
        peers = anyio.CancelScope()
        tg.start_soon(watch.workers_done, tg.cancel_scope)
        if channel is not None and end_of is not None:
            tg.start_soon(watch.tell_peers, channel, end_of, peers)
            tg.start_soon(watch.hear_peers, tg.cancel_scope, channel, capture, peers)
        if rdzv.membership_can_change:
            tg.start_soon(watch.nodes_waiting, tg.cancel_scope, rdzv, monitor_interval)
    if watch.error is not None:
        raise watch.error
    assert watch.outcome is not None
    return Watched(watch.outcome, watch.cause)


class _Watch:
    """The tasks of `watch_attempt`: the first of them to see an outcome ends the watch."""

    def __init__(self, ctx: PContext) -> None:
        self._ctx = ctx
        self.outcome: RunProcsResult | MembershipChange | PeerEnded | None = None
        self.cause: AttemptEnd | None = None
        self.error: Exception | None = None

    async def workers_done(self, watch: anyio.CancelScope) -> None:
        try:
            self.outcome = await self._ctx.wait()
        except Exception as e:
            # Raised by watch_attempt as itself, not wrapped in the task group's
            # ExceptionGroup.
            self.error = e
        watch.cancel()

    async def nodes_waiting(
        self, watch: anyio.CancelScope, rdzv: NodeRendezvous, interval: float
    ) -> None:
        while True:
            await anyio.sleep(interval)
            try:
                waiting = await rdzv.num_nodes_waiting()
            except Exception as e:
                # The workers may well finish without the rendezvous store; a dead
                # store fails the next rendezvous loudly enough.
                logger.warning("cannot check for waiting nodes: %s: %s", type(e).__name__, e)
                continue
            if waiting > 0 and self.outcome is None:
                self.outcome = MembershipChange(waiting)
                watch.cancel()
                return

    async def tell_peers(
        self,
        channel: JobChannel,
        end_of: Callable[[dict[int, ProcessFailure]], AttemptEnd],
        peers: anyio.CancelScope,
    ) -> None:
        # The moment a local worker fails, before its siblings' grace period: the other
        # nodes stop theirs while this one stops its own.
        failures = await self._ctx.first_failures()
        if failures:
            peers.cancel()
            # Shielded: the group's outcome may end the watch meanwhile; the others
            # must still be told (the channel bounds the call).
            with anyio.CancelScope(shield=True):
                self.cause = await channel.end(end_of(failures))

    async def hear_peers(
        self,
        watch: anyio.CancelScope,
        channel: JobChannel,
        capture: Capture | None,
        peers: anyio.CancelScope,
    ) -> None:
        with peers:
            end = await channel.watch(capture)
            if self.outcome is None:
                self.outcome = PeerEnded(end)
                watch.cancel()
