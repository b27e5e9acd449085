"""Binary workers are started by the watchdog with ``posix_spawn``, never by a fork of us.

What that path must keep: the worker's own process group, default signal dispositions
and an empty mask, our current working directory and stdout, exec errors reported as
such, a worker that is killed — not orphaned — when the supervisor dies at any point of
a start or the watchdog dies under a running worker, and a batch the watchdog died
before answering reported as not started.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

import aioelastic
from aioelastic._core.process import _platform
from aioelastic._core.start import _binary_start
from aioelastic._core.start._binary_start import MAX_BATCH, BinaryLauncher, BinaryStart, send_batch
from aioelastic._core.start._watchdog import watchdog
from tests.support.audit import MARK_VAR, processes_with_env
from tests.support.waits import (
    ReadyFifo,
    close_with_reporter_stopped,
    is_running,
    longest_loop_gap_while_stopped,
    process_state,
    read_line,
    wait_gone,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

#: glibc's posix_spawn leaves its two internal signals (32, 33) ignored in every child it
#: starts, whatever it is asked; a glibc program installs its own handlers for them.
_GLIBC_INTERNAL = (1 << 31) | (1 << 32)


def _status_fields(text: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@pytest.fixture
def fresh_watchdog(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A watchdog started for this test (with or without pidfds), stopped after it."""
    watchdog.stop()
    if getattr(request, "param", "pidfd") == "waitid-thread":
        monkeypatch.setenv(_platform.NO_PIDFD_ENV, "1")
    _platform.pidfd_supported.cache_clear()
    yield
    watchdog.stop()
    monkeypatch.delenv(_platform.NO_PIDFD_ENV, raising=False)
    _platform.pidfd_supported.cache_clear()


@pytest.mark.parametrize("fresh_watchdog", ["pidfd", "waitid-thread"], indirect=True)
async def test_binary_worker_is_the_watchdogs_child_in_its_own_group_with_clean_signals(
    tmp_path: Path, fresh_watchdog: None
) -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        started = time.monotonic()
        result = await aioelastic.run_processes(
            "status",
            "/bin/cat",
            {0: ("/proc/self/status",)},
            {0: {}},
            redirects=aioelastic.Std.OUT,
            log_dir=tmp_path,
        )
        elapsed = time.monotonic() - started
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        signal.signal(signal.SIGHUP, previous)
    assert not result.is_failed()
    assert elapsed < 20
    fields = _status_fields(Path(result.stdouts[0]).read_text())
    assert int(fields["PPid"]) == watchdog.pid
    assert int(fields["SigBlk"], 16) == 0
    assert int(fields["SigIgn"], 16) & ~_GLIBC_INTERNAL == 0
    assert int(fields["SigCgt"], 16) == 0
    # Its own group: cat is the group leader (field 5 of /proc/self/stat is the pgrp).
    assert fields["Pid"] not in (str(os.getpid()), str(os.getpgrp()))


async def test_binary_worker_inherits_no_fd_but_its_stdio(tmp_path: Path) -> None:
    result = await aioelastic.run_processes(
        "fds",
        "/bin/ls",
        {rank: ("/proc/self/fd",) for rank in range(3)},
        {rank: {} for rank in range(3)},
        redirects=aioelastic.Std.OUT,
        log_dir=tmp_path,
    )
    assert not result.is_failed()
    for rank in range(3):
        # 0-2 are stdio; 3 is ls's own handle on the directory it lists.
        assert Path(result.stdouts[rank]).read_text().split() == ["0", "1", "2", "3"]


async def test_many_concurrent_starts_with_large_environments_each_get_their_own(
    tmp_path: Path,
) -> None:
    # Concurrent starts share messages to the watchdog, and environments this large travel
    # in a memfd: every worker must still get exactly its own argv and environment.
    n = 40
    started = time.monotonic()
    result = await aioelastic.run_processes(
        "big",
        "/bin/sh",
        {rank: ("-c", 'printf "%s %s" "$1" "${#BIG}"', "sh", str(rank)) for rank in range(n)},
        {rank: {"BIG": "x" * (70_000 + rank)} for rank in range(n)},
        redirects=aioelastic.Std.OUT,
        log_dir=tmp_path,
    )
    assert time.monotonic() - started < 40
    assert not result.is_failed()
    outputs = {rank: Path(path).read_text() for rank, path in result.stdouts.items()}
    assert outputs == {rank: f"{rank} {70_000 + rank}" for rank in range(n)}


async def test_binary_runs_in_our_current_directory_and_writes_to_our_current_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    watchdog.ensure_started()  # the watchdog's own directory and stdout are older
    monkeypatch.chdir(tmp_path)
    result = await aioelastic.run_processes("pwd", "pwd", {0: ()}, {0: {}})
    assert not result.is_failed()
    assert capfd.readouterr().out == f"{tmp_path}\n"


