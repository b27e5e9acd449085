"""What the nodes of one attempt tell each other: who ended it and why, and who is alive.

torch's agents learn about other nodes only through their own workers. With gloo a rank
sees a dead peer at once and fails by itself; with NCCL the surviving ranks block in the
collective until its timeout (10-30 minutes), and a node whose launcher was SIGKILLed
tells nobody at all. So every agent of a multi-node job keeps a channel open through the
store the rendezvous already gives every node (no new server), under keys of ours scoped
to the round and the attempt:

* **ending the attempt**: the node that ends it first — a worker failed, a stall or timer
  fired, the launcher was signalled, restarts ran out — takes ticket 1 of a counter and
  writes why (`AttemptEnd`) under it; later enders take later tickets. Every node reads the
  counter once a `BEAT`; seeing it move, it stops its workers and reports ticket 1, the
  root cause, whatever ended its own workers afterwards.
* **being alive**: each node bumps a counter of its own once a beat and watches the next
  node in rank order that has not finished (a ring: one read per node per beat whatever
  the number of nodes). A counter that stays still for `DEAD_AFTER` seconds means that
  node vanished (its launcher and workers SIGKILLed, its machine lost): the watcher ends
  the attempt on its behalf.
* **finishing**: a node whose workers all succeeded marks its counter done, so that its
  silence in the exit barrier is not taken for death.
* **stacks**: a node that wants every rank's stack (``kill -URG``, `gather_stacks`) takes a
  request number; every node answers on its next beat with its own ranks' stacks, and the
  asker groups them into one report (`JobStacks`).

Ends and stack requests both bump one ``news`` counter, which is what a beat reads, so a
stack request costs the beats nothing.

Cost, per node and beat: three requests of a few bytes to the store (bump, read the
neighbour, read the news counter) — 6 requests a second at the default beat, so 6,000 a
second for a 1,000-node job, which a TCPStore or etcd serves easily. Detection: a peer's end
within one beat plus a round trip; a vanished node within `DEAD_AFTER` plus a beat.

The store calls block, so they run on a daemon thread of the channel's own (not the
rendezvous handler's: a join or a poll stuck on a dead store must not delay a beat), and
each beat is bounded: a store that answers nothing for `STORE_LOST_AFTER` seconds ends the
attempt as lost (for ``c10d`` the store lives in the first node's launcher, a single point
of failure that etcd does not have).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import TypeVar

import anyio

from ..._core.child._error_file import NOT_AVAILABLE
from ..._core.process._exit_status import exit_description
from ..._core.reports._failures import ProcessFailure
from ..store._serial_thread import SerialThread
from ..store._worker_store import Store
from ._job_stacks import JobStacks, RankStack

__all__ = [
    "BEAT",
    "DEAD_AFTER",
    "SINGLE_STORE_LOST_AFTER",
    "STORE_LOST_AFTER",
    "STACKS_TIMEOUT",
    "AttemptEnd",
    "Capture",
    "EndReason",
    "JobChannel",
    "end_of_failure",
]

logger = logging.getLogger("aioelastic.agent")

BEAT = 0.5
"""Seconds between two beats: a bump of this node's counter and a look at the others."""

DEAD_AFTER = 5.0
"""Seconds a watched node's counter may stay still, the store answering, before it is lost."""

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

STACKS_TIMEOUT = 10.0
"""Seconds a node may take to capture its ranks' stacks, and the asker waits for all."""

_T = TypeVar("_T")

Capture = Callable[[], Awaitable[list[tuple[int, int, str]]]]
"""Captures this node's stacks: ``[(global rank, pid, text), ...]``."""

# A counter past this is a node that finished (its workers succeeded): never dead.
_DONE = 1 << 40
# Quoted in full by every node's report: a whole traceback is in the node's own log.
_MESSAGE_LIMIT = 4096


class EndReason:
    """Why a node ended an attempt (the values of `AttemptEnd.reason`)."""

    WORKER_FAILED = "worker_failed"
    SIGNAL = "signal"
    CANCELLED = "cancelled"
    ERROR = "error"
    VANISHED = "vanished"
    STORE_LOST = "store_lost"


