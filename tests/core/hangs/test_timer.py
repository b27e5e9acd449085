"""The file timer server against real clients: torch's FileTimerClient and ours."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

import aioelastic
import aioelastic.timer
from aioelastic._core.child._stack_hook import script_argv
from aioelastic._core.hangs._timer_server import Expiry, TimerServer
from tests.children import hangs
from tests.support.paths import CHILDREN, REPO
from tests.support.waits import ReadyFifo, make_fifo, started_in_own_session

pytestmark = pytest.mark.timeout(90)

HANGS = str(CHILDREN / "hangs.py")


@asynccontextmanager
async def serving(
    path: Path, owners: dict[int, int]
) -> AsyncIterator[tuple[TimerServer, list[Expiry], anyio.Event]]:
    """A server whose owner map is ``owners`` ({pid: rank}), collecting expiries."""
    server = TimerServer(path, owners.get)
    server.open()
    expiries: list[Expiry] = []
    got = anyio.Event()

    async def on_expired(expiry: Expiry) -> None:
        expiries.append(expiry)
        got.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, on_expired)
            yield server, expiries, got
            tg.cancel_scope.cancel()
    finally:
        server.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("client", ["torch", "ours"])
async def test_stuck_worker_expires_within_its_timer_plus_2s(tmp_path: Path, client: str) -> None:
    ready = ReadyFifo(tmp_path)
    fifo = tmp_path / "timer.fifo"
    owners: dict[int, int] = {}
    try:
        async with serving(fifo, owners) as (server, expiries, got):
            argv = [sys.executable, HANGS, str(ready.path), "event", client, "1.0"]
            async with started_in_own_session(argv, {"TORCHELASTIC_TIMER_FILE": str(fifo)}) as proc:
                owners[proc.pid] = 3
                # The timer is armed before "ready" (the client writes first), but the
                # owner map must know the pid before the server reads the request.
                (line,) = await ready.lines(1)
                armed = time.monotonic()
                assert line == f"ready {proc.pid}"
                with anyio.fail_after(1.0 + 2.0):
                    await got.wait()
                assert time.monotonic() - armed < 3.0
            assert expiries == [
                Expiry(3, proc.pid, "training_step", expiries[0].after, signal.SIGKILL)
            ]
            assert 0.5 < expiries[0].after <= 1.0
            assert expiries[0].reason().startswith("timer expired after ")
            assert expiries[0].reason().endswith("s (scope 'training_step')")
            assert server.armed() == {}
    finally:
        ready.close()
    assert not fifo.exists()


@pytest.mark.asyncio
@pytest.mark.parametrize("client", ["torch", "ours"])
async def test_released_timer_never_fires_for_a_busy_worker(tmp_path: Path, client: str) -> None:
    # A worker that computes for 0.3 s inside a 1 s timer, releases it and stays quiet
    # for 1.5 s more: no expiry, and no timer left armed.
    ready = ReadyFifo(tmp_path)
    fifo = tmp_path / "timer.fifo"
    owners: dict[int, int] = {}
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.children.hangs import armed_but_finishes;"
        "armed_but_finishes(sys.argv[2], sys.argv[3], 1.0, 0.3)"
    )
    root = str(REPO)
    try:
        async with serving(fifo, owners) as (server, expiries, _got):
            argv = [sys.executable, "-c", code, root, str(ready.path), client]
            async with started_in_own_session(argv, {"TORCHELASTIC_TIMER_FILE": str(fifo)}) as proc:
                owners[proc.pid] = 0
                await ready.lines(1, timeout=60)
                with anyio.fail_after(30):
                    assert await proc.wait() == 0
            assert expiries == []
            assert server.armed() == {}
            assert server.last_request is not None
    finally:
        ready.close()


@pytest.mark.asyncio
async def test_hostile_and_malformed_requests_are_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "timer.fifo"
    worker_pid = 4242
    caplog.set_level(logging.WARNING, logger="aioelastic")
    async with serving(fifo, {worker_pid: 1}) as (server, expiries, got):
        past = time.time() - 10
        valid = {"pid": worker_pid, "scope_id": "s", "expiration_time": past, "signal": 9}
        garbage = [
            b"\xff\xfe not utf-8 at all",
            b"{not json",
            b"[1, 2, 3]",
            json.dumps({**valid, "pid": True}).encode(),
            json.dumps({**valid, "pid": -5}).encode(),
            json.dumps({**valid, "scope_id": 7}).encode(),
            b'{"pid": 4242, "scope_id": "s", "expiration_time": NaN, "signal": 9}',
            json.dumps({**valid, "signal": 1000}).encode(),
            # The test process itself: not a worker, must never be targeted.
            json.dumps({**valid, "pid": os.getpid()}).encode(),
        ]

        def write_all() -> None:
            # In a thread: 70 kB is more than the pipe holds until the server reads it.
            fd = os.open(fifo, os.O_WRONLY)
            try:
                for line in garbage:
                    os.write(fd, line + b"\n")
                os.write(fd, b"x" * 70_000)  # no newline: dropped as a whole
                os.write(fd, b"\n" + json.dumps(valid).encode() + b"\n")
            finally:
                os.close(fd)

        await anyio.to_thread.run_sync(write_all)
        with anyio.fail_after(10):
            await got.wait()
        assert [(e.rank, e.pid, e.scope, e.signal) for e in expiries] == [(1, worker_pid, "s", 9)]
        assert server.armed() == {}
    messages = [r.getMessage() for r in caplog.records]
    prefix = f"aioelastic: timer FIFO {fifo}: "
    assert f"{prefix}ignored a malformed request {garbage[1]!r}: not JSON " in "".join(messages)
    assert any(m.startswith(f"{prefix}ignored a malformed request b'[1, 2, 3]'") for m in messages)
    assert any(m.endswith("'pid' must be a positive integer, got True") for m in messages)
    assert any(m.endswith("'scope_id' must be a string, got 7") for m in messages)
    assert any(m.endswith("'expiration_time' must be a finite number, got nan") for m in messages)
    assert any(m.endswith("'signal' must be a signal number, got 1000") for m in messages)
    assert (
        f"{prefix}ignored a request from pid {os.getpid()}, which is not a worker of this group"
        in messages
    )
    assert f"{prefix}dropped a line of more than 16384 bytes (not a timer request)" in messages
    assert not any("xxxx" in m for m in messages)
    assert any(
        m.endswith(
            "not JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"
        )
        for m in messages
    )


@pytest.mark.asyncio
async def test_release_forget_and_signalless_timers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "timer.fifo"
    caplog.set_level(logging.WARNING, logger="aioelastic")
    soon = time.time() + 0.5
    async with serving(fifo, {10: 0, 11: 1, 12: 2}) as (server, expiries, got):
        fd = os.open(fifo, os.O_WRONLY)
        try:
            for request in [
                {"pid": 10, "scope_id": "a", "expiration_time": soon, "signal": 9},
                {"pid": 10, "scope_id": "a", "expiration_time": -1, "signal": 0},  # release
                {"pid": 11, "scope_id": "b", "expiration_time": soon, "signal": 9},
                {"pid": 12, "scope_id": "quiet", "expiration_time": soon, "signal": 0},
                {"pid": 12, "scope_id": "loud", "expiration_time": soon + 0.2, "signal": 15},
            ]:
                os.write(fd, json.dumps(request).encode() + b"\n")
        finally:
            os.close(fd)
        with anyio.fail_after(10):
            while set(server.armed()) != {(11, "b"), (12, "quiet"), (12, "loud")}:
                await server.changed()
        server.forget(11)  # rank 1 exited: its timer goes with it
        with anyio.fail_after(10):
            await got.wait()
        assert [(e.rank, e.scope, e.signal) for e in expiries] == [(2, "loud", 15)]
    assert (
        "aioelastic: timer of pid 12 (scope 'quiet') expired; it asked for no signal, so the "
        "worker is left running"
    ) in [r.getMessage() for r in caplog.records]


def test_a_regular_file_at_the_timer_path_is_refused_not_deleted(tmp_path: Path) -> None:
    path = tmp_path / "precious.txt"
    path.write_text("keep me")
    server = TimerServer(path, {}.get)
    with pytest.raises(ValueError, match="exists and is not a FIFO") as info:
        server.open()
    assert str(info.value) == (
        f"TORCHELASTIC_TIMER_FILE={str(path)!r} exists and is not a FIFO; point it at a new "
        "path (aioelastic creates the FIFO) or remove that file"
    )
    assert path.read_text() == "keep me"


def test_our_client_misuse_and_no_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    monkeypatch.setattr(aioelastic.timer, "_client", None)
    with (
        pytest.raises(RuntimeError, match=r"call aioelastic.timer.configure\(\) before"),
        aioelastic.timer.expires(after=1),
    ):
        pass
    with pytest.raises(RuntimeError, match="TORCHELASTIC_TIMER_FILE is not set"):
        aioelastic.timer.configure()
    fifo = make_fifo(tmp_path, "nobody.fifo")
    aioelastic.timer.configure(str(fifo))
    with (
        pytest.raises(ValueError, match="after must be a positive number of seconds, got 0"),
        aioelastic.timer.expires(after=0),
    ):
        pass
    begin = time.monotonic()
    with (
        pytest.raises(BrokenPipeError, match="no timer server reads"),
        aioelastic.timer.expires(after=1),
    ):
        pass
    assert time.monotonic() - begin < 1


@pytest.mark.asyncio
async def test_default_scope_is_the_callers_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "timer.fifo"
    monkeypatch.setattr(aioelastic.timer, "_client", None)
    async with serving(fifo, {os.getpid(): 0}) as (server, _expiries, _got):
        aioelastic.timer.configure(str(fifo), signal=0)
        with aioelastic.timer.expires(after=60):
            line = sys._getframe().f_lineno - 1
            with anyio.fail_after(10):
                while not server.armed():
                    await server.changed()
            assert list(server.armed()) == [(os.getpid(), f"{__file__}#{line}")]
        with anyio.fail_after(10):
            while server.armed():
                await server.changed()


# -- through the group: TORCHELASTIC_ENABLE_FILE_TIMER=1 ------------------------------


@pytest.fixture
def file_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)


@pytest.mark.asyncio
@pytest.mark.usefixtures("file_timer")
@pytest.mark.parametrize(
    ("client", "method"),
    [pytest.param("torch", "spawn", marks=pytest.mark.torch), ("ours", "forkserver")],
)
async def test_expired_function_worker_fails_with_reason_and_stack(
    tmp_path: Path, client: str, method: str
) -> None:
    ready = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "timed",
            hangs.stuck,
            # Rank 0 is stuck without a timer: it is stopped, not failed.
            {0: (str(ready.path), "sleep"), 1: (str(ready.path), "event", client, 1.0)},
            {0: {}, 1: {}},
            log_dir=tmp_path / "logs",
            redirects=aioelastic.Std.ALL,
            start_method=method,
            grace_period=5,
        ) as ctx:
            await ready.lines(2, timeout=60)
            armed = time.monotonic()
            with anyio.fail_after(1.0 + 2.0 + 5.0):
                result = await ctx.wait()
            caught = time.monotonic() - armed
    finally:
        ready.close()
    assert result is not None
    assert list(result.failures) == [1]
    failure = result.failures[1]
    assert failure.exitcode == -signal.SIGKILL
    assert failure.message.startswith("timer expired after ")
    assert "s (scope 'training_step')\n" in failure.message
    assert "in stuck_in_event_wait" in failure.message
    assert caught < 1.0 + 2.0
    log = (tmp_path / "logs" / "1" / "stderr.log").read_text()
    assert "[aioelastic] timer expired after " in log
    assert "in stuck_in_event_wait" in log
    assert not list(Path(tempfile.gettempdir()).glob("aioelastic_timer_*"))


@pytest.mark.asyncio
@pytest.mark.usefixtures("file_timer")
@pytest.mark.parametrize("client", ["torch", "ours"])
async def test_unchanged_script_arming_a_timer_is_caught(tmp_path: Path, client: str) -> None:
    ready = ReadyFifo(tmp_path)
    argv = script_argv(sys.executable, HANGS, [str(ready.path), "read", client, "1.0"])
    try:
        async with aioelastic.start_processes(
            "script", argv[0], {0: tuple(argv[1:])}, {0: {}}, grace_period=5
        ) as ctx:
            await ready.lines(1, timeout=60)
            armed = time.monotonic()
            with anyio.fail_after(10):
                result = await ctx.wait()
            assert time.monotonic() - armed < 1.0 + 2.0
    finally:
        ready.close()
    assert result is not None
    message = result.failures[0].message
    assert message.startswith("timer expired after ")
    assert "in stuck_in_blocking_read" in message
    assert "<module>" in message


@pytest.mark.asyncio
@pytest.mark.torch
@pytest.mark.usefixtures("file_timer")
async def test_quiet_but_armed_and_busy_workers_are_left_alone(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    try:
        result = await aioelastic.run_processes(
            "fine",
            hangs.quiet_but_armed,
            {0: (str(ready.path), "ours", 5.0, 1.5), 1: (str(ready.path), "torch", 5.0, 0.5)},
            {0: {}, 1: {}},
            grace_period=5,
        )
    finally:
        ready.close()
    assert not result.is_failed()
    assert result.return_values == {0: "done", 1: "done"}


@pytest.mark.asyncio
async def test_timer_without_the_switch_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As with torchrun: without TORCHELASTIC_ENABLE_FILE_TIMER=1 there is no server and no
    # TORCHELASTIC_TIMER_FILE, so a worker arming a timer fails by itself.
    monkeypatch.delenv("TORCHELASTIC_ENABLE_FILE_TIMER", raising=False)
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    result = await aioelastic.run_processes(
        "off", hangs.armed_but_finishes, {0: ("/nonexistent", "ours", 1.0, 0.0)}, {0: {}}
    )
    assert "RuntimeError: TORCHELASTIC_TIMER_FILE is not set" in result.failures[0].message


# -- under aioelastic-run -------------------------------------------------------------

BARRIER = str(CHILDREN / "barrier.py")


@pytest.mark.parametrize("client", ["torch", "ours"])
def test_cli_catches_an_unchanged_script_and_survives(tmp_path: Path, client: str) -> None:
    env = {**os.environ, "TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TIMER": client}
    env.pop("TORCHELASTIC_TIMER_FILE", None)
    begin = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "aioelastic.run", "--nproc-per-node", "2", BARRIER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The launcher exits by itself with the root cause's status (128 + SIGKILL): torch's
    # server would have SIGKILLed it (returncode -9).
    assert out.returncode == 128 + signal.SIGKILL, out.stderr
    assert time.monotonic() - begin < 60
    report = out.stderr[out.stderr.index("=" * 60) :]
    assert "barrier.py FAILED" in report
    assert "rank      : 1 (local_rank: 1)" in report
    assert "traceback : timer expired after 2s (scope 'barrier')" in report
    assert 'barrier.py", line 16 in wait_for_peers_in_barrier' in report, report
    assert "_stack_hook" not in report  # the wrapper's frames are not the user's
    assert not list(Path(tempfile.gettempdir()).glob("aioelastic_timer_*"))
