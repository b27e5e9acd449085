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
from ..channel._job_channel import AttemptEnd, Capture, JobChannel
from ..rendezvous._node import NodeRendezvous

__all__ = ["MembershipChange", "PeerEnded", "watch_attempt"]

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
    outcome: RunProcsResult | MembershipChange | PeerEnded | None = None
    cause: AttemptEnd | None = None
    error: Exception | None = None

    async with anyio.create_task_group() as tg:

        async def workers_done() -> None:
            nonlocal outcome, error
            try:
                outcome = await ctx.wait()
            except Exception as e:
                # Raised below as itself, not wrapped in the task group's ExceptionGroup.
                error = e
            tg.cancel_scope.cancel()

        async def nodes_waiting() -> None:
            nonlocal outcome
            while True:
                await anyio.sleep(monitor_interval)
                try:
                    waiting = await rdzv.num_nodes_waiting()
                except Exception as e:
                    # The workers may well finish without the rendezvous store; a dead
                    # store fails the next rendezvous loudly enough.
                    logger.warning("cannot check for waiting nodes: %s: %s", type(e).__name__, e)
                    continue
                if waiting > 0 and outcome is None:
                    outcome = MembershipChange(waiting)
                    tg.cancel_scope.cancel()
                    return

        async def tell_peers() -> None:
            # The moment a local worker fails, before its siblings' grace period: the other
            # nodes stop theirs while this one stops its own.
            nonlocal cause
            assert channel is not None
            assert end_of is not None
            failures = await ctx.first_failures()
            if failures:
                peers.cancel()
                # Shielded: the group's outcome may end the watch meanwhile; the others
                # must still be told (the channel bounds the call).
                with anyio.CancelScope(shield=True):
                    cause = await channel.end(end_of(failures))

        async def hear_peers(scope: anyio.CancelScope) -> None:
            nonlocal outcome
            assert channel is not None
            with scope:
                end = await channel.watch(capture)
                if outcome is None:
                    outcome = PeerEnded(end)
                    tg.cancel_scope.cancel()

        peers = anyio.CancelScope()
        tg.start_soon(workers_done)
        if channel is not None and end_of is not None:
            tg.start_soon(tell_peers)
            tg.start_soon(hear_peers, peers)
        if rdzv.membership_can_change:
            tg.start_soon(nodes_waiting)
    if error is not None:
        raise error
    assert outcome is not None
    return Watched(outcome, cause)