@dataclass(frozen=True)
class AttemptEnd:
    """Why one node ended the job's attempt, as every node is told.

    Attributes:
        node: the group rank of the node the end is about.
        host: that node's address as its peers know it.
        reason: one of `EndReason`.
        detail: what happened, one line (``"rank 5 exited 7 (ValueError: bad lr)"``).
        final: the job ends: no node joins another round (an exit code that is never
            retried, restarts used up, the store lost).
        counts: the end uses one of the job's restarts.
        rank: the global rank of the worker that failed, if one did.
        local_rank: its local rank on that node (-1 when none failed).
        pid: its process id.
        exitcode: its exit status (negative: killed by that signal).
        timestamp: when it happened, seconds since the epoch.
        message: the failed worker's report (its error or last stderr lines), bounded.
    """

    node: int
    host: str
    reason: str
    detail: str
    final: bool = False
    counts: bool = True
    rank: int | None = None
    local_rank: int = -1
    pid: int = -1
    exitcode: int = 1
    timestamp: float = 0.0
    message: str = ""

    def describe(self) -> str:
        """``"node 2 (host h) failed: rank 5 exited 7 ..."``, for reports and logs."""
        verb = {
            EndReason.WORKER_FAILED: "failed:",
            EndReason.SIGNAL: "was stopped by",
            EndReason.CANCELLED: "was cancelled:",
            EndReason.ERROR: "failed:",
            EndReason.VANISHED: "vanished:",
            EndReason.STORE_LOST: "lost the rendezvous store:",
        }.get(self.reason, self.reason)
        return f"node {self.node} ({self.host}) {verb} {self.detail}".rstrip()

    def as_failure(self) -> ProcessFailure:
        """This end as a failure for a report on another node (``"stopped: node 2 ..."``)."""
        return ProcessFailure(
            local_rank=self.local_rank,
            pid=self.pid,
            exitcode=self.exitcode,
            error_file=NOT_AVAILABLE,
            message="\n".join(filter(None, [f"stopped: {self.describe()}", self.message])),
            timestamp=self.timestamp or time.time(),
            host=self.host,
        )

    def to_json(self) -> str:
        """The form stored for the other nodes."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> AttemptEnd:
        """Read what another node stored (unknown keys of a newer version are ignored)."""
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


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
    ) -> None:
        self._store = store
        self._scope = scope
        self.node = node
        self.nodes = nodes
        self.host = host
        self._restarts = restarts
        self.beat = beat
        self.dead_after = dead_after
        self.store_lost_after = store_lost_after
        self.failing_lost_after = (
            store_lost_after if failing_lost_after is None else failing_lost_after
        )
        self._thread = SerialThread(f"aioelastic-job-{scope}")
        # The ring: the next node this one watches, its counter and when it last moved.
        self._watched = (node + 1) % nodes
        self._watched_count = -1
        self._watched_since = time.monotonic()
        self._ended: AttemptEnd | None = None
        # Whether this node took ticket 1 or counted itself among those that heard.
        self._told = False
        # The news counter as last handled, the next stack request to look at, and the
        # requests this node answered (its own among them).
        self._news = 0
        self._next_request = 1
        self._answered: set[int] = set()
        # Stack reports being gathered, and whether the attempt ended meanwhile: the
        # thread then outlives close() until the last of them collected its answers.
        self._gathering = 0
        self._closing = False

    def __repr__(self) -> str:
        return (
            f"<JobChannel {self._scope!r} node {self.node}/{self.nodes} "
            f"watching {self._watched}{' ended' if self._ended else ''}>"
        )

    def _key(self, name: str) -> str:
        return f"{self._scope}/{name}"

    async def _call(self, fn: Callable[[], _T], timeout: float) -> _T:
        with anyio.fail_after(timeout):
            return await self._thread.call(fn)

    async def open(self) -> None:
        """Say who this node is and that it is alive (before its workers start)."""

        def hello() -> None:
            self._store.set(self._key(f"host/{self.node}"), self.host)
            self._store.add(self._key(f"alive/{self.node}"), 1)

        await self._call(hello, self.store_lost_after)

    async def watch(self, capture: Capture | None = None) -> AttemptEnd:
        """Beat until another node ends the attempt or one is lost; why (the root cause).

        Meanwhile answers the other nodes' requests for stacks with ``capture()``. Never
        returns for a node alone in its round. A store that stays silent or failing for
        ``store_lost_after`` seconds is an end too (`EndReason.STORE_LOST`).
        """
        if self.nodes == 1:
            await anyio.sleep_forever()  # a node alone: nobody to hear from
        failing_since: float | None = None
        while True:
            await anyio.sleep(self.beat)
            try:
                end = await self._call(self._beat, self.store_lost_after)
            except Exception as e:
                now = time.monotonic()
                failing_since = failing_since or now
                # While the store fails nobody's counter can move: judge stillness afresh
                # once it answers again, not across the outage.
                self._watched_since = math.inf
                # A beat that hung for store_lost_after already counts as that long.
                if isinstance(e, TimeoutError):
                    return self._store_lost(e, self.store_lost_after)
                if now - failing_since >= self.failing_lost_after:
                    return self._store_lost(e, now - failing_since)
                logger.debug("job channel beat failed: %s", e)
                continue
            failing_since = None
            if isinstance(end, int):
                await self._answer_request(end, capture)
            elif end is not None:
                return end

    def _beat(self) -> AttemptEnd | int | None:
        """One beat: an end (the root cause), a stack request to answer (its number), or None."""
        store = self._store
        store.add(self._key(f"alive/{self.node}"), 1)
        news = store.add(self._key("news"), 0)
        if news != self._news:
            if store.add(self._key("ends"), 0) > 0:
                return self._root_cause()
            asked = store.add(self._key("stacks"), 0)
            while self._next_request <= asked:
                request = self._next_request
                self._next_request += 1
                if request not in self._answered:
                    return request  # news is read again next beat: more may wait
            self._news = news
        if self._watched == self.node:
            return None  # nobody left to watch: every other node finished
        count = store.add(self._key(f"alive/{self._watched}"), 0)
        now = time.monotonic()
        if count >= _DONE:
            self._watch_next()
            return None
        if count != self._watched_count or self._watched_since == math.inf:
            self._watched_count, self._watched_since = count, now
            return None
        if now - self._watched_since < self.dead_after:
            return None
        lost = self._watched
        host = store.get(self._key(f"host/{lost}")).decode("utf-8", "replace")
        return self._end(
            AttemptEnd(
                node=lost,
                host=host,
                reason=EndReason.VANISHED,
                detail=(
                    f"no heartbeat for {self.dead_after:g} s (its launcher was killed or "
                    "its machine lost); seen by node "
                    f"{self.node} ({self.host})"
                ),
                exitcode=-9,
                timestamp=time.time(),
            )
        )

    async def _answer_request(self, request: int, capture: Capture | None) -> None:
        stacks: list[tuple[int, int, str]] = []
        if capture is not None:
            try:
                with anyio.fail_after(STACKS_TIMEOUT):
                    stacks = await capture()
            except Exception as e:
                logger.warning("could not capture this node's stacks: %s", e)
        await self._call(lambda: self._answer(request, stacks), self.store_lost_after)

    def _answer(self, request: int, stacks: list[tuple[int, int, str]]) -> None:
        store = self._store
        self._answered.add(request)
        answer = {"node": self.node, "host": self.host, "ranks": stacks}
        store.set(self._key(f"stacks/{request}/node/{self.node}"), json.dumps(answer))
        if store.add(self._key(f"stacks/{request}/answers"), 1) >= self.nodes:
            store.set(self._key(f"stacks/{request}/done"), "1")

    async def gather_stacks(self, capture: Capture, timeout: float = STACKS_TIMEOUT) -> JobStacks:
        """Every rank's stack across the job, through the store (see `JobStacks`).

        Asks every node (each answers on its next beat with ``capture()`` of its own),
        answers for this one, and waits up to ``timeout`` seconds for the others (less if
        the attempt ends meanwhile: see `close`); a node that does not answer in time is
        named in the report.
        """

        def ask() -> int:
            request = int(self._store.add(self._key("stacks"), 1))
            # Before the news: this node's own beat must not answer it a second time.
            self._answered.add(request)
            self._store.add(self._key("news"), 1)
            return request

        self._gathering += 1
        try:
            request = await self._call(ask, self.store_lost_after)
            return await self._gather(request, capture, timeout)
        finally:
            self._gathering -= 1
            if self._closing and not self._gathering:
                self._thread.close()

    async def _gather(self, request: int, capture: Capture, timeout: float) -> JobStacks:
        try:
            with anyio.fail_after(STACKS_TIMEOUT):
                own = await capture()
        except Exception as e:
            logger.warning("could not capture this node's stacks: %s", e)
            own = []
        await self._call(lambda: self._answer(request, own), self.store_lost_after)

        done = self._key(f"stacks/{request}/done")

        def answered_within(seconds: float) -> bool:
            try:
                self._store.wait([done], datetime.timedelta(seconds=seconds))
            except Exception:
                return False  # not yet (or the store failed: the answers tell below)
            return True

        # A beat's worth of waiting at a time: this node's beats run on the same thread in
        # between, so it stays alive to its watcher and answers the requests of nodes that
        # ask at the same time (nodes that stall together each ask every other).
        # The attempt ending (close()) ends the wait too: a node that never answered
        # is why it ended, often (a node stopped or wedged is found vanished within
        # DEAD_AFTER, before this timeout), and the report of who answered is due now.
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and not self._closing:
            wait = max(min(self.beat, left), 0.01)
            if await self._call(partial(answered_within, wait), wait + self.store_lost_after):
                break

        def collect() -> JobStacks:
            store = self._store
            stacks: list[RankStack] = []
            missing: list[str] = []
            for node in range(self.nodes):
                key = self._key(f"stacks/{request}/node/{node}")
                if not store.check([key]):
                    host_key = self._key(f"host/{node}")
                    host = store.get(host_key).decode() if store.check([host_key]) else "?"
                    missing.append(f"node {node} ({host})")
                    continue
                answer = json.loads(store.get(key))
                stacks += [
                    RankStack(rank, answer["node"], answer["host"], pid, text)
                    for rank, pid, text in answer["ranks"]
                ]
            return JobStacks(tuple(stacks), tuple(missing), f"node {self.node} ({self.host})")

        return await self._call(collect, self.store_lost_after)

    def _watch_next(self) -> None:
        self._watched = (self._watched + 1) % self.nodes
        self._watched_count, self._watched_since = -1, time.monotonic()

    def _end(self, end: AttemptEnd) -> AttemptEnd:
        ticket = self._store.add(self._key("ends"), 1)
        if ticket == 1 and end.counts and self._restarts is not None:
            job_store, key = self._restarts
            job_store.add(key, 1)
        self._store.set(self._key(f"end/{ticket}"), end.to_json())
        self._store.add(self._key("news"), 1)
        if ticket == 1:
            self._told = True
            return end
        return self._root_cause()

    def _root_cause(self) -> AttemptEnd:
        """Ticket 1's end; final if any node's end is (an exit code never retried there).

        Each ticket's writer sets its key right after taking the ticket: get() waits out
        the moment in between.
        """
        store = self._store
        tickets = store.add(self._key("ends"), 0)
        ends = [
            AttemptEnd.from_json(store.get(self._key(f"end/{t}"))) for t in range(1, tickets + 1)
        ]
        root = ends[0]
        if not root.final and any(end.final for end in ends):
            root = dataclasses.replace(root, final=True)
        if not self._told:
            # This node has heard; the last to hear frees whoever lingers (see linger).
            self._told = True
            if store.add(self._key("heard"), 1) >= _hearers(self.nodes, root):
                store.set(self._key("all_heard"), "1")
        return root

    async def end(self, end: AttemptEnd, timeout: float | None = None) -> AttemptEnd:
        """Tell every node that this one ends the attempt; the root cause of the end.

        The root cause is ``end`` itself unless another node ended the attempt first.
        Bounded by ``timeout`` (default ``store_lost_after``): a store that does not answer
        leaves ``end`` as the root cause, logged.
        """
        if self._ended is not None:
            return self._ended
        try:
            self._ended = await self._call(lambda: self._end(end), timeout or self.store_lost_after)
        except Exception as e:
            logger.warning("could not tell the other nodes why this node ended: %s", e)
            self._ended = end
        return self._ended

    async def cause(self, known: AttemptEnd) -> AttemptEnd:
        """The attempt's root cause read afresh (every end so far), else ``known``."""
        try:
            return await self._call(self._root_cause, self.store_lost_after)
        except Exception as e:
            logger.warning("could not read why the other nodes ended: %s", e)
            return known

    async def linger(self, cause: AttemptEnd, timeout: float | None = None) -> None:
        """Before leaving the job: wait until every other live node heard ``cause``.

        The store may live in this node's launcher (``c10d``'s host): leaving at once
        would take it away before a slower node read why the job ended, and that node
        would report a lost store instead of the root cause. Bounded by ``timeout``
        (default ``dead_after``); a node that never hears is a node that is gone.
        """
        if _hearers(self.nodes, cause) <= 0:
            return
        bound = timeout or self.dead_after
        key = self._key("all_heard")

        def wait() -> None:
            self._store.wait([key], datetime.timedelta(seconds=bound))

        try:
            await self._call(wait, bound + 1)
        except Exception as e:
            logger.debug("not every node heard why the job ended: %s", e)

    async def finish(self) -> None:
        """This node's workers all succeeded: its silence from now on is not death."""
        try:
            await self._call(
                lambda: self._store.add(self._key(f"alive/{self.node}"), _DONE),
                self.store_lost_after,
            )
        except Exception as e:
            logger.warning("could not tell the other nodes this node finished: %s", e)

    def close(self) -> None:
        """Let the channel's thread end (an abandoned store call finishes first).

        A stack report being gathered stops waiting and still collects the answers
        given so far (its thread ends after that).
        """
        self._closing = True
        if not self._gathering:
            self._thread.close()

    def _store_lost(self, error: BaseException, lasted: float) -> AttemptEnd:
        why = "no answer" if isinstance(error, TimeoutError) else f"{type(error).__name__}"
        return AttemptEnd(
            node=self.node,
            host=self.host,
            reason=EndReason.STORE_LOST,
            detail=(
                f"the rendezvous store gave {why} for {lasted:.1f} s; with c10d it "
                "lives in the first node's launcher, a single point of failure: use "
                "--rdzv-backend etcd-v2 (or etcd) for a job that must survive it"
            ),
            final=True,
            exitcode=1,
            timestamp=time.time(),
        )


