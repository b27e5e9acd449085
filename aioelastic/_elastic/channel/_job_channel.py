"""What the nodes of one attempt tell each other: who ended it and why, and who is alive.

torch's agents learn about other nodes only through their own workers. With gloo a rank
sees a dead peer at once and fails by itself; with NCCL the surviving ranks block in the
collective until its timeout (10-30 minutes), and a node whose launcher was SIGKILLed
tells nobody at all. So every agent of a multi-node job keeps a channel open through the
store the rendezvous already gives every node (no new server), under keys of ours scoped
to the round and the attempt (`AttemptLink`). Three protocols share it, each in a module of
its own:

* **ending the attempt** (`EndTickets`): the first node to end it takes ticket 1 and writes
  why; every node reports ticket 1, the root cause, whatever ended its own workers after.
* **being alive** (`Ring`): each node bumps a counter once a beat and watches the next node
  in rank order; a counter still for `DEAD_AFTER` seconds is a node that vanished, and its
  watcher ends the attempt on its behalf. A node whose workers succeeded says so.
* **stacks** (`StackGathering`): a node that wants every rank's stack asks; every node
  answers on its next beat, and the asker groups the answers into one report.

`JobChannel` is what the agent holds: it beats (one bump, one look at the news counter that
ends and stack requests bump, one look at the watched node) and hands each protocol its
part.

Cost, per node and beat: three requests of a few bytes to the store (bump, read the
neighbour, read the news counter) — 6 requests a second at the default beat, so 6,000 a
second for a 1,000-node job, which a TCPStore or etcd serves easily. Detection: a peer's end
within one beat plus a round trip; a vanished node within `DEAD_AFTER` plus a beat.
"""

from __future__ import annotations

import logging
import time

import anyio
from anyio.abc import TaskGroup

from ..store._worker_store import Store
from ._attempt_end import AttemptEnd
from ._end_tickets import EndTickets
from ._job_stacks import JobStacks
from ._link import STORE_LOST_AFTER, AttemptLink, Outage
from ._liveness import DEAD_AFTER, Ring, Stillness
from ._stack_gathering import STACKS_TIMEOUT, Capture, StackGathering
from ._store_site import StoreSite

__all__ = ["BEAT", "JobChannel"]

logger = logging.getLogger("aioelastic.agent")

BEAT = 0.5
"""Seconds between two beats: a bump of this node's counter and a look at the others."""