async def test_exec_failure_is_reported_with_its_errno_and_nothing_is_left(tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    launcher = BinaryLauncher(os.environ)
    try:
        started = time.monotonic()
        with pytest.raises(
            PermissionError, match=r"Permission denied.*starting '.*not-executable'"
        ):
            await launcher.start(BinaryStart([str(script)], {}, 1, err_w))
        assert time.monotonic() - started < 10
        with pytest.raises(FileNotFoundError, match=r"starting '/no/such/binary'"):
            await launcher.start(BinaryStart(["/no/such/binary"], {}, 1, err_w))
    finally:
        os.close(err_r)
        os.close(err_w)


@pytest.mark.parametrize("fresh_watchdog", ["pidfd", "waitid-thread"], indirect=True)
async def test_watchdog_killed_under_a_running_binary_kills_it_and_reports_it(
    tmp_path: Path, fresh_watchdog: None
) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "sleeper",
            "/bin/sh",
            {0: ("-c", f"echo ready > {fifo.path}; exec sleep 600")},
            {0: {}},
            grace_period=1,
        ) as ctx:
            await fifo.lines(1)
            (pid,) = ctx.pids().values()
            assert is_running(pid)
            assert watchdog.pid is not None
            os.kill(watchdog.pid, signal.SIGKILL)
            with anyio.fail_after(20):
                result = await ctx.wait()
        assert result.failures[0].exitcode == -signal.SIGKILL
        assert not is_running(pid)  # killed (its new parent reaps it when it will)
        # The next start brings a new watchdog up.
        again = await aioelastic.run_processes("true", "true", {0: ()}, {0: {}})
        assert not again.is_failed()
    finally:
        fifo.close()


