"""One node's way to an attempt's keys in the round's store, shared by the channel's protocols.

Every key of the job channel lives under the attempt's scope in the store the rendezvous
gives every node (no new server). The store calls block, so they run on a daemon thread of
the channel's own (not the rendezvous handler's: a join or a poll stuck on a dead store must
not delay a beat), one at a time, and each is bounded: a store that answers nothing for
`STORE_LOST_AFTER` seconds ends the attempt as lost (for ``c10d`` the store lives in one
node's launcher, a single point of failure that etcd does not have). An outage is timed
from the start of the first call that did not succeed (`Outage`), so a store whose calls
each fail after seconds of their own (an etcd cluster without quorum) is lost after
`STORE_LOST_AFTER`, not that plus a call.

The protocols that use the link (`EndTickets`, `Ring`, `StackGathering`) each own their
keys; the one key they share is ``news``, a counter that ends and stack requests bump and
that every beat reads, so that a stack request costs the beats nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import anyio

from ..store._serial_thread import SerialThread
from ..store._worker_store import Store
from ._attempt_end import AttemptEnd, end_of_lost_store
from ._store_site import StoreSite

__all__ = ["SINGLE_STORE_LOST_AFTER", "STORE_LOST_AFTER", "AttemptLink", "Outage"]

STORE_LOST_AFTER = 10.0
"""Seconds the store may fail or stay silent before the attempt ends as lost.

Longer than `DEAD_AFTER`: an etcd cluster that loses its leader fails the requests caught
in the election after its request timeout (5 s plus two election timeouts: 7 s at etcd's
defaults) and then answers again; that is not a lost store.
"""

SINGLE_STORE_LOST_AFTER = 1.0
"""Seconds a store with no replicas (c10d's, in the first node's launcher) may fail.

Its failures are not an election's: refused or reset connections mean that its process is
gone, and nothing brings it back. Two beats, so that one failed call is not yet a loss. A
call that hangs still has `STORE_LOST_AFTER`: a host under load may answer late.
"""

_T = TypeVar("_T")


class AttemptLink:
    """This node, the attempt's keys in the round's store, and the thread that calls it.

    Args:
        store: the round's store, shared by every node of the round.
        scope: the attempt's key prefix in ``store`` (unique to the round and attempt).
        node: this node's group rank.
        nodes: the number of nodes in the round.
        host: this node's address as its peers know it.
        store_lost_after: the bound of each store call, seconds (`STORE_LOST_AFTER`).
        site: the store as reports name it.
    """

    def __init__(
        self,
        store: Store,
        scope: str,
        *,
        node: int,
        nodes: int,
        host: str,
        store_lost_after: float = STORE_LOST_AFTER,
        site: StoreSite | None = None,
    ) -> None:
        self.store = store
        self.scope = scope
        self.node = node
        self.nodes = nodes
        self.host = host
        self.store_lost_after = store_lost_after
        self.site = site or StoreSite()
        #: Whether the last call gave no answer in time (it may still block the thread).
        self.unanswered = False
        #: Whether the attempt ended (`close`): waits that outlive it stop early.
        self.closing = False
        self._thread = SerialThread(f"aioelastic-job-{scope}")
        self._held = 0

    def key(self, name: str) -> str:
        """``name`` under the attempt's scope."""
        return f"{self.scope}/{name}"

    async def call(self, fn: Callable[[], _T], timeout: float | None = None) -> _T:
        """``fn()`` on the link's thread, bounded by ``timeout`` (``store_lost_after``).

        Raises:
            TimeoutError: no answer in time (the call still finishes on the thread).
        """
        try:
            with anyio.fail_after(self.store_lost_after if timeout is None else timeout):
                result = await self._thread.call(fn)
        except TimeoutError:
            self.unanswered = True
            raise
        self.unanswered = False
        return result

    def introduce(self) -> None:
        """Blocking: publish this node's address, for the reports of the other nodes."""
        self.store.set(self.key(f"host/{self.node}"), self.host)

    def host_of(self, node: int) -> str:
        """Blocking: the address ``node`` published, waited for as the store's ``get`` waits
        (up to the store's own timeout, then its error)."""
        return str(self.store.get(self.key(f"host/{node}")), "utf-8", "replace")

    def published_host(self, node: int) -> str | None:
        """Blocking: the address ``node`` published, None when it published none yet."""
        if not self.store.check([self.key(f"host/{node}")]):
            return None
        return self.host_of(node)

    def news(self) -> int:
        """Blocking: the news counter (bumped by every end and every stack request)."""
        return int(self.store.add(self.key("news"), 0))

    def announce(self) -> None:
        """Blocking: bump the news counter, so that every node's next beat looks."""
        self.store.add(self.key("news"), 1)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the thread past `close` until this block ends (a report being gathered)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if self.closing and not self._held:
                self._thread.close()

    def close(self) -> None:
        """Let the thread end once the calls queued and the blocks `held` are done."""
        self.closing = True
        if not self._held:
            self._thread.close()


class Outage:
    """When the store counts as lost, for one node's beats.

    An outage starts with the first call that does not succeed, at that call's start. The
    store is lost once it stayed silent for ``store_lost_after`` seconds since then (each
    call is bounded by what is left of that), or failed for ``failing_lost_after``.

    Args:
        link: the attempt's link (this node, the store's bound and site).
        failing_lost_after: seconds of failing calls after which the store is lost.
    """

    def __init__(self, link: AttemptLink, failing_lost_after: float) -> None:
        self._link = link
        self._failing_lost_after = failing_lost_after
        #: When the first call that did not succeed started, None while the store answers.
        self.since: float | None = None
        self._error: BaseException | None = None

    def bound(self, started: float) -> float:
        """The bound of a call that starts at ``started``: what is left of the outage."""
        since = started if self.since is None else self.since
        return max(0.0, since + self._link.store_lost_after - started)

    def failed(self, error: BaseException, started: float) -> AttemptEnd | None:
        """A call that started at ``started`` failed: the store's loss, once it is lost."""
        if self.since is None:
            self.since = started
        if not isinstance(error, TimeoutError):
            self._error = error
        lasted = time.monotonic() - self.since
        if not isinstance(error, TimeoutError) and lasted < self._failing_lost_after:
            return None
        link = self._link
        why = "no answer" if self._error is None else type(self._error).__name__
        return end_of_lost_store(link.node, link.host, why, lasted, link.site)

    def answered(self) -> None:
        """A call succeeded: the outage, if any, is over."""
        self.since, self._error = None, None
