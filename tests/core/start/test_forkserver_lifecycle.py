"""The warm fork server when things go wrong: killed, unable to fork, slow to start,
started from a supervisor with odd signal state. Real processes and real faults.

A dead server is replaced and the start retried (once); a failed fork or a full
descriptor table is a clear error and the server lives on; a start cancelled while the
server imports returns at once; stopping does not wait for the preload's finalisers;
requests queued at a stopped server never block the event loop. Its spares:
test_forkserver_spares.py; what it imports: test_forkserver_preload.py; its memory:
test_forkserver_huge_pages.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic._core.start._forkserver import ForkServerError, fork_server
from tests.support.fork_server import add_on_server, stop_fork_server as _stop
from tests.support.paths import REPO
from tests.support.waits import (
    ReadyFifo,
    is_running,
    longest_loop_gap_while_stopped,
    process_state,
    wait_gone,
)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_killed_server_is_replaced_on_the_next_start() -> None:
    preload = ("tests.children.core",)
    try:
        first = await add_on_server("warm", preload, (1, 2))
        assert first.return_values == {0: 3}
        dead = fork_server(preload).pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        await wait_gone(dead)
        start = time.monotonic()
        second = await add_on_server("again", preload, (2, 2), (3, 3))
        assert time.monotonic() - start < 30
        assert second.return_values == {0: 4, 1: 6}
        fresh = fork_server(preload).pid
        assert fresh is not None
        assert fresh != dead
        assert is_running(fresh)
        assert process_state(dead) is None  # reaped, not left a zombie
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_server_that_dies_on_a_request_is_replaced_and_the_start_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first server exits (end-of-file on its socket) when asked to fork; the retry
    # on a fresh server succeeds.
    preload = ("tests.children.forkserver_dies",)
    monkeypatch.setenv("AIOELASTIC_TEST_DIE_ONCE", str(tmp_path / "died"))
    try:
        result = await add_on_server("retry", preload, (1, 1))
        assert result.return_values == {0: 2}
        assert (tmp_path / "died").exists()
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_server_that_dies_again_after_replacement_gives_a_clear_error() -> None:
    preload = ("tests.children.forkserver_dies",)
    start = time.monotonic()
    try:
        with pytest.raises(ForkServerError) as caught:
            await add_on_server("dies", preload, (1, 1))
        assert time.monotonic() - start < 30
        assert str(caught.value).startswith("the fork server (pid ")
        assert (
            "for forkserver_preload=['tests.children.forkserver_dies'] died while starting a "
            "worker (end-of-file on its socket), right after replacing one that had died"
        ) in str(caught.value)
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_fork_failure_in_the_server_is_a_clear_start_error() -> None:
    # RLIMIT_NPROC is the real limit behind `ulimit -u`. Root is exempt from it, so the
    # preload drops the server to the nobody user after setting the limit to 0; from then
    # on each fork inside the server fails with EAGAIN, exactly as for a user at the limit.
    preload = ("tests.children.forkserver_nproc",)
    try:
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(ForkServerError) as caught:
                await add_on_server("nproc", preload, (1, 1))
            assert time.monotonic() - start < 30
            assert str(caught.value) == (
                "the fork server could not fork a worker: [Errno 11] Resource temporarily "
                "unavailable; the limit on processes was reached: the per-user limit "
                "(`ulimit -u`, RLIMIT_NPROC, 0 here) or the cgroup's pids.max; raise it or "
                "start fewer workers"
            )
            server = fork_server(preload).pid
            assert server is not None
            assert is_running(server)  # the server survived its failed fork
            if _ == 0:
                first = server
        assert server == first  # and was not replaced
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_cancelling_a_start_while_the_server_imports_returns_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preload = ("tests.children.forkserver_slow",)
    fifo = ReadyFifo(tmp_path)
    monkeypatch.setenv("AIOELASTIC_TEST_READY", str(fifo.path))
    try:
        cancelled_at = returned_at = 0.0
        async with anyio.create_task_group() as tg:

            async def start() -> None:
                nonlocal returned_at
                try:
                    await add_on_server("slow", preload, (1, 1), (2, 2))
                finally:
                    returned_at = time.monotonic()

            tg.start_soon(start)
            (line,) = await fifo.lines(1)
            server = int(line.removeprefix("importing pid="))
            assert is_running(server)
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()
        # Within a few ms (100 ms promised; generous for a loaded machine): the import
        # would block for ever.
        assert returned_at - cancelled_at < 1.0, returned_at - cancelled_at
        print(f"cancel returned after {(returned_at - cancelled_at) * 1000:.1f} ms")
        assert process_state(server) is None  # killed and reaped
        assert fork_server(preload).pid is None
    finally:
        fifo.close()
        _stop(preload)


@pytest.mark.timeout(90)
def test_inherited_signal_state_does_not_reach_the_server_or_its_workers() -> None:
    # SIGCHLD ignored would make the kernel reap the server's workers behind its back.
    def inherit() -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.children.forkserver", "inherited-signals"],
        cwd=str(REPO),
        preexec_fn=inherit,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert time.monotonic() - start < 60
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # The supervisor restores SIGCHLD's default before its first start (docs/reliability.md);
    # the server resets its own signal state regardless of what it inherits.
    assert report["supervisor_sigchld"] == "default"
    assert report["worker"] == {
        "SIGCHLD": "default",
        "SIGHUP": "default",
        "SIGTERM": "default",
        "SIGUSR1": "default",
        "SIGINT": "python",
        "blocked": [],
    }
    assert report["failures"] == {"1": 3}  # exact statuses: 0, 3, 0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_server_at_its_open_file_limit_gives_a_clear_start_error() -> None:
    preload = ("tests.children.forkserver_nofile",)
    try:
        for attempt in range(2):
            start = time.monotonic()
            with pytest.raises(ForkServerError) as caught:
                await add_on_server("nofile", preload, (1, 1))
            assert time.monotonic() - start < 30
            # How many fit depends on the fds the interpreter holds; never all four (the
            # small call travels in the request, not in a fifth pipe).
            assert re.fullmatch(
                r"the fork server received [0-3] of the 4 pipes of a worker: its open-file "
                r"limit \(`ulimit -n`, RLIMIT_NOFILE\) may be reached",
                str(caught.value),
            )
            server = fork_server(preload).pid
            assert server is not None
            assert is_running(server)
            if attempt == 0:
                first = server
        assert server == first
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_stopping_a_server_does_not_wait_for_its_preload_to_finalise() -> None:
    preload = ("tests.children.forkserver_slow_exit",)
    result = await add_on_server("slow-exit", preload, (1, 1))
    assert result.return_values == {0: 2}
    server = fork_server(preload).pid
    assert server is not None
    started = time.monotonic()
    # Past the timeout stop() kills the server: returning well before it means the
    # server exited by itself, without running its preload's exit handler.
    fork_server(preload).stop(timeout=30)
    assert time.monotonic() - started < 10
    assert process_state(server) is None


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_requests_queued_at_a_stopped_server_never_block_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python's socket.send_fds drops its flags (CPython gh-107898): a "non-blocking"
    # start request to a server with a full socket waited in the event loop until the
    # server read. Stopped, it never reads: the loop froze, and could not continue it.
    # Now what the socket cannot take goes from launcher threads.
    from aioelastic._core.start._forkserver import ForkServer

    preload = ("tests.children.core",)
    groups, size = 16, 8  # one request per worker: more than the socket's buffer holds
    from_threads: list[bool] = []
    real_send = ForkServer._send_request

    def counting(self: ForkServer, *args: Any, block: bool) -> Any:
        if block:
            from_threads.append(block)
        return real_send(self, *args, block=block)

    monkeypatch.setattr(ForkServer, "_send_request", counting)
    results: list[aioelastic.RunProcsResult] = []
    try:
        assert (await add_on_server("warm", preload, (1, 2))).return_values == {0: 3}
        server = fork_server(preload)
        assert server.pid is not None

        async def one(k: int) -> None:
            pairs = [(k, r) for r in range(size)]
            results.append(await add_on_server(f"g{k}", preload, *pairs))

        with anyio.fail_after(90):
            worst = await longest_loop_gap_while_stopped(
                server.pid, [functools.partial(one, k) for k in range(groups)]
            )
    finally:
        _stop(preload)
    assert from_threads, "every request fit in the socket: nothing was tested"
    assert worst < 0.5, f"the event loop stood still for {worst * 1000:.0f} ms"
    assert sorted(sum(r.return_values.values()) for r in results) == [
        8 * k + 28 for k in range(groups)
    ]
