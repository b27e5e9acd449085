"""The job channel's three protocols over an in-memory store: end tickets, liveness, stacks.

Several `JobChannel`s share one `MemoryStore`, as the nodes of a round share the
rendezvous store, each on its own thread; no torch, no process, a few seconds in all. The
multi-process tests of the same protocols (real launchers, torch's store, SIGKILLed nodes)
are in ``tests/elastic/channel/test_multinode.py``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from aioelastic._core.reports._failures import ProcessFailure
from aioelastic._elastic.channel._attempt_end import AttemptEnd, end_of_failure
from aioelastic._elastic.channel._job_channel import JobChannel
from aioelastic._elastic.observe._events import EndReason
from tests.elastic.channel.memory_channels import (
    ALLOWANCE,
    BEAT,
    RESTARTS,
    SCOPE,
    channels,
    stacks_of,
)
from tests.elastic.channel.memory_store import MemoryStore

pytestmark = pytest.mark.timeout(30)


def failure_end(node: int, rank: int, *, final: bool = False) -> AttemptEnd:
    failure = ProcessFailure(
        local_rank=0, pid=1000 + rank, exitcode=7, error_file="", message="ValueError: bad lr"
    )
    return end_of_failure(node, f"h{node}", rank, 0, failure, final=final)


@asynccontextmanager
async def watching(*watchers: JobChannel) -> AsyncIterator[dict[int, AttemptEnd]]:
    """Each channel's `watch` running (answering stack requests); what each one heard."""
    heard: dict[int, AttemptEnd] = {}

    async def watch(channel: JobChannel) -> None:
        heard[channel.node] = await channel.watch(stacks_of(channel.node))

    async with anyio.create_task_group() as tg:
        for channel in watchers:
            tg.start_soon(watch, channel)
        yield heard
        tg.cancel_scope.cancel()


async def until(condition: Callable[[], bool], within: float) -> None:
    with anyio.fail_after(within):
        while not condition():
            await anyio.sleep(BEAT / 2)


# -- end tickets -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_first_end_is_the_root_cause_on_every_node() -> None:
    store = MemoryStore()
    with channels(store, 3) as (first, second, third):
        for channel in (first, second, third):
            await channel.open()
        async with watching(first) as heard:
            root = await third.end(failure_end(2, rank=5))
            later = await second.end(failure_end(1, rank=3))
            await until(lambda: 0 in heard, within=ALLOWANCE)
        # Ticket 1 is node 2's: the node that ended second reports it, and so does the
        # node that only heard; node 1's own end is kept under ticket 2.
        assert (root.node, root.rank) == (2, 5)
        assert later == root
        assert heard[0] == root
        assert heard[0].describe().startswith("node 2 (h2) failed: rank 5 exited 7")
        assert store.add(f"{SCOPE}/ends", 0) == 2
        # Only the holder of ticket 1 counts the job's restart.
        assert store.add(RESTARTS, 0) == 1


@pytest.mark.asyncio
async def test_a_later_final_end_makes_the_root_cause_final() -> None:
    store = MemoryStore()
    with channels(store, 2) as (first, second):
        root = await first.end(failure_end(0, rank=0))
        assert not root.final
        await second.end(failure_end(1, rank=1, final=True))
        cause = await first.cause(root)
        assert (cause.node, cause.rank, cause.final) == (0, 0, True)


@pytest.mark.asyncio
async def test_nodes_ending_at_once_agree_on_one_root_cause() -> None:
    # The ticket counter's add is atomic: whatever the interleaving, one node holds ticket
    # 1 and every node reports its end.
    store = MemoryStore()
    roots: dict[int, AttemptEnd] = {}
    with channels(store, 8) as all_nodes:

        async def end(channel: JobChannel) -> None:
            roots[channel.node] = await channel.end(failure_end(channel.node, channel.node))

        async with anyio.create_task_group() as tg:
            for channel in all_nodes:
                tg.start_soon(end, channel)
    assert len(set(roots.values())) == 1
    (root,) = set(roots.values())
    assert root == AttemptEnd.from_json(store.get(f"{SCOPE}/end/1"))
    assert store.add(f"{SCOPE}/ends", 0) == 8
    assert store.add(RESTARTS, 0) == 1


def test_an_end_reads_the_same_on_the_wire() -> None:
    # Nodes of different versions read each other's ends: the reason is its plain value.
    end = failure_end(2, rank=5)
    assert '"reason": "worker_failed"' in end.to_json()
    assert AttemptEnd.from_json(end.to_json()) == end
    newer = end.to_json().replace('"worker_failed"', '"something_new"')
    assert AttemptEnd.from_json(newer).reason is EndReason.ERROR


# -- liveness ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_node_whose_beat_stops_is_reported_vanished_after_dead_after() -> None:
    dead_after = 0.5
    store = MemoryStore()
    with channels(store, 2, dead_after=dead_after) as (watcher, silent):
        await watcher.open()
        await silent.open()  # alive once, then never beats again
        started = time.monotonic()
        with anyio.fail_after(dead_after + ALLOWANCE):
            end = await watcher.watch()
        took = time.monotonic() - started
    assert (end.node, end.host, end.reason) == (1, "h1", EndReason.VANISHED)
    assert end.exitcode == -9
    assert "seen by node 0 (h0)" in end.detail
    assert took >= dead_after
    # The watcher took ticket 1 on the vanished node's behalf, so the others hear it.
    assert AttemptEnd.from_json(store.get(f"{SCOPE}/end/1")) == end


@pytest.mark.asyncio
async def test_a_node_that_beats_or_finished_is_not_taken_for_vanished() -> None:
    dead_after = 0.3
    store = MemoryStore()
    with channels(store, 3, dead_after=dead_after) as (first, second, third):
        for channel in (first, second, third):
            await channel.open()
        await third.finish()  # its workers succeeded: silent from now on, not dead
        async with watching(first, second) as heard:
            await anyio.sleep(4 * dead_after)
            assert heard == {}


# -- stacks --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_node_that_never_answers_a_stack_request_is_named_after_the_timeout() -> None:
    timeout = 0.6
    store = MemoryStore()
    with channels(store, 3) as (asker, answering, silent):
        for channel in (asker, answering, silent):
            await channel.open()
        async with watching(answering):
            started = time.monotonic()
            with anyio.fail_after(timeout + ALLOWANCE):
                report = await asker.gather_stacks(stacks_of(0), timeout=timeout)
            took = time.monotonic() - started
    assert [(s.rank, s.node, s.host, s.text) for s in report.stacks] == [
        (0, 0, "h0", "stack of node 0"),
        (10, 1, "h1", "stack of node 1"),
    ]
    assert report.missing == ("node 2 (h2)",)
    assert report.asked_by == "node 0 (h0)"
    assert took >= timeout


@pytest.mark.asyncio
async def test_the_stacks_come_back_once_every_node_answered() -> None:
    timeout = 10.0
    store = MemoryStore()
    with channels(store, 3) as (asker, *others):
        async with watching(*others):
            started = time.monotonic()
            report = await asker.gather_stacks(stacks_of(0), timeout=timeout)
            took = time.monotonic() - started
    assert sorted(s.rank for s in report.stacks) == [0, 10, 20]
    assert report.missing == ()
    # Within a few beats of the last answer, not at the timeout.
    assert took < ALLOWANCE