class JobChannel:
    """One node's side of an attempt's channel (see the module documentation).

    Made by the rendezvous after each round; the agent calls `watch` while its workers
    run, `end` when it ends the attempt itself, and `finish` when its workers succeeded.

    Args:
        store: the round's store, shared by every node of the round.
        scope: the attempt's key prefix in ``store`` (unique to the round and attempt).
        node: this node's group rank.
        nodes: the number of nodes in the round.
        host: this node's address as its peers know it.
        restarts: where the job counts its restarts (a store shared by every round, and
            the key), or ``None`` when the nodes count them themselves (``static``). The
            node that takes ticket 1 for an end that `AttemptEnd.counts` adds one there,
            before it joins the next round, so every node reads the new count in it.
        beat: seconds between beats (`BEAT`).
        dead_after: seconds of stillness after which a watched node is lost (`DEAD_AFTER`).
        store_lost_after: seconds of store failures after which the attempt ends
            (`STORE_LOST_AFTER`); also the bound of each store call.
        failing_lost_after: seconds of store calls that fail (not hang) after which the
            attempt ends; `store_lost_after` unless given (`SINGLE_STORE_LOST_AFTER` for
            a store with no replicas).
        site: the store as reports of its loss name it (backend, address).
    """

    def __init__(
        self,
        store: Store,
        scope: str,
        *,
        node: int,
        nodes: int,
        host: str,
        restarts: tuple[Store, str] | None = None,
        beat: float = BEAT,
        dead_after: float = DEAD_AFTER,
        store_lost_after: float = STORE_LOST_AFTER,
        failing_lost_after: float | None = None,
        site: StoreSite | None = None,
    ) -> None:
        self._link = AttemptLink(
            store,
            scope,
            node=node,
            nodes=nodes,
            host=host,
            store_lost_after=store_lost_after,
            site=site,
        )
        self.beat = beat
        self.failing_lost_after = (
            store_lost_after if failing_lost_after is None else failing_lost_after
        )
        self._tickets = EndTickets(self._link, restarts, dead_after)
        self._ring = Ring(self._link, dead_after)
        self._stillness = Stillness(store_lost_after, 2 * dead_after + store_lost_after)
        self._stacks = StackGathering(self._link, beat)
        # The news counter as last handled.
        self._news = 0

    @property
    def node(self) -> int:
        """This node's group rank."""
        return self._link.node

    @property
    def nodes(self) -> int:
        """The number of nodes in the round."""
        return self._link.nodes

    @property
    def host(self) -> str:
        """This node's address as its peers know it."""
        return self._link.host

    @property
    def store_silent(self) -> bool:
        """Whether the channel's last store call got no answer in time (it may still
        block: later calls would only queue behind it)."""
        return self._link.unanswered

    def __repr__(self) -> str:
        return (
            f"<JobChannel {self._link.scope!r} node {self.node}/{self.nodes} "
            f"watching {self._ring.watched}{' ended' if self._tickets.ended else ''}>"
        )

    async def open(self) -> None:
        """Say who this node is and that it is alive (before its workers start)."""

        def hello() -> None:
            self._link.introduce()
            self._ring.beat()

        await self._link.call(hello)

    async def watch(self, capture: Capture | None = None) -> AttemptEnd:
        """Beat until another node ends the attempt or one is lost; why (the root cause).

        Meanwhile answers the other nodes' requests for stacks with ``capture()``, beside
        the beats: a capture that takes seconds (a rank that cannot answer) must not make
        this node look vanished to its watcher. Never returns for a node alone in its
        round. A store that stays silent or failing for ``store_lost_after`` seconds is an
        end too (`EndReason.STORE_LOST`).
        """
        if self.nodes == 1:
            await anyio.sleep_forever()  # a node alone: nobody to hear from
        async with anyio.create_task_group() as answers:
            end = await self._beats(capture, answers)
            answers.cancel_scope.cancel()
        return end

    async def _beats(self, capture: Capture | None, answers: TaskGroup) -> AttemptEnd:
        """`watch`'s loop; the stack requests' answers are started in ``answers``."""
        outage = Outage(self._link, self.failing_lost_after)
        while True:
            await anyio.sleep(self.beat)
            started = time.monotonic()
            try:
                end = await self._link.call(self._beat, outage.bound(started))
            except Exception as e:
                # Nobody's counter can move meanwhile: stillness is judged afresh after.
                self._ring.outage()
                lost = outage.failed(e, started)
                if lost is not None:
                    return lost
                logger.debug("job channel beat failed: %s", e)
                continue
            outage.answered()
            if isinstance(end, int):
                answers.start_soon(self._stacks.answer, end, capture)
            elif end is not None:
                return end

    def _beat(self) -> AttemptEnd | int | None:
        """One beat: an end (the root cause), a stack request to answer (its number), or None."""
        self._stillness.tick()
        self._ring.beat()
        news = self._link.news()
        if news != self._news:
            # None while no ticket's end is written (its taker died in between): the
            # watcher of that node tells why soon, under a ticket of its own.
            cause = self._tickets.root_cause() if self._tickets.taken() else None
            if cause is not None:
                return cause
            request = self._stacks.next_request()
            if request is not None:
                return request  # news is read again next beat: more may wait
            self._news = news
        self._stillness.tick()  # after the store calls: a stop during one shows too
        lost = self._ring.lost()
        if lost is None:
            return None
        return self._tickets.take(self._ring.vanished(lost, self._stillness.frozen_for()))

    async def gather_stacks(self, capture: Capture, timeout: float = STACKS_TIMEOUT) -> JobStacks:
        """Every rank's stack across the job (`StackGathering.gather`)."""
        return await self._stacks.gather(capture, timeout)

    async def end(self, end: AttemptEnd, timeout: float | None = None) -> AttemptEnd:
        """Tell every node that this one ends the attempt; the root cause (`EndTickets.end`)."""
        return await self._tickets.end(end, timeout)

    async def cause(self, known: AttemptEnd) -> AttemptEnd:
        """The attempt's root cause read afresh, else ``known`` (`EndTickets.cause`)."""
        return await self._tickets.cause(known)

    async def linger(self, cause: AttemptEnd, timeout: float | None = None) -> None:
        """Before leaving the job: wait until every other live node heard ``cause``
        (`EndTickets.linger`)."""
        await self._tickets.linger(cause, timeout)

    async def finish(self) -> None:
        """This node's workers all succeeded: its silence from now on is not death."""
        await self._ring.finish()

    def close(self) -> None:
        """Let the channel's thread end (an abandoned store call finishes first).

        A stack report being gathered stops waiting and still collects the answers
        given so far (its thread ends after that).
        """
        self._link.close()
