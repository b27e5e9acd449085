"""The fork server's spares: workers forked ahead, ready for the next start of a group.

A spare becomes a worker exactly as a fork at the request would be, with the supervisor's
environment of now; a spare killed while idle is reaped, a stopped one given up after its
timeout; spares no longer wanted are let go and die with their server.
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

import aioelastic
from aioelastic._core.child._forkserver_process import SPARE_NAME
from aioelastic._core.start._forkserver import fork_server
from tests.children import core
from tests.support.audit import spare_pids
from tests.support.fork_server import stop_fork_server as _stop
from tests.support.waits import process_state, wait_gone


async def whoami_on_server(
    name: str, preload: tuple[str, ...], values: list[str]
) -> dict[int, dict[str, object]]:
    result = await aioelastic.run_processes(
        name,
        core.whoami,
        {rank: ("X",) for rank in range(len(values))},
        {rank: {"X": value} for rank, value in enumerate(values)},
        start_method="forkserver",
        forkserver_preload=preload,
    )
    assert not result.is_failed(), result.failures
    return result.return_values


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_next_start_of_a_group_takes_its_workers_from_spares_forked_ahead() -> None:
    preload = ("tests.children.core",)
    try:
        await whoami_on_server("first", preload, ["a", "b"])
        server = fork_server(preload)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 2
        spares = set(spare_pids(server.pid))
        assert len(spares) == 2
        start = time.monotonic()
        second = await whoami_on_server("second", preload, ["c", "d"])
        assert time.monotonic() - start < 30
        # The spares became the workers, each exactly as a fork at its request would be.
        assert {info["pid"] for info in second.values()} == spares
        for rank, info in second.items():
            assert info["env"] == "cd"[rank]
            assert info["pgid"] == info["pid"]
            assert info["ppid"] == server.pid
            assert info["sigint"] == "default_int_handler"
            assert info["sigterm"] is True
            assert info["comm"] != SPARE_NAME
            assert info["cwd"] == os.getcwd()
        # The server reaps a released worker when it reads the release, which comes
        # before this question on the same socket (it may be forking spares meanwhile).
        with anyio.fail_after(30):
            await server.spares_ready()
        for pid in spares:
            assert process_state(pid) is None  # exited and reaped
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_worker_from_a_spare_has_exactly_the_supervisors_environment_of_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server (and its spares) keep the environment of the server's start; each
    worker gets the one of its own start: a variable since removed is absent, a changed
    one has its new value."""
    preload = ("tests.children.core", "json")  # a server of this test's own
    monkeypatch.setenv("AIOELASTIC_TEST_GONE", "then")
    monkeypatch.setenv("AIOELASTIC_TEST_CHANGED", "then")
    try:
        first = await _env_values_on_server(preload)
        assert first == {0: "then", 1: "then"}
        with anyio.fail_after(30):
            assert await fork_server(preload).spares_ready() == 2
        monkeypatch.delenv("AIOELASTIC_TEST_GONE")
        monkeypatch.setenv("AIOELASTIC_TEST_CHANGED", "now")
        assert await _env_values_on_server(preload) == {0: None, 1: "now"}
    finally:
        _stop(preload)


async def _env_values_on_server(preload: tuple[str, ...]) -> dict[int, object]:
    result = await aioelastic.run_processes(
        "env",
        core.env_value,
        {0: ("AIOELASTIC_TEST_GONE",), 1: ("AIOELASTIC_TEST_CHANGED",)},
        {0: {}, 1: {}},
        start_method="forkserver",
        forkserver_preload=preload,
    )
    assert not result.is_failed(), result.failures
    return result.return_values


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_spare_killed_while_idle_is_reaped_and_the_start_still_works() -> None:
    preload = ("tests.children.core",)
    try:
        await whoami_on_server("first", preload, ["a", "b"])
        with anyio.fail_after(30):
            assert await fork_server(preload).spares_ready() == 2
        victim, *_ = spare_pids(fork_server(preload).pid)
        os.kill(victim, signal.SIGKILL)
        await wait_gone(victim)
        # The server sees the death on the spare's socket before this request, and reaps.
        with anyio.fail_after(30):
            await fork_server(preload).spares_ready()
        assert process_state(victim) is None
        second = await whoami_on_server("second", preload, ["c", "d"])
        assert victim not in {info["pid"] for info in second.values()}
        assert [second[r]["env"] for r in (0, 1)] == ["c", "d"]
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_spares_are_let_go_when_no_longer_wanted_and_die_with_their_server() -> None:
    preload = ("tests.children.core",)
    try:
        await whoami_on_server("first", preload, ["a", "b", "c"])
        server = fork_server(preload)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 3
        first_spares = spare_pids(server.pid)
        server.keep_spares(1)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 1
        (kept,) = spare_pids(server.pid)
        for pid in first_spares:
            if pid != kept:
                await wait_gone(pid)
                assert process_state(pid) is None  # reaped by the server, not a zombie
        server.stop()
        await wait_gone(kept)
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_stopped_spare_is_given_up_after_its_timeout_and_the_start_still_works() -> None:
    # A spare that never acknowledges its request (stopped) holds the start back by at
    # most the hand-off timeout; then it is killed and reaped, and the worker is forked.
    preload = ("tests.children.core",)
    try:
        await whoami_on_server("first", preload, ["a"])
        server = fork_server(preload)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 1
        (stopped,) = spare_pids(server.pid)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        second = await whoami_on_server("second", preload, ["b"])
        assert time.monotonic() - start < 30
        assert second[0]["env"] == "b"
        assert second[0]["pid"] != stopped
        assert process_state(stopped) is None  # killed and reaped by the server
    finally:
        _stop(preload)
