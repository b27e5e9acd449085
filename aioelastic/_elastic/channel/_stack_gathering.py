"""Gathering every rank's stack across the job through the store, for one report.

A node that wants every rank's stack (``kill -URG``, a stall) takes a request number and
bumps the news counter; every node answers on its next beat with its own ranks' stacks,
and the asker groups them into one report (`JobStacks`), naming the nodes that did not
answer within `STACKS_TIMEOUT` seconds.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

import anyio

from ._job_stacks import JobStacks, RankStack
from ._link import AttemptLink

__all__ = ["STACKS_TIMEOUT", "Capture", "StackGathering"]

logger = logging.getLogger("aioelastic.agent")

STACKS_TIMEOUT = 10.0
"""Seconds a node may take to capture its ranks' stacks, and the asker waits for all."""

Capture = Callable[[], Awaitable[list[tuple[int, int, str]]]]
"""Captures this node's stacks: ``[(global rank, pid, text), ...]``."""


class StackGathering:
    """One node's side of the stack requests: answering them, and asking.

    Args:
        link: the attempt's keys and the thread that calls the store.
        beat: seconds between two looks at the answers while gathering: the node's beats
            run on the same thread in between.
    """

    def __init__(self, link: AttemptLink, beat: float) -> None:
        self._link = link
        self._beat = beat
        # The next request to look at, and the requests this node answered (its own
        # among them).
        self._next_request = 1
        self._answered: set[int] = set()

    def next_request(self) -> int | None:
        """Blocking: a request this node has not answered yet, if any (the oldest)."""
        asked = self._link.store.add(self._link.key("stacks"), 0)
        while self._next_request <= asked:
            request = self._next_request
            self._next_request += 1
            if request not in self._answered:
                return request
        return None

    async def answer(self, request: int, capture: Capture | None) -> None:
        """Answer ``request`` with this node's stacks (none when ``capture`` is None).

        A capture that fails or takes over `STACKS_TIMEOUT` is answered as such: the asker
        names this node as not answering. A store that fails meanwhile is logged: the
        beats judge the store.
        """
        stacks = await _captured(capture) if capture is not None else []
        try:
            await self._link.call(lambda: self._answer(request, stacks))
        except Exception as e:
            logger.warning(
                "could not answer stack request %d: %s",
                request,
                self._link.site.failure(e, self._link.store_lost_after),
            )

    def _answer(self, request: int, stacks: list[tuple[int, int, str]] | None) -> None:
        link = self._link
        self._answered.add(request)
        # "captured": False for a capture that gave nothing in time; a reader of an older
        # version sees no ranks, as it did before.
        answer = {
            "node": link.node,
            "host": link.host,
            "ranks": stacks or [],
            "captured": stacks is not None,
        }
        link.store.set(link.key(f"stacks/{request}/node/{link.node}"), json.dumps(answer))
        if link.store.add(link.key(f"stacks/{request}/answers"), 1) >= link.nodes:
            link.store.set(link.key(f"stacks/{request}/done"), "1")

    async def gather(self, capture: Capture, timeout: float = STACKS_TIMEOUT) -> JobStacks:
        """Every rank's stack across the job, through the store (see `JobStacks`).

        Asks every node (each answers on its next beat with ``capture()`` of its own),
        answers for this one, and waits up to ``timeout`` seconds for the others (less if
        the attempt ends meanwhile: see `AttemptLink.close`); a node that does not answer
        in time is named in the report. A store that fails or stays silent (each call
        bounded by ``store_lost_after``) gives this node's own stacks, the store named.
        """

        def ask() -> int:
            request = int(self._link.store.add(self._link.key("stacks"), 1))
            # Before the news: this node's own beat must not answer it a second time.
            self._answered.add(request)
            self._link.announce()
            return request

        with self._link.held():
            logger.info("asking every node for its ranks' stacks")
            try:
                request = await self._link.call(ask)
            except Exception as e:
                return self._without_store(await _captured(capture), e)
            own = await _captured(capture)
            try:
                await self._link.call(lambda: self._answer(request, own))
                cut_short = await self._wait_for_answers(request, timeout)
                return await self._link.call(partial(self._collect, request, cut_short))
            except Exception as e:
                return self._without_store(own, e)

    def _without_store(self, own: list[tuple[int, int, str]] | None, error: Exception) -> JobStacks:
        """The report when the store failed mid-gather: this node's stacks, the others
        named as not answering, and why."""
        link = self._link
        failure = link.site.failure(error, link.store_lost_after)
        logger.warning("could not gather the other nodes' stacks: %s", failure)
        return JobStacks(
            tuple(
                RankStack(rank, link.node, link.host, pid, text) for rank, pid, text in own or []
            ),
            tuple(f"node {node}" for node in range(link.nodes) if node != link.node),
            f"node {link.node} ({link.host})",
            note=f"{failure}: the other nodes could not be asked",
        )

    async def _wait_for_answers(self, request: int, timeout: float) -> bool:
        """Wait for every answer; whether the attempt's end cut the wait short."""
        done = self._link.key(f"stacks/{request}/done")

        def answered_within(seconds: float) -> bool:
            try:
                self._link.store.wait([done], datetime.timedelta(seconds=seconds))
            except Exception:
                # Not yet, or the store failed (torch raises DistStoreError for both):
                # check() tells them apart, raising for a store that fails.
                return bool(self._link.store.check([done]))
            return True

        # A beat's worth of waiting at a time: this node's beats run on the same thread in
        # between, so it stays alive to its watcher and answers the requests of nodes that
        # ask at the same time (nodes that stall together each ask every other).
        # The attempt ending (close()) ends the wait too: a node that never answered
        # is why it ended, often (a node stopped or wedged is found vanished within
        # DEAD_AFTER, before this timeout), and the report of who answered is due now.
        link = self._link
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and not link.closing:
            wait = max(min(self._beat, left), 0.01)
            if await link.call(partial(answered_within, wait), wait + link.store_lost_after):
                return False
        return link.closing and deadline - time.monotonic() > 0

    def _collect(self, request: int, cut_short: bool = False) -> JobStacks:
        link = self._link
        stacks: list[RankStack] = []
        missing: list[str] = []
        for node in range(link.nodes):
            key = link.key(f"stacks/{request}/node/{node}")
            answer = json.loads(link.store.get(key)) if link.store.check([key]) else None
            if answer is None or not answer.get("captured", True):
                missing.append(f"node {node} ({link.published_host(node) or '?'})")
                continue
            stacks += [
                RankStack(rank, answer["node"], answer["host"], pid, text)
                for rank, pid, text in answer["ranks"]
            ]
        # Said, not only done: a report cut short by the attempt's end (a silent node found
        # vanished) reads apart from one whose nodes let the whole timeout pass.
        note = "the attempt ended before every node answered" if missing and cut_short else ""
        asker = f"node {link.node} ({link.host})"
        return JobStacks(tuple(stacks), tuple(missing), asker, note)


async def _captured(capture: Capture) -> list[tuple[int, int, str]] | None:
    """``capture()``, or None when it fails or takes over `STACKS_TIMEOUT` (logged)."""
    try:
        with anyio.fail_after(STACKS_TIMEOUT):
            return await capture()
    except Exception as e:
        why = f"it took over {STACKS_TIMEOUT:g} s" if isinstance(e, TimeoutError) else e
        logger.warning("could not capture this node's stacks: %s", why)
        return None
