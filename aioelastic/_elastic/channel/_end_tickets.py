"""Ending an attempt: who ended it first (the root cause), and that every node heard why.

The node that ends the attempt first — a worker failed, a stall or timer fired, the
launcher was signalled, restarts ran out, a watched node vanished — takes ticket 1 of the
``ends`` counter and writes why (`AttemptEnd`) under it; later enders take later tickets.
Every node reads the counter when the news counter moves; seeing an end, it stops its
workers and reports ticket 1, the root cause, whatever ended its own workers afterwards.
One end that is final (an exit code never retried there) makes the root cause final.

The node that takes ticket 1 for an end that counts adds one to the job's restart count,
before it joins the next round, so every node reads the new count there. A node that
leaves the job first waits until every other live node heard why (`EndTickets.linger`):
the store may live in its launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time

from ..observe._events import EndReason
from ..store._worker_store import Store
from ._attempt_end import AttemptEnd
from ._link import AttemptLink

__all__ = ["EndTickets"]

logger = logging.getLogger("aioelastic.agent")


class EndTickets:
    """One node's side of the end tickets (see the module documentation).

    The blocking methods run on the link's thread; the async ones call them there, bounded.

    Args:
        link: the attempt's keys and the thread that calls the store.
        restarts: where the job counts its restarts (a store shared by every round, and
            the key), or ``None`` when the nodes count them themselves (``static``).
        dead_after: how long `linger` waits by default, seconds: a node that has not
            heard by then is gone.
    """

    def __init__(
        self, link: AttemptLink, restarts: tuple[Store, str] | None, dead_after: float
    ) -> None:
        self._link = link
        self._restarts = restarts
        self._dead_after = dead_after
        self._ended: AttemptEnd | None = None
        # Whether this node took ticket 1 or counted itself among those that heard.
        self._told = False
        #: Seconds a reader waits for a ticket's end that is not written yet: less than
        #: the beat's bound (a beat reads the ends), and a writer takes a round trip.
        self.missing_after = min(dead_after, link.store_lost_after / 2)
        # The tickets whose end did not come within missing_after: never waited for again.
        self._given_up: set[int] = set()

    @property
    def ended(self) -> AttemptEnd | None:
        """The root cause this node ended the attempt with, if it did."""
        return self._ended

    def taken(self) -> bool:
        """Blocking: whether any node took a ticket."""
        return int(self._link.store.add(self._link.key("ends"), 0)) > 0

    def take(self, end: AttemptEnd, missing_after: float | None = None) -> AttemptEnd:
        """Blocking: take the next ticket for ``end``; the root cause (ticket 1's end).

        ``missing_after``: how long an earlier ticket's end is waited for (`root_cause`).
        """
        store, key = self._link.store, self._link.key
        ticket = store.add(key("ends"), 1)
        if ticket == 1 and end.counts and self._restarts is not None:
            job_store, restarts_key = self._restarts
            job_store.add(restarts_key, 1)
        store.set(key(f"end/{ticket}"), end.to_json())
        self._link.announce()
        if ticket == 1:
            self._told = True
            return end
        return self.root_cause(missing_after) or end

    def root_cause(self, missing_after: float | None = None) -> AttemptEnd | None:
        """Blocking: ticket 1's end; final if any node's end is (an exit code never retried).

        Each ticket's writer sets its key right after taking the ticket, and the readers
        wait out the moment in between, but for ``missing_after`` seconds in all (default:
        `missing_after`), not for the store's own read timeout (60 s for ``c10d``): a
        node killed in between never writes it. A ticket given up on is not waited for
        again. None while no ticket's end is written.
        """
        store, key = self._link.store, self._link.key
        tickets = int(store.add(key("ends"), 0))
        ends = self._read_ends(
            tickets, self.missing_after if missing_after is None else missing_after
        )
        written = [end for end in ends if end is not None]
        if not written:
            return None
        root = ends[0] if ends[0] is not None else _stand_in(written, self._given_up)
        if not root.final and any(end.final for end in written):
            root = dataclasses.replace(root, final=True)
        if not self._told:
            # This node has heard; the last to hear frees whoever lingers (see linger).
            self._told = True
            if store.add(key("heard"), 1) >= _hearers(self._link.nodes, root):
                store.set(key("all_heard"), "1")
        return root

    def _read_ends(self, tickets: int, missing_after: float) -> list[AttemptEnd | None]:
        """Blocking: each ticket's end, None for one not written within ``missing_after``
        seconds from now (or given up on before)."""
        store, key = self._link.store, self._link.key
        deadline = time.monotonic() + missing_after
        ends: list[AttemptEnd | None] = []
        for ticket in range(1, tickets + 1):
            name = key(f"end/{ticket}")
            if not store.check([name]) and not self._came(ticket, name, deadline, missing_after):
                ends.append(None)
                continue
            ends.append(AttemptEnd.from_json(store.get(name)))
        return ends

    def _came(self, ticket: int, name: str, deadline: float, missing_after: float) -> bool:
        """Blocking: whether the missing ``name`` (ticket ``ticket``'s end) came by
        ``deadline``; a store that fails meanwhile raises, as any call of it does."""
        if ticket in self._given_up:
            return False
        left = max(deadline - time.monotonic(), 0.01)
        try:
            self._link.store.wait([name], datetime.timedelta(seconds=left))
        except Exception:
            # A wait that timed out and a store that failed raise alike (torch raises
            # DistStoreError for both): check() tells them apart, raising for the second.
            if self._link.store.check([name]):
                return True
            self._given_up.add(ticket)
            logger.warning(
                "end ticket %d has no end within %g s: the node that took it must have "
                "been killed, or its launcher stopped, before writing why",
                ticket,
                missing_after,
            )
            return False
        return True

    async def end(self, end: AttemptEnd, timeout: float | None = None) -> AttemptEnd:
        """Tell every node that this one ends the attempt; the root cause of the end.

        The root cause is ``end`` itself unless another node ended the attempt first.
        Bounded by ``timeout`` (default: the link's ``store_lost_after``): a store that
        does not answer or fails leaves ``end`` as the root cause, logged with the store
        named.
        """
        if self._ended is not None:
            return self._ended
        bound = timeout or self._link.store_lost_after
        # An earlier ticket's end is waited for within the call's bound.
        missing_after = min(self.missing_after, bound / 2)
        logger.info("telling the other nodes why this node ends: %s", end.describe())
        try:
            self._ended = await self._link.call(lambda: self.take(end, missing_after), bound)
        except Exception as e:
            logger.warning(
                "could not tell the other nodes why this node ended: %s",
                self._link.site.failure(e, bound),
            )
            self._ended = end
        return self._ended

    async def cause(self, known: AttemptEnd) -> AttemptEnd:
        """The attempt's root cause read afresh (every end so far), else ``known``."""
        try:
            return await self._link.call(self.root_cause) or known
        except Exception as e:
            logger.warning(
                "could not read why the other nodes ended: %s",
                self._link.site.failure(e, self._link.store_lost_after),
            )
            return known

    async def linger(self, cause: AttemptEnd, timeout: float | None = None) -> None:
        """Before leaving the job: wait until every other live node heard ``cause``.

        The store may live in this node's launcher (``c10d``'s host): leaving at once
        would take it away before a slower node read why the job ended, and that node
        would report a lost store instead of the root cause. Bounded by ``timeout``
        (default ``dead_after``); a node that never hears is a node that is gone.
        """
        hearers = _hearers(self._link.nodes, cause)
        if hearers <= 0:
            return
        if self._link.unanswered:
            # A call that got no answer still blocks the link's thread: nothing can be
            # heard through the store until it returns, and this wait would only queue.
            logger.info("not waiting for the other nodes to hear why: the store gave no answer")
            return
        bound = timeout or self._dead_after
        key = self._link.key("all_heard")

        def wait() -> None:
            self._link.store.wait([key], datetime.timedelta(seconds=bound))

        try:
            await self._link.call(wait, bound + 1)
        except Exception:
            logger.warning(
                "not every other node heard why the attempt ended within %g s (%s); leaving",
                bound,
                await self._heard(hearers),
            )

    async def _heard(self, hearers: int) -> str:
        """How many of the ``hearers`` did hear, as a report says it (asked for a second)."""
        if not self._link.unanswered:
            with contextlib.suppress(Exception):
                heard = await self._link.call(
                    lambda: self._link.store.add(self._link.key("heard"), 0), 1.0
                )
                return f"{heard} of {hearers} did"
        return f"of {hearers}, how many did is not known: the store gave no answer"


def _stand_in(written: list[AttemptEnd], given_up: set[int]) -> AttemptEnd:
    """The root cause when ticket 1's end never came: its taker was killed (or stopped)
    between taking the ticket and writing why, so its watcher finds it vanished and
    writes that under a later ticket; the first such end, else the first end written."""
    vanished = [end for end in written if end.reason is EndReason.VANISHED]
    root = (vanished or written)[0]
    logger.warning(
        "why the attempt ended first is not known (end ticket(s) %s have no end); "
        "reporting the next end written: %s",
        ",".join(map(str, sorted(given_up))),
        root.describe(),
    )
    return root


def _hearers(nodes: int, cause: AttemptEnd) -> int:
    """How many nodes hear of ``cause``: all but its writer, and a vanished node; none
    for a lost store (nothing can be heard through it)."""
    if cause.reason is EndReason.STORE_LOST:
        return 0
    return nodes - 1 - (cause.reason is EndReason.VANISHED)
