"""The job channel's protocols when a node or the store fails mid-call, over an in-memory store.

A node killed between taking an end ticket and writing its end, a node whose stack
capture hangs or gives nothing in time, a store that fails while a node gathers stacks:
each is bounded by the channel's own time, not the store's read timeout, and named. The
same faults with real launchers and torch's store are in ``test_store_midcall.py``.
"""

from __future__ import annotations

import time

import anyio
import pytest

from aioelastic._elastic.channel import _stack_gathering
from aioelastic._elastic.channel._attempt_end import AttemptEnd
from aioelastic._elastic.channel._job_channel import JobChannel
from aioelastic._elastic.channel._link import STORE_LOST_AFTER
from aioelastic._elastic.channel._stack_gathering import Capture
from aioelastic._elastic.observe._events import EndReason
from tests.elastic.channel.memory_channels import ALLOWANCE, BEAT, SCOPE, channels, stacks_of
from tests.elastic.channel.memory_store import MemoryStore

pytestmark = pytest.mark.timeout(30)

#: c10d's read timeout: what a reader of a missing key waited for before (torch's default).
C10D_READ_TIMEOUT = 60.0


class BrokenStore(MemoryStore):
    """A `MemoryStore` whose every call fails once ``broken`` is set, as a killed c10d store's
    do (torch raises ``DistNetworkError``, a ``RuntimeError``)."""

    broken = False

    def _fail(self) -> None:
        if self.broken:
            raise ConnectionResetError("Connection reset by peer")

    def add(self, key: str, amount: int) -> int:
        self._fail()
        return super().add(key, amount)

    def check(self, keys: list[str]) -> bool:
        self._fail()
        return super().check(keys)


async def hangs() -> list[tuple[int, int, str]]:
    """A capture that never returns (a launcher whose capture is wedged)."""
    await anyio.sleep_forever()
    raise AssertionError("not reached")


async def watch_all(
    heard: dict[int, AttemptEnd], *watched: tuple[JobChannel, Capture | None]
) -> None:
    """Each channel's `watch` with its capture, until cancelled; what each heard."""

    async def watch(channel: JobChannel, capture: Capture | None) -> None:
        heard[channel.node] = await channel.watch(capture)

    async with anyio.create_task_group() as tg:
        for channel, capture in watched:
            tg.start_soon(watch, channel, capture)


@pytest.mark.asyncio
async def test_a_ticket_whose_end_never_comes_is_given_up_within_the_channels_bound() -> None:
    """Node 2 takes end ticket 1 and is killed before writing its end. Its watcher, node 1,
    finds it vanished after dead_after and takes ticket 2; node 1 and node 0, which hears,
    each wait for ticket 1's end no longer than the channel's `missing_after` (not the
    store's read timeout, 60 s for c10d: a beat would first end as a lost store after
    STORE_LOST_AFTER), and report node 2 vanished, by the end written under ticket 2."""
    dead_after = 0.5
    store = MemoryStore(timeout=C10D_READ_TIMEOUT)
    heard: dict[int, AttemptEnd] = {}
    with channels(store, 3, dead_after=dead_after) as (first, watcher, killed):
        for channel in (first, watcher, killed):
            await channel.open()
        store.add(f"{SCOPE}/ends", 1)  # node 2's take(), up to its kill
        # What EndTickets.missing_after comes to: the watched node's dead_after, under
        # half the bound of the beat that reads the ends.
        missing_after = min(dead_after, STORE_LOST_AFTER / 2)
        started = time.monotonic()
        # dead_after to be found, a beat to see it, missing_after per reader (node 0 reads
        # once node 1 announced, while node 1 waits), and the allowance.
        with anyio.move_on_after(dead_after + BEAT + 2 * missing_after + ALLOWANCE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_all, heard, (first, None), (watcher, None))
                while len(heard) < 2:
                    await anyio.sleep(BEAT / 2)
                tg.cancel_scope.cancel()
        took = time.monotonic() - started
    assert sorted(heard) == [0, 1], (heard, took)
    for end in heard.values():
        assert (end.node, end.host, end.reason) == (2, "h2", EndReason.VANISHED), end
        assert "seen by node 1 (h1)" in end.detail
    assert took >= dead_after + missing_after
    print(f"both nodes heard {took:.2f} s after the kill")


@pytest.mark.asyncio
async def test_a_node_whose_capture_hangs_keeps_beating_and_is_named_after_the_timeout() -> None:
    """Node 1's capture never returns. Its beats go on beside it, so its watcher (node 0,
    the asker) does not find it vanished, though the gather outlasts dead_after threefold;
    the report names node 1 as not answering after the gather's timeout."""
    dead_after = 0.3
    timeout = 3 * dead_after
    store = MemoryStore()
    heard: dict[int, AttemptEnd] = {}
    with channels(store, 2, dead_after=dead_after) as (asker, wedged):
        for channel in (asker, wedged):
            await channel.open()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_all, heard, (asker, stacks_of(0)), (wedged, hangs))
            started = time.monotonic()
            with anyio.fail_after(timeout + ALLOWANCE):
                report = await asker.gather_stacks(stacks_of(0), timeout=timeout)
            took = time.monotonic() - started
            tg.cancel_scope.cancel()
    assert heard == {}, heard
    assert [(s.rank, s.node) for s in report.stacks] == [(0, 0)]
    assert report.missing == ("node 1 (h1)",)
    assert timeout <= took < timeout + ALLOWANCE


@pytest.mark.asyncio
async def test_a_capture_that_gives_nothing_in_time_is_named_as_not_answering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Node 1's capture outlasts the bound of a capture (`STACKS_TIMEOUT`, 0.3 s here): it
    answers that it has nothing, and the report names it at once, as a node that did not
    answer, instead of leaving its ranks out unsaid."""
    capture_bound = 0.3
    monkeypatch.setattr(_stack_gathering, "STACKS_TIMEOUT", capture_bound)
    timeout = 10.0
    store = MemoryStore()
    with channels(store, 2) as (asker, wedged):
        for channel in (asker, wedged):
            await channel.open()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_all, {}, (wedged, hangs))
            started = time.monotonic()
            report = await asker.gather_stacks(stacks_of(0), timeout=timeout)
            took = time.monotonic() - started
            tg.cancel_scope.cancel()
    assert report.missing == ("node 1 (h1)",)
    assert [s.node for s in report.stacks] == [0]
    # A beat to hear, the capture's bound, a beat to see the answer: not the timeout.
    assert took < capture_bound + 2 * BEAT + ALLOWANCE


@pytest.mark.asyncio
async def test_a_store_that_fails_mid_gather_gives_the_own_stacks_and_names_it() -> None:
    store = BrokenStore()
    with channels(store, 3) as (asker, *_):
        await asker.open()
        store.broken = True
        with anyio.fail_after(ALLOWANCE):
            report = await asker.gather_stacks(stacks_of(0), timeout=5.0)
    assert [(s.rank, s.node, s.host) for s in report.stacks] == [(0, 0, "h0")]
    assert report.missing == ("node 1", "node 2")
    text = report.format().splitlines()
    assert text[:4] == [
        "stacks of 1 rank on 1 node, asked by node 0 (h0)",
        "the c10d store failed (ConnectionResetError: Connection reset by peer): the other "
        "nodes could not be asked",
        "node 1: no answer",
        "node 2: no answer",
    ]
