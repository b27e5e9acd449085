"""Binary starts on their way to the watchdog: batched, and never a wait in the event loop.

A start the event loop cannot send at once goes from a launcher thread; ``send_batch``
refuses without waiting; a group's last starts go without waiting for the batch in flight;
a running worker holds three descriptors of the supervisor; starts queued at a stopped
watchdog never block the loop. The watch and forget messages: test_watchdog_messages.py.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

import aioelastic
from aioelastic._core.start import _binary_start
from aioelastic._core.start._binary_start import BinaryLauncher, BinaryStart, send_batch
from aioelastic._core.start._watchdog import watchdog
from tests.support.waits import ReadyFifo, longest_loop_gap_while_stopped

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


class _CountingLock:
    """A real lock that counts the blocking acquisitions other threads attempt on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.blocking_waits = 0
        self.refused = 0
        self.waiting = threading.Event()

    def acquire(self, blocking: bool = True) -> bool:
        if blocking:
            self.blocking_waits += 1
            self.waiting.set()
        got = self._lock.acquire(blocking)
        if not got:
            self.refused += 1
        return got

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


async def test_a_start_the_event_loop_cannot_send_at_once_goes_from_a_thread(
    fresh_watchdog: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The event loop never waits for the watchdog's lock (another thread may hold it for
    # tens of ms while it starts the watchdog): the batch is sent from a launcher thread,
    # and the worker starts once the lock is free.
    watchdog.ensure_started()
    lock = _CountingLock()
    monkeypatch.setattr(watchdog, "_lock", lock)
    lock.acquire()  # held by "another thread" (this one) until a sender waits for it
    lock.blocking_waits = 0
    lock.waiting.clear()
    holder_done = threading.Event()

    def release_when_a_sender_waits() -> None:
        lock.waiting.wait(30)
        lock.release()
        holder_done.set()

    threading.Thread(target=release_when_a_sender_waits, daemon=True).start()
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        with anyio.fail_after(30):
            launched = await BinaryLauncher(os.environ).start(
                BinaryStart(["/bin/sh", "-c", "exit 7"], {}, devnull, devnull)
            )
            assert await launched.watch.wait() == 7
            await anyio.to_thread.run_sync(holder_done.wait, 30)
    finally:
        os.close(devnull)
    launched.watch.reap()
    watchdog.forget(launched.pid)
    assert lock.refused == 1  # the event loop did not wait for it
    assert lock.blocking_waits == 1  # a launcher thread did


async def test_send_batch_refuses_without_waiting_and_leaves_no_fd(fresh_watchdog: None) -> None:
    fds_before = sorted(os.listdir("/proc/self/fd"))
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        start = BinaryStart(["/bin/true"], {}, err_w, err_w)
        with pytest.raises(BlockingIOError, match="not running"):
            send_batch(dict(os.environ), [start], block=False)
        watchdog.ensure_started()
        with watchdog._lock, pytest.raises(BlockingIOError, match="being started"):
            send_batch(dict(os.environ), [start], block=False)
    finally:
        os.close(err_r)
        os.close(err_w)
    watchdog.stop()
    assert sorted(os.listdir("/proc/self/fd")) == fds_before


async def test_the_last_starts_of_a_group_go_without_waiting_for_the_batch_in_flight(
    fresh_watchdog: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first start goes at once; the next ones wait for its answers so that they
    # travel together, except the group's last ones, which nothing else will join. A
    # stopped watchdog answers nothing: the rest of the group must be sent regardless.
    watchdog.ensure_started()
    assert watchdog.pid is not None
    sent: list[int] = []
    all_sent = anyio.Event()
    real_send_batch = _binary_start.send_batch

    def counting(base_env: dict[str, str], batch: list[BinaryStart], *, block: bool) -> object:
        sent.append(len(batch))
        if sum(sent) == 3:
            all_sent.set()
        return real_send_batch(base_env, batch, block=block)

    monkeypatch.setattr(_binary_start, "send_batch", counting)
    os.kill(watchdog.pid, signal.SIGSTOP)
    try:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                result = await aioelastic.run_processes(
                    "three", "/bin/true", {r: () for r in range(3)}, {r: {} for r in range(3)}
                )
                assert not result.is_failed()

            tg.start_soon(run)
            with anyio.move_on_after(5):
                await all_sent.wait()
            sent_while_stopped = list(sent)
            os.kill(watchdog.pid, signal.SIGCONT)
    finally:
        os.kill(watchdog.pid, signal.SIGCONT)
    assert sent_while_stopped == [1, 2]
    assert sent == [1, 2]


async def test_a_running_binary_worker_holds_three_fds_of_the_supervisor(
    tmp_path: Path, fresh_watchdog: None
) -> None:
    # Its stdout and stderr pipes and a pidfd. Its exit comes on the start batch's
    # socket, one per batch, not on a pipe of its own: fewer fds per worker is more
    # workers under the same RLIMIT_NOFILE.
    watchdog.ensure_started()
    n = 16
    fifo = ReadyFifo(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    try:
        async with aioelastic.start_processes(
            "sleepers",
            "/bin/sh",
            {r: ("-c", f"echo ready > {fifo.path}; exec sleep 600") for r in range(n)},
            {r: {} for r in range(n)},
            grace_period=5,
        ) as ctx:
            await fifo.lines(n)
            during = len(os.listdir("/proc/self/fd"))
            await ctx.close()
    finally:
        fifo.close()
    # The batches' sockets on top: one per batch, and how many batches the watchdog got
    # depends on how the starts fell into the event loop's turns (a few). A fourth fd per
    # worker would be 4 * n.
    assert during - before < 3 * n + n // 2, during - before


@pytest.mark.timeout(120)
async def test_starts_queued_at_a_stopped_watchdog_never_block_the_event_loop(
    fresh_watchdog: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python's socket.send_fds drops its flags (CPython gh-107898): a "non-blocking"
    # start message to a watchdog with a full socket waited in the event loop for the
    # watchdog to read. Stopped, it never reads: the loop froze, and here could not
    # even continue it. Now what the socket cannot take goes from launcher threads.
    groups = 120  # one start message each: more than the socket's buffer holds
    watchdog.ensure_started()
    assert watchdog.pid is not None
    from_threads: list[int] = []
    real_send_batch = _binary_start.send_batch

    def counting(base_env: dict[str, str], batch: list[BinaryStart], *, block: bool) -> object:
        if block:
            from_threads.append(len(batch))
        return real_send_batch(base_env, batch, block=block)

    monkeypatch.setattr(_binary_start, "send_batch", counting)
    results: list[aioelastic.RunProcsResult] = []

    async def one(k: int) -> None:
        results.append(await aioelastic.run_processes(f"g{k}", "/bin/true", {0: ()}, {0: {}}))

    with anyio.fail_after(90):
        worst = await longest_loop_gap_while_stopped(
            watchdog.pid, [functools.partial(one, k) for k in range(groups)]
        )
    assert from_threads, "every start message fit in the socket: nothing was tested"
    assert worst < 0.5, f"the event loop stood still for {worst * 1000:.0f} ms"
    assert len(results) == groups
    assert not any(result.is_failed() for result in results)
