"""The warm fork server when things go wrong: killed, unable to fork, slow to start,
started from a supervisor with odd signal state. Real processes and real faults."""

from __future__ import annotations

import functools
import gc
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
from aioelastic._core.child._forkserver_process import SPARE_NAME
from aioelastic._core.start._forkserver import INLINE_CALL_MAX, ForkServerError, fork_server
from tests.children import core, preload_gc
from tests.support.audit import spare_pids
from tests.support.groups import envs
from tests.support.paths import CHILDREN, REPO
from tests.support.waits import (
    ReadyFifo,
    is_running,
    longest_loop_gap_while_stopped,
    process_state,
    wait_gone,
)


def _stop(preload: tuple[str, ...]) -> None:
    fork_server(preload).stop()


async def add_on_server(
    name: str, preload: tuple[str, ...], *pairs: tuple[int, int]
) -> aioelastic.RunProcsResult:
    """Run one ``core.add`` worker per pair, forked by the fork server of ``preload``."""
    return await aioelastic.run_processes(
        name,
        core.add,
        dict(enumerate(pairs)),
        envs(len(pairs)),
        start_method="forkserver",
        forkserver_preload=preload,
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
async def test_a_preload_that_fails_is_imported_once_for_all_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preload = ("tests.children.forkserver_fails",)
    imports = tmp_path / "imports"
    monkeypatch.setenv("AIOELASTIC_TEST_IMPORTS", str(imports))
    start = time.monotonic()
    with pytest.raises(ForkServerError) as caught:
        await add_on_server("fails", preload, *[(1, 1)] * 4)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert message.startswith(
        "the fork server could not import "
        "forkserver_preload=['tests.children.forkserver_fails']: Traceback"
    )
    assert message.endswith("ImportError: this preload fails to import on purpose")
    assert len(imports.read_text().splitlines()) == 1
    assert fork_server(preload).pid is None


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_calls_reach_the_worker_whole_in_the_request_and_through_a_pipe() -> None:
    # Around the size where the pickled call stops travelling inside the start request
    # and goes through a pipe the supervisor feeds.
    sizes = [10, INLINE_CALL_MAX - 200, INLINE_CALL_MAX + 1, 4 * INLINE_CALL_MAX]
    values = {rank: os.urandom(size) for rank, size in enumerate(sizes)}
    result = await aioelastic.run_processes(
        "calls",
        core.identity,
        {rank: (value,) for rank, value in values.items()},
        envs(len(sizes)),
        start_method="forkserver",
    )
    assert not result.is_failed(), result.failures
    assert result.return_values == values


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_thresholds", [False, True], ids=["default", "preload-sets-its-own"])
async def test_the_preload_imports_without_automatic_collections_and_workers_have_them(
    own_thresholds: bool,
) -> None:
    # Paused during the import (it made a tenth of a cold start with torch), then frozen
    # and given back: a worker collects as a fresh interpreter would, unless the preload
    # chose thresholds of its own, which it keeps.
    # Not imported here: it would set its thresholds in this process.
    own = "tests.children.preload_gc_own"
    preload = (own if own_thresholds else preload_gc.__name__,)
    try:
        result = await aioelastic.run_processes(
            "collector",
            preload_gc.collector_state,
            {0: ()},
            envs(1),
            start_method="forkserver",
            forkserver_preload=preload,
        )
    finally:
        _stop(preload)
    assert not result.is_failed(), result.failures
    state = result.return_values[0]
    expected = [5000, 20, 20] if own_thresholds else list(gc.get_threshold())
    assert state["threshold_at_import"][0] == 0
    assert state["threshold"] == expected
    assert state["enabled"] is True
    assert state["frozen"] > 0


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


def _script_report(script: str, *args: str) -> Any:
    """Run ``tests/children/SCRIPT ARGS`` as a main script (bounded, exit 0); its JSON."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(CHILDREN / script), *args],
        cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert time.monotonic() - start < 50
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.timeout(60)
def test_the_server_imports_the_main_script_only_for_a_call_that_refers_to_it(
    tmp_path: Path,
) -> None:
    # A call to a module's function never runs the supervisor's script in the server
    # (that import would lengthen every cold start); a function of the script still works.
    report = _script_report("lazy_main.py", str(tmp_path / "marks"))
    assert report["module_call"] == {"0": 3}
    assert report["after_module_call"] == ["__main__"]
    assert report["script_call"] == {"0": 42}
    assert report["after_script_call"] == ["__main__", "__mp_main__"]


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


@pytest.mark.timeout(60)
def test_a_main_script_the_server_cannot_import_fails_only_the_calls_that_need_it(
    tmp_path: Path,
) -> None:
    # The script raises when imported as anything but __main__: a call to one of its own
    # functions fails with the import's traceback named, a module's function still runs,
    # and the supervising process ends with nothing left behind.
    report = _script_report("main_fails_in_server.py")
    assert report["script_call"].startswith(
        "the fork server could not import the supervisor's main module, which the call "
        "refers to: Traceback"
    )
    assert "this script refuses to be imported" in report["script_call"]
    assert report["module_call"] == {"0": 3}


# -- huge pages -------------------------------------------------------------------------


def _collapse_works_here() -> bool:
    """Whether this kernel folds a dense anonymous mapping with MADV_COLLAPSE (Linux 6.1)."""
    import ctypes
    import mmap

    from aioelastic._core.child._huge_pages import HUGE_PAGE

    region = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.write(b"\x01" * len(region))
        anchor = ctypes.c_char.from_buffer(region)
        start = -(-ctypes.addressof(anchor) // HUGE_PAGE) * HUGE_PAGE
        del anchor
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return bool(libc.madvise(start, HUGE_PAGE, 25) == 0)
    finally:
        region.close()


def _mappings(pid: int) -> list[dict[str, int]]:
    """Size, Rss and AnonHugePages (bytes) of each mapping of ``pid``."""
    found: list[dict[str, int]] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
                low, high = (int(x, 16) for x in head[0].split("-"))
                found.append({"size": high - low})
            elif head[0] in ("Rss:", "AnonHugePages:"):
                found[-1][head[0][:-1]] = int(head[1]) * 1024
    return found


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_server_folds_its_dense_memory_into_huge_pages_and_leaves_sparse_memory() -> None:
    if not _collapse_works_here():
        pytest.skip("this kernel does not fold memory with MADV_COLLAPSE (Linux >= 6.1)")
    from tests.children import preload_dense

    preload = ("tests.children.preload_dense",)
    try:
        assert (await add_on_server("before", preload, (1, 2), (3, 4))).return_values == {
            0: 3,
            1: 7,
        }
        server = fork_server(preload)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 2  # forked from the folded memory
        assert server.pid is not None
        mappings = _mappings(server.pid)
        dense = [m for m in mappings if m["size"] == preload_dense.DENSE_BYTES]
        sparse = [m for m in mappings if m["size"] == preload_dense.SPARSE_BYTES]
        assert len(dense) == 1
        assert len(sparse) == 1
        # Every whole huge page of the dense mapping (its ends may not be aligned).
        assert dense[0]["AnonHugePages"] >= preload_dense.DENSE_BYTES - (4 << 20)
        assert sparse[0]["AnonHugePages"] == 0
        assert sparse[0]["Rss"] <= 1 << 20
        # Workers forked from the folded server, and from its spares, compute as before.
        for name in ("from spares", "forked"):
            result = await add_on_server(name, preload, (5, 6), (7, 8))
            assert result.return_values == {0: 11, 1: 15}
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_hugepages_env_zero_keeps_the_server_in_small_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[always]" in f.read():
            pytest.skip("huge pages are always on here: the kernel folds without being asked")
    from aioelastic._core.child._huge_pages import HUGE_PAGES_ENV
    from tests.children import preload_dense

    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    preload = ("tests.children.preload_dense", "json")  # a server of this test's own
    try:
        assert (await add_on_server("small", preload, (1, 2))).return_values == {0: 3}
        server = fork_server(preload)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 1
        assert server.pid is not None
        dense = [m for m in _mappings(server.pid) if m["size"] == preload_dense.DENSE_BYTES]
        assert dense[0]["AnonHugePages"] == 0
        assert dense[0]["Rss"] == preload_dense.DENSE_BYTES
    finally:
        _stop(preload)


def test_only_dense_private_anonymous_memory_is_planned_for_folding() -> None:
    from aioelastic._core.child._huge_pages import HUGE_PAGE, _dense_private_regions

    mib = 1 << 20
    smaps = "\n".join(
        [
            # The heap, dense, its ends not aligned: the whole huge pages inside it.
            f"{3 * HUGE_PAGE - mib:x}-{7 * HUGE_PAGE + mib:x} rw-p 00000000 00:00 0   [heap]",
            f"Size: {(4 * HUGE_PAGE + 2 * mib) // 1024} kB",
            f"Rss: {(4 * HUGE_PAGE + 2 * mib) // 1024} kB",
            # Dense anonymous memory: planned.
            f"{10 * HUGE_PAGE:x}-{12 * HUGE_PAGE:x} rw-p 00000000 00:00 0",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            # Sparse: left alone.
            f"{20 * HUGE_PAGE:x}-{30 * HUGE_PAGE:x} rw-p 00000000 00:00 0",
            "Rss: 4 kB",
            # A file's data, the stack, read-only and shared memory: never.
            f"{40 * HUGE_PAGE:x}-{42 * HUGE_PAGE:x} rw-p 00000000 08:01 42   /usr/lib/libx.so",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            f"{50 * HUGE_PAGE:x}-{52 * HUGE_PAGE:x} rw-p 00000000 00:00 0   [stack]",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            f"{60 * HUGE_PAGE:x}-{62 * HUGE_PAGE:x} r--p 00000000 00:00 0",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            f"{70 * HUGE_PAGE:x}-{72 * HUGE_PAGE:x} rw-s 00000000 00:01 7   /dev/zero",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            # Dense but smaller than one aligned huge page: nothing to fold.
            f"{80 * HUGE_PAGE + mib:x}-{81 * HUGE_PAGE + mib:x} rw-p 00000000 00:00 0",
            f"Rss: {HUGE_PAGE // 1024} kB",
        ]
    )
    assert list(_dense_private_regions(smaps)) == [
        (3 * HUGE_PAGE, 7 * HUGE_PAGE),
        (10 * HUGE_PAGE, 12 * HUGE_PAGE),
    ]