def _marked(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline and process_state(int(entry)) not in (None, "Z"):
            found.append(int(entry))
    return found


@pytest.mark.parametrize(
    ("kill_after", "exit_watch"),
    [(1, "pidfd"), (5, "pidfd"), (20, "pidfd"), (5, "waitid-thread"), (20, "waitid-thread")],
)
async def test_supervisor_sigkilled_while_starting_binaries_leaves_no_orphan(
    kill_after: int, exit_watch: str
) -> None:
    # The supervisor starts binaries in a loop and is SIGKILLed mid-stream, so that the
    # kill lands inside some start: every binary it created must still die.
    marker = f"aioelastic-orphan-check-{os.getpid()}-{kill_after}-{exit_watch}"
    env = dict(os.environ)
    if exit_watch == "waitid-thread":
        env[_platform.NO_PIDFD_ENV] = "1"  # the watchdog waits with threads
    proc = await anyio.open_process(
        [sys.executable, "-m", "tests.children.binary_loop", marker],
        stdout=subprocess.PIPE,
        stderr=None,
        env=env,
    )
    assert proc.stdout is not None
    seen = b""
    with anyio.fail_after(30):
        while seen.count(b"\n") < kill_after:
            seen += await proc.stdout.receive()
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    await proc.aclose()
    with anyio.fail_after(20):
        for pid in _marked(marker):
            await _exits(pid)
        # The supervisor's watchdog outlives it by the moment its kill of every group
        # takes (it acts on the parent-death signal, then exits): waited for too, or a
        # loaded machine finds it still alive when the test ends.
        for pid in processes_with_env(MARK_VAR, os.environ[MARK_VAR]):
            await _exits(pid)
    assert _marked(marker) == []


async def _exits(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


async def test_a_group_larger_than_one_start_message_gets_each_rank_its_own_argv_and_env(
    tmp_path: Path,
) -> None:
    # More workers than one message to the watchdog holds: the starts travel in several
    # batches, each worker still with its own arguments over the shared environment.
    n = MAX_BATCH + 5
    result = await aioelastic.run_processes(
        "many",
        "/bin/sh",
        {
            rank: ("-c", 'printf "%s %s %s" "$1" "$RANK_VAR" "$HOME"', "sh", str(rank))
            for rank in range(n)
        },
        {rank: {"RANK_VAR": f"v{rank}"} for rank in range(n)},
        redirects=aioelastic.Std.OUT,
        log_dir=tmp_path,
    )
    assert not result.is_failed()
    outputs = {rank: Path(path).read_text() for rank, path in result.stdouts.items()}
    home = os.environ.get("HOME", "")
    assert outputs == {rank: f"{rank} v{rank} {home}" for rank in range(n)}


async def test_binary_without_the_stack_hook_gets_no_stack_fifo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    async with aioelastic.start_processes(
        "plain", "true", {0: (), 1: ()}, {0: {}, 1: {}}, log_dir=tmp_path / "logs"
    ) as ctx:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
        result = await ctx.wait()
    assert result is not None
    assert not result.is_failed()


async def test_a_group_whose_binary_cannot_be_executed_raises_its_errno_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    # Executable, so it passes validation, but its interpreter does not exist: every
    # start of the group fails in posix_spawn itself.
    script = tmp_path / "bad-interpreter"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    with pytest.raises(FileNotFoundError, match=r"starting '.*bad-interpreter'"):
        await aioelastic.run_processes(
            "bad",
            str(script),
            {r: () for r in range(3)},
            {r: {} for r in range(3)},
            log_dir=tmp_path / "logs",
        )
    # The watchdog is still of use: the next group starts.
    result = await aioelastic.run_processes("true", "true", {0: ()}, {0: {}})
    assert not result.is_failed()


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


async def test_watchdog_dead_before_answering_a_batch_fails_every_start_of_it(
    fresh_watchdog: None,
) -> None:
    # The batch reached the watchdog's socket, but the watchdog died before it made
    # anything: every start is reported as not started, and nothing is left open.
    watchdog.ensure_started()
    assert watchdog.pid is not None
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    os.kill(watchdog.pid, signal.SIGSTOP)
    try:
        starts = [BinaryStart(["/bin/sleep", "600"], {}, devnull, devnull)] * 3
        batch = send_batch(dict(os.environ), starts, block=True)
        os.kill(watchdog.pid, signal.SIGKILL)
        started = time.monotonic()
        select.select([batch.fileno()], [], [], 20)  # readable: the end-of-file
        outcomes = batch.receive()
        batch.close()
    finally:
        os.close(devnull)
    assert time.monotonic() - started < 20
    assert batch.done
    assert len(outcomes) == 3
    for outcome in outcomes:
        assert isinstance(outcome, RuntimeError)
        assert "the watchdog died while starting '/bin/sleep'" in str(outcome)


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


@pytest.mark.timeout(90)
async def test_a_stopped_watchdog_that_never_reports_an_exit_does_not_hold_up_teardown(
    tmp_path: Path, fresh_watchdog: None
) -> None:
    # The watchdog started the worker and answered, then is stopped: the worker is
    # killed at close, but the exit report never comes. Teardown gives up on it after
    # its bound, says so, and leaves no fd (the batch's socket is closed once the last
    # worker it waits for is reaped); continued, the watchdog serves on.
    fifo = ReadyFifo(tmp_path)
    watchdog_pid = None
    try:
        ctx = aioelastic.start_processes(
            "unreported",
            "/bin/sh",
            {0: ("-c", f"echo ready > {fifo.path}; exec sleep 600")},
            {0: {}},
            grace_period=0.5,
        )
        async with ctx:
            await fifo.lines(1)
            watchdog_pid = watchdog.pid
            assert watchdog_pid is not None
            await close_with_reporter_stopped(ctx, watchdog_pid, grace=0.5)
    finally:
        fifo.close()
        if watchdog_pid is not None:
            os.kill(watchdog_pid, signal.SIGCONT)
    again = await aioelastic.run_processes("after", "/bin/true", {0: ()}, {0: {}})
    assert not again.is_failed()
    assert watchdog.pid == watchdog_pid


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


def _started_watchdog_pid() -> int:
    watchdog.ensure_started()
    watchdog_pid = watchdog.pid
    assert watchdog_pid is not None
    return watchdog_pid


def _no_such_groups(count: int) -> list[int]:
    """Process group ids above ``pid_max``: no process can ever have them."""
    above = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    return [above + k for k in range(count)]


def _queue_at_stopped_watchdog(watchdog_pid: int, first: int, then: list[int]) -> None:
    """Stop the watchdog; watch ``first`` (into its socket), then forget each of ``then``
    (the socket fills; the rest waits in the supervisor's queue)."""
    os.kill(watchdog_pid, signal.SIGSTOP)
    watchdog.watch(first)
    for pgid in then:
        watchdog.forget(pgid)
    assert len(watchdog._messages) > 0, "every message fit in the socket: nothing was tested"


async def test_watch_messages_queued_at_a_stopped_watchdog_never_block_and_arrive_in_order(
    fresh_watchdog: None,
) -> None:
    # Watching and forgetting a group are one small message each; a datagram socket
    # takes a bounded number however small. At a stopped watchdog the ones beyond wait
    # in the supervisor, sent in order once it reads again: a group watched and
    # forgotten many times is forgotten in the end, so the watchdog's exit spares it.
    watchdog_pid = _started_watchdog_pid()
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        os.kill(watchdog_pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for _ in range(2000):
                watchdog.watch(bystander.pid)
                watchdog.forget(bystander.pid)
            queued = len(watchdog._messages)
            took = time.monotonic() - started
        finally:
            os.kill(watchdog_pid, signal.SIGCONT)
        assert queued > 0, "every message fit in the socket: nothing was tested"
        assert took < 5, f"4000 messages took {took:.1f} s to hand over"
        assert await anyio.to_thread.run_sync(watchdog._messages.flush, 30)
        result = await aioelastic.run_processes("after", "/bin/sh", {0: ("-c", "exit 3")}, {0: {}})
        assert result.failures[0].exitcode == 3
        watchdog.stop()  # it kills every group it still watches
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


async def test_stopping_the_watchdog_sends_what_was_queued_first(fresh_watchdog: None) -> None:
    # A forget still queued when the supervisor stops its watchdog must reach it before
    # the end-of-file: dropped, the watchdog would kill a group the job had let go of.
    watchdog_pid = _started_watchdog_pid()
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        fillers = _no_such_groups(2000)
        _queue_at_stopped_watchdog(watchdog_pid, bystander.pid, [*fillers, bystander.pid])
        os.kill(watchdog_pid, signal.SIGCONT)
        started = time.monotonic()
        watchdog.stop()  # at once: most of the queue is still in the supervisor
        assert time.monotonic() - started < 10
        assert bystander.poll() is None
        assert len(watchdog._messages) == 0
    finally:
        bystander.kill()
        bystander.wait()


async def test_messages_queued_at_a_watchdog_killed_meanwhile_are_dropped_at_once(
    fresh_watchdog: None,
) -> None:
    # The watchdog dies (SIGKILL) with messages still queued for it: the launcher thread
    # sending them gets an error instead of waiting for ever, drops the rest, and the
    # next start brings up a new watchdog.
    watchdog_pid = _started_watchdog_pid()
    first, *then = _no_such_groups(2001)
    _queue_at_stopped_watchdog(watchdog_pid, first, then)
    os.kill(watchdog_pid, signal.SIGKILL)
    started = time.monotonic()
    assert await anyio.to_thread.run_sync(watchdog._messages.flush, 10)
    assert time.monotonic() - started < 10
    assert len(watchdog._messages) == 0
    result = await aioelastic.run_processes("after", "/bin/sh", {0: ("-c", "exit 3")}, {0: {}})
    assert result.failures[0].exitcode == 3
    assert watchdog.pid != watchdog_pid
    assert process_state(watchdog_pid) is None  # the dead one was reaped


#: Run by the next test in a supervisor of its own: at its interpreter's exit, once no
#: thread may start, it floods its stopped watchdog with watch and forget messages.
_FLOOD_AT_EXIT = """
import atexit, os, signal, sys
from aioelastic._core.start._launchers import launcher_pool
from aioelastic._core.start._watchdog import watchdog

bystander, first_unused = int(sys.argv[1]), int(sys.argv[2])
watchdog.ensure_started()

def flood():  # registered after the watchdog's own stop(): runs before it
    try:
        launcher_pool().submit(int)
    except RuntimeError:
        print("refused", watchdog.pid, flush=True)
    else:
        print("accepted", flush=True)
        return
    os.kill(watchdog.pid, signal.SIGSTOP)
    watchdog.watch(bystander)
    for k in range(2000):
        watchdog.forget(first_unused + k)
    watchdog.forget(bystander)
    print("sent", len(watchdog._messages), flush=True)

atexit.register(flood)
"""

#: sendmsg's number in /proc/PID/syscall.
_SENDMSG = {"x86_64": 46, "aarch64": 211}.get(os.uname().machine)


@pytest.mark.skipif(_SENDMSG is None, reason="sendmsg's syscall number is known for x86_64/arm64")
async def test_messages_sent_at_interpreter_exit_are_drained_on_the_calling_thread() -> None:
    # At interpreter exit no launcher thread can start, so a message that finds the
    # watchdog's socket full is drained by the thread that sent it: it waits for the
    # watchdog (here stopped, then continued) instead of being lost, and the forget
    # sent last still reaches the watchdog before its end-of-file.
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        proc = await anyio.open_process(
            [sys.executable, "-c", _FLOOD_AT_EXIT, str(bystander.pid), str(_no_such_groups(1)[0])],
            stdout=subprocess.PIPE,
            stderr=None,
        )
        async with proc:
            assert proc.stdout is not None
            word, watchdog_pid = (await read_line(proc.stdout)).split()
            assert word == "refused"
            # Event: the exiting thread sleeps in sendmsg on the stopped watchdog's socket.
            with anyio.fail_after(30):
                while Path(f"/proc/{proc.pid}/syscall").read_text().split()[0] != str(_SENDMSG):
                    await anyio.sleep(0.01)
            os.kill(int(watchdog_pid), signal.SIGCONT)
            assert await read_line(proc.stdout) == "sent 0"
            with anyio.fail_after(30):
                assert await proc.wait() == 0
        await wait_gone(int(watchdog_pid), timeout=10)
        assert bystander.poll() is None  # its forget arrived before the end-of-file
    finally:
        bystander.kill()
        bystander.wait()
