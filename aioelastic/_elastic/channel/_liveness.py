"""Being alive: each node's beat counter, and the ring that finds a node that vanished.

Each node bumps a counter of its own once a beat and watches the next node in rank order
that has not finished (a ring: one read per node per beat whatever the number of nodes). A
counter that stays still for `DEAD_AFTER` seconds, the store answering, means that node
vanished (its launcher and workers SIGKILLed, its machine lost): the watcher ends the
attempt on its behalf. A node whose workers all succeeded marks its counter done, so that
its silence in the exit barrier is not taken for death; its watcher moves on to the next.

A node can also find that it stood still itself (`Stillness`: SIGSTOP, a frozen machine).
If it stood still for as long as the others give a silent store, and afterwards the node
it watches stops beating while no node wrote why, the others must have lost the store: it
lives in this node's launcher (``c10d``'s host), which stood still with it. Such a node
ends the attempt as a lost store, final, as the others did, instead of counting a restart
and waiting alone in the next round.
"""

from __future__ import annotations

import logging
import math
import time

from ._attempt_end import AttemptEnd, end_of_frozen_node, end_of_vanished
from ._link import AttemptLink

__all__ = ["DEAD_AFTER", "Ring", "Stillness"]

logger = logging.getLogger("aioelastic.agent")

DEAD_AFTER = 5.0
"""Seconds a watched node's counter may stay still, the store answering, before it is lost."""

# A counter past this is a node that finished (its workers succeeded): never dead.
_DONE = 1 << 40


class Ring:
    """One node's place in the ring: its own counter and the node it watches.

    The blocking methods run on the link's thread.

    Args:
        link: the attempt's keys and the thread that calls the store.
        dead_after: seconds of stillness after which a watched node is lost (`DEAD_AFTER`).
    """

    def __init__(self, link: AttemptLink, dead_after: float = DEAD_AFTER) -> None:
        self._link = link
        self.dead_after = dead_after
        # The next node this one watches, its counter and when it last moved.
        self.watched = (link.node + 1) % link.nodes
        self._watched_count = -1
        self._watched_since = time.monotonic()

    def _alive_key(self, node: int) -> str:
        return self._link.key(f"alive/{node}")

    def beat(self) -> None:
        """Blocking: bump this node's counter (also its first sign of life)."""
        self._link.store.add(self._alive_key(self._link.node), 1)

    def outage(self) -> None:
        """The store is failing: nobody's counter can move, so judge stillness afresh
        once it answers again, not across the outage."""
        self._watched_since = math.inf

    def lost(self) -> int | None:
        """Blocking: the watched node if its counter stayed still ``dead_after`` seconds."""
        if self.watched == self._link.node:
            return None  # nobody left to watch: every other node finished
        count = self._link.store.add(self._alive_key(self.watched), 0)
        now = time.monotonic()
        if count >= _DONE:
            self._watch_next()
            return None
        if count != self._watched_count or self._watched_since == math.inf:
            self._watched_count, self._watched_since = count, now
            return None
        if now - self._watched_since < self.dead_after:
            return None
        return self.watched

    def vanished(self, node: int, frozen_for: float | None = None) -> AttemptEnd:
        """Blocking: the end of ``node``, found lost, as its watcher tells it.

        ``frozen_for``: this node itself stood still that long just before (`Stillness`):
        then the others lost the store, and ``node`` only left with them.
        """
        link = self._link
        if frozen_for is not None:
            return end_of_frozen_node(
                link.node,
                link.host,
                frozen_for=frozen_for,
                silent=node,
                silent_host=link.host_of(node),
                lost_after=link.store_lost_after,
                site=link.site,
            )
        return end_of_vanished(
            node,
            link.host_of(node),
            dead_after=self.dead_after,
            seen_by=link.node,
            seen_by_host=link.host,
        )

    async def finish(self) -> None:
        """This node's workers all succeeded: its silence from now on is not death."""
        try:
            await self._link.call(
                lambda: self._link.store.add(self._alive_key(self._link.node), _DONE)
            )
        except Exception as e:
            logger.warning("could not tell the other nodes this node finished: %s", e)

    def _watch_next(self) -> None:
        self.watched = (self.watched + 1) % self._link.nodes
        self._watched_count, self._watched_since = -1, time.monotonic()


class Stillness:
    """Whether this node itself stood still lately, as seen from its beats.

    `tick` is called at each beat's start and again after its store calls; a gap between
    two ticks of ``frozen_after`` seconds (the bound the other nodes give a silent store) is
    remembered for ``remembered`` seconds: long enough for the watched node's counter to
    be found still (`DEAD_AFTER` after its last move, which is at the latest in the first
    beat after the gap).
    """

    def __init__(self, frozen_after: float, remembered: float) -> None:
        self.frozen_after = frozen_after
        self.remembered = remembered
        self._last = time.monotonic()
        # When a gap was seen, and how long it was.
        self._gap: tuple[float, float] | None = None

    def tick(self) -> None:
        """This node runs now."""
        now = time.monotonic()
        if now - self._last >= self.frozen_after:
            self._gap = (now, now - self._last)
        self._last = now

    def frozen_for(self) -> float | None:
        """How long this node stood still, if it did within the last ``remembered`` seconds."""
        if self._gap is None or time.monotonic() - self._gap[0] > self.remembered:
            return None
        return self._gap[1]
