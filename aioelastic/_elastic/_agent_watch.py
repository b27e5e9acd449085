"""One attempt's watch: the group's outcome, or a node waiting to join, whichever is first.

The group's outcome is an event (``ctx.wait()`` returns the moment every worker succeeded
or the first one failed). A node waiting to join is not: torch's rendezvous state lives in
a store that has no notifications, so ``num_nodes_waiting()`` is asked every
``monitor_interval``, and only for a rendezvous whose membership can change at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio

from .._core._pcontext import PContext
from .._core._results import RunProcsResult
from ._rdzv_node import NodeRendezvous

__all__ = ["MembershipChange", "watch_attempt"]

# The agent's logger: this is the agent's loop, split out of its module.
logger = logging.getLogger("aioelastic.agent")


@dataclass(frozen=True)
class MembershipChange:
    """Nodes are waiting to join: the group stops and every node re-rendezvouses.

    Attributes:
        nodes_waiting: how many, as torch's handler counted them.
    """

    nodes_waiting: int


async def watch_attempt(
    ctx: PContext, rdzv: NodeRendezvous, monitor_interval: float
) -> RunProcsResult | MembershipChange:
    """The group's outcome, or a membership change, whichever comes first.

    Args:
        ctx: the attempt's running group.
        rdzv: the rendezvous the attempt came from.
        monitor_interval: seconds between two ``num_nodes_waiting()`` questions.

    Raises:
        Exception: whatever ``ctx.wait()`` raised, as itself.
    """
    outcome: RunProcsResult | MembershipChange | None = None
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

        tg.start_soon(workers_done)
        if rdzv.membership_can_change:
            tg.start_soon(nodes_waiting)
    if error is not None:
        raise error
    assert outcome is not None
    return outcome