def _hearers(nodes: int, cause: AttemptEnd) -> int:
    """How many nodes hear of ``cause``: all but its writer, and a vanished node."""
    return nodes - 1 - (cause.reason == EndReason.VANISHED)


def end_of_failure(
    node: int, host: str, rank: int, local_rank: int, failure: ProcessFailure, *, final: bool
) -> AttemptEnd:
    """The `AttemptEnd` of this node's worker ``rank`` (``local_rank``) failing."""
    signal_name = failure.signal_name() if failure.exitcode < 0 else None
    status = f"was killed by {signal_name}" if signal_name else f"exited {failure.exitcode}"
    message = (failure.message or "").strip()
    if len(message) > _MESSAGE_LIMIT:
        message = "..." + message[-_MESSAGE_LIMIT:]
    # The last line says most (a traceback's exception); a bare exit description only
    # repeats the status.
    last = message.rsplit("\n", 1)[-1].strip()
    summary = "" if last == exit_description(failure.exitcode) else f" ({last})"
    return AttemptEnd(
        node=node,
        host=host,
        reason=EndReason.WORKER_FAILED,
        detail=f"rank {rank} {status}{summary}",
        message=message if summary else "",
        final=final,
        rank=rank,
        local_rank=local_rank,
        pid=failure.pid,
        exitcode=failure.exitcode,
        timestamp=failure.timestamp,
    )
