"""start_processes / PContext / run_processes with real processes and real signals."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic._core.output import _log_root as log_root
from aioelastic._core.process import _platform
from aioelastic._core.start._forkserver import fork_server
from tests.children import core
from tests.support.groups import envs
from tests.support.waits import ReadyFifo, is_running, make_fifo

pytestmark = pytest.mark.asyncio

METHODS = ["spawn", "fork", "forkserver"]


@pytest.fixture(params=["pidfd", "waitid-thread"])
def exit_watch_mode(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Run a test with pidfds and again with the fallback (a waitid thread)."""
    if request.param == "waitid-thread":
        monkeypatch.setenv(_platform.NO_PIDFD_ENV, "1")
    _platform.pidfd_supported.cache_clear()
    yield request.param
    monkeypatch.delenv(_platform.NO_PIDFD_ENV, raising=False)
    _platform.pidfd_supported.cache_clear()


def _failing_and_blocking(ready: ReadyFifo, go: Path, grace_period: float) -> aioelastic.PContext:
    """Rank 0 fails once ``go`` is written to (see :func:`_release`), rank 1 blocks."""
    return aioelastic.start_processes(
        "siblings",
        core.behave,
        {0: ("fail_after_ready", str(ready.path), str(go)), 1: ("block", str(ready.path))},
        envs(2),
        grace_period=grace_period,
    )


def _release(go: Path) -> None:
    with open(go, "w") as f:
        f.write("go\n")


@pytest.mark.parametrize("method", METHODS)
async def test_function_workers_return_values(method: str) -> None:
    result = await aioelastic.run_processes(
        "adder", core.add, {0: (1, 2), 1: (3, 4)}, envs(2), start_method=method
    )
    assert not result.is_failed()
    assert result.return_values == {0: 3, 1: 7}
    assert result.stdouts == {0: "", 1: ""}


async def test_binary_workers_succeed() -> None:
    result = await aioelastic.run_processes(
        "true", "true", {0: (), 1: (), 2: ()}, envs(3), grace_period=1
    )
    assert not result.is_failed()
    assert result.return_values == {0: None, 1: None, 2: None}


async def test_a_group_and_its_workers_say_what_they_are_and_where_they_stand(
    tmp_path: Path,
) -> None:
    ready = ReadyFifo(tmp_path)
    ctx = aioelastic.start_processes(
        "shown", core.block_forever, {0: (str(ready.path),)}, envs(1), grace_period=5
    )
    assert repr(ctx) == "<PContext 'shown' spawn nprocs=1 new started=0>"
    try:
        async with ctx:
            await ready.lines(1)
            assert repr(ctx) == "<PContext 'shown' spawn nprocs=1 running started=1>"
            (worker,) = ctx._workers
            assert repr(worker) == f"<WorkerProcess local_rank=0 pid={worker.pid} running>"
            await ctx.close()
            assert repr(ctx) == "<PContext 'shown' spawn nprocs=1 closed started=1>"
            assert repr(worker) == (
                f"<WorkerProcess local_rank=0 pid={worker.pid} stopped exitcode=-15>"
            )
    finally:
        ready.close()
    binaries = aioelastic.start_processes("b", "true", {0: ()}, envs(1))
    assert repr(binaries) == "<PContext 'b' binary nprocs=1 new started=0>"


@pytest.mark.parametrize("method", METHODS)
async def test_env_applied_in_worker_and_parent_untouched(method: str) -> None:
    before = dict(os.environ)
    result = await aioelastic.run_processes(
        "env",
        core.env_value,
        {0: ("AIOELASTIC_X",), 1: ("TORCHELASTIC_ERROR_FILE",)},
        {0: {"AIOELASTIC_X": 42}, 1: {}},  # type: ignore[dict-item]
        start_method=method,
    )
    assert result.return_values[0] == "42"
    assert str(result.return_values[1]).endswith("/1/error.json")
    assert dict(os.environ) == before


async def test_each_worker_leads_its_own_process_group(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "groups", core.block_forever, {0: (str(fifo.path),), 1: (str(fifo.path),)}, envs(2)
        ) as ctx:
            await fifo.lines(2)
            for pid in ctx.pids().values():
                assert os.getpgid(pid) == pid
    finally:
        fifo.close()


@pytest.mark.parametrize("method", METHODS)
async def test_failure_stops_siblings_and_reports_only_the_failed_rank(
    method: str, tmp_path: Path, exit_watch_mode: str
) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "fail",
            core.behave,
            {0: ("raise", "boom"), 1: ("block", str(fifo.path))},
            envs(2),
            start_method=method,
        ) as ctx:
            result = await ctx.wait()
            sibling = ctx.pids()[1]
    finally:
        fifo.close()
    assert result is not None
    assert list(result.failures) == [0]
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert "ValueError: boom" in failure.message
    assert "py_callstack" in str(failure.error_file_data)
    assert not is_running(sibling)


@pytest.mark.timeout(60)
async def test_a_failure_stops_its_siblings_before_its_report_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Teardown starts at the failing exit, beside the report, not after it.

    The report reads the error file on a thread, bounded by REPORT_TIMEOUT (10 s) for a
    slow filesystem. Here the read of rank 0's file (a slow filesystem: the one thing
    mocked) returns only once its sibling is gone: were the siblings stopped after the
    report, it would wait its full 20 s and the group would end later still.
    """
    ready = ReadyFifo(tmp_path, "ready")
    go = make_fifo(tmp_path, "go.fifo")
    sibling_pidfd: list[int] = []
    read_report = aioelastic.ProcessFailure.from_exit
    sibling_gone: list[bool] = []

    def slow_report(**kwargs: Any) -> aioelastic.ProcessFailure:
        if kwargs["local_rank"] == 0:
            readable, _, _ = select.select(sibling_pidfd, [], [], 20)
            sibling_gone.append(bool(readable))
        return read_report(**kwargs)

    monkeypatch.setattr(aioelastic.ProcessFailure, "from_exit", slow_report)
    try:
        async with _failing_and_blocking(ready, go, grace_period=30) as ctx:
            await ready.lines(2)
            sibling_pidfd.append(os.pidfd_open(ctx.pids()[1]))
            _release(go)
            started = time.monotonic()
            result = await ctx.wait()
            elapsed = time.monotonic() - started
    finally:
        ready.close()
        for fd in sibling_pidfd:
            os.close(fd)
    assert sibling_gone == [True]
    assert elapsed < 10
    assert result is not None
    assert list(result.failures) == [0]
    assert "failed on purpose" in result.failures[0].message


async def test_sibling_stopped_by_supervisor_is_not_a_failure(
    tmp_path: Path, exit_watch_mode: str
) -> None:
    ready = ReadyFifo(tmp_path, "ready")
    go = make_fifo(tmp_path, "go.fifo")
    try:
        async with _failing_and_blocking(ready, go, grace_period=5) as ctx:
            await ready.lines(2)
            _release(go)
            started = time.monotonic()
            result = await ctx.wait()
            noticed = time.monotonic() - started
    finally:
        ready.close()
    assert result is not None
    assert list(result.failures) == [0]
    assert "RuntimeError: failed on purpose" in result.failures[0].message
    # Event-driven: the failure and the SIGTERM'd sibling are seen in milliseconds; torch's
    # wait() period alone is 1 s. Generous bound for a loaded 2-core machine.
    assert noticed < 1.0


async def test_sigterm_ignoring_sibling_is_killed_when_grace_ends(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    grace = 1.0
    try:
        async with aioelastic.start_processes(
            "stubborn",
            core.block_forever,
            {0: (str(ready.path), True), 1: (str(ready.path), True)},
            envs(2),
            grace_period=grace,
        ) as ctx:
            await ready.lines(2)
            pids = list(ctx.pids().values())
            started = time.monotonic()
            await ctx.close()
            took = time.monotonic() - started
    finally:
        ready.close()
    assert grace * 0.9 <= took < grace + 1.0
    assert not any(is_running(pid) for pid in pids)


async def test_second_close_with_sigkill_skips_the_grace(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "escalate", core.block_forever, {0: (str(ready.path), True)}, envs(1), grace_period=60
        ) as ctx:
            await ready.lines(1)
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctx.close)
                await anyio.sleep(0)  # let the first close send SIGTERM
                await ctx.close(signal.SIGKILL)
            took = time.monotonic() - started
    finally:
        ready.close()
    assert took < 5


@pytest.mark.parametrize("method", METHODS)
async def test_signal_death_reports_negative_code_and_name(method: str) -> None:
    result = await aioelastic.run_processes(
        "killed", core.kill_self, {0: (signal.SIGKILL,)}, envs(1), start_method=method
    )
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGKILL
    assert failure.signal_name() == "SIGKILL"


async def test_exit_code_of_binary_is_reported() -> None:
    result = await aioelastic.run_processes(
        "exit3", sys.executable, {0: ("-m", "tests.children.core", "exit", "3")}, envs(1)
    )
    assert result.failures[0].exitcode == 3


@pytest.mark.parametrize("worker_exits", [False, True], ids=["running", "already-exited"])
async def test_children_of_workers_are_gone_after_close(
    tmp_path: Path, worker_exits: bool, exit_watch_mode: str
) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "parents",
            core.grandchild_then,
            {0: (str(fifo.path), 0 if worker_exits else -1)},
            envs(1),
            grace_period=2,
        ) as ctx:
            (line,) = await fifo.lines(1)
            grandchild = int(line.split()[1])
            assert is_running(grandchild)
            if worker_exits:
                result = await ctx.wait()
                assert result is not None
                assert not result.is_failed()
                assert is_running(grandchild), "the worker's exit alone must not kill it"
    finally:
        fifo.close()
    assert not is_running(grandchild)


async def test_worker_exit_seen_while_a_forked_grandchild_holds_its_pipes(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "holder", core.grandchild_then, {0: (str(fifo.path), 0)}, envs(1), start_method="fork"
        ) as ctx:
            await fifo.lines(1)
            with anyio.fail_after(5):
                result = await ctx.wait()
            assert result is not None
            assert result.return_values == {0: None}
    finally:
        fifo.close()


async def test_wait_timeout_returns_none_and_leaves_workers_running(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "slow", core.block_forever, {0: (str(fifo.path),)}, envs(1)
        ) as ctx:
            await fifo.lines(1)
            assert await ctx.wait(timeout=0) is None
            assert await ctx.wait(timeout=0.05) is None
            assert is_running(ctx.pids()[0])
    finally:
        fifo.close()


async def test_cancelling_the_wait_does_not_stop_workers(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "cancelwait", core.block_forever, {0: (str(fifo.path),)}, envs(1)
        ) as ctx:
            await fifo.lines(1)
            with anyio.move_on_after(0.05):
                await ctx.wait()
            assert is_running(ctx.pids()[0])
    finally:
        fifo.close()


async def test_cancelling_the_holder_stops_every_worker(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    pids: list[int] = []

    async def hold() -> None:
        async with aioelastic.start_processes(
            "held",
            core.grandchild_then,
            {0: (str(fifo.path), -1), 1: (str(fifo.path), -1)},
            envs(2),
            grace_period=2,
        ) as ctx:
            pids.extend(ctx.pids().values())
            for line in await fifo.lines(2):
                pids.append(int(line.split()[1]))
            await ctx.wait()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            with anyio.fail_after(30):
                while len(pids) < 4:
                    await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    finally:
        fifo.close()
    assert len(pids) == 4
    assert not any(is_running(pid) for pid in pids)


async def test_return_value_of_100_mb(tmp_path: Path) -> None:
    size = 100 * 1024 * 1024
    result = await aioelastic.run_processes("big", core.big_value, {0: (size,)}, envs(1))
    assert len(result.return_values[0]) == size


@pytest.mark.parametrize("method", ["spawn", "fork"])
async def test_unpicklable_return_value_fails_that_rank(method: str) -> None:
    result = await aioelastic.run_processes(
        "lock", core.unpicklable, {0: (), 1: ()}, envs(2), start_method=method
    )
    assert result.is_failed()
    failure = next(iter(result.failures.values()))
    assert "could not be pickled" in failure.message


async def test_sys_exit_codes_of_function_workers() -> None:
    ok = await aioelastic.run_processes("exit0", core.exit_with, {0: (0,)}, envs(1))
    assert ok.return_values == {0: None}
    bad = await aioelastic.run_processes("exit7", core.exit_with, {0: (7,)}, envs(1))
    assert bad.failures[0].exitcode == 7


async def test_forkserver_is_reused_across_contexts() -> None:
    await aioelastic.run_processes(
        "warm", core.add, {0: (1, 1)}, envs(1), start_method="forkserver"
    )
    server = fork_server(())
    first = server.pid
    await aioelastic.run_processes(
        "warm", core.add, {0: (1, 1)}, envs(1), start_method="forkserver"
    )
    assert server.pid == first is not None


async def test_forkserver_preload_is_imported_once_and_workers_see_it() -> None:
    result = await aioelastic.run_processes(
        "preload",
        core.identity,
        {0: ("ok",)},
        envs(1),
        start_method="forkserver",
        forkserver_preload=("json",),
    )
    assert result.return_values == {0: "ok"}


async def test_context_cannot_be_entered_twice() -> None:
    ctx = aioelastic.start_processes("once", core.add, {0: (1, 2)}, envs(1))
    async with ctx:
        await ctx.wait()
    with pytest.raises(RuntimeError, match="already started"):
        async with ctx:
            pass


async def test_close_is_idempotent_and_wait_after_close_returns(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "twice", core.block_forever, {0: (str(fifo.path),)}, envs(1)
        ) as ctx:
            await fifo.lines(1)
            await ctx.close()
            await ctx.close()
            result = await ctx.wait(timeout=0)
            assert result is not None
            assert not result.failures  # stopped by us, not failed
    finally:
        fifo.close()


async def test_start_failure_stops_the_ones_already_started(tmp_path: Path) -> None:
    ctx = aioelastic.start_processes(
        "badpreload",
        core.add,
        {0: (1, 2)},
        envs(1),
        start_method="forkserver",
        forkserver_preload=("tests.children.import_fails",),
    )
    with pytest.raises(RuntimeError, match="could not import"):
        async with ctx:
            pass


@pytest.mark.parametrize("inner", ["fork", "forkserver", "spawn"])
async def test_a_forked_worker_can_supervise_workers_of_its_own(inner: str) -> None:
    # Warm the outer fork server and watchdog first: the forked worker inherits them.
    await aioelastic.run_processes(
        "warm", core.add, {0: (1, 1)}, envs(1), start_method="forkserver"
    )
    with anyio.fail_after(60):
        result = await aioelastic.run_processes(
            "outer", core.nested_supervisor, {0: (inner,)}, envs(1), start_method="fork"
        )
    assert result.return_values == {0: {0: 21, 1: 22}}


async def test_a_second_close_always_escalates(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "twice", core.block_forever, {0: (str(ready.path), True)}, envs(1), grace_period=60
        ) as ctx:
            await ready.lines(1)
            started = time.monotonic()
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ctx.close)
                    await anyio.wait_all_tasks_blocked()
                    await ctx.close()  # same arguments: a second request, so SIGKILL now
            took = time.monotonic() - started
    finally:
        ready.close()
    assert took < 10


async def test_stale_empty_temporary_log_roots_of_dead_supervisors_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # The sweep runs once per process, at its first temporary root: be that first one.
    monkeypatch.setattr(log_root.runtime, "stale_log_roots_swept", False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"aioelastic_train_p{dead.pid}_k2j4"
    (stale / "0").mkdir(parents=True)
    kept_logs = tmp_path / f"aioelastic_train_p{dead.pid}_a1b2"
    (kept_logs / "0").mkdir(parents=True)
    (kept_logs / "0" / "stdout.log").write_text("the only record of that run\n")
    alive = tmp_path / f"aioelastic_train_p{os.getppid()}_zz99"
    (alive / "0").mkdir(parents=True)
    with anyio.fail_after(60):
        result = await aioelastic.run_processes("lazy", core.add, {0: (1, 2)}, envs(1))
    assert result.return_values == {0: 3}
    # Its own root stayed empty and went at close; the dead owner's empty one went at start.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept_logs.name, alive.name])


async def test_stale_roots_are_swept_once_per_process_not_at_every_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import tempfile

    # Kept roots (they hold logs) stay in the temporary directory for good: a sweep at
    # every start would look into all of them again each time, without bound (a test
    # run that left thousands made a 1,000-start test time out).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(log_root.runtime, "stale_log_roots_swept", False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    first = tmp_path / f"aioelastic_train_p{dead.pid}_aa01"
    (first / "0").mkdir(parents=True)
    with anyio.fail_after(60):
        await aioelastic.run_processes("one", core.add, {0: (1, 2)}, envs(1))
    assert not first.exists()  # swept by this process's first temporary root
    later = tmp_path / f"aioelastic_train_p{dead.pid}_bb02"
    (later / "0").mkdir(parents=True)
    with anyio.fail_after(60):
        await aioelastic.run_processes("two", core.add, {0: (1, 2)}, envs(1))
    assert [p.name for p in tmp_path.iterdir()] == [later.name]  # left for the next process


async def test_a_log_file_made_after_the_call_refuses_the_start_and_leaves_no_new_file(
    tmp_path: Path,
) -> None:
    # Another run writes rank 1's stdout.log between the call (which checked log_dir) and
    # the start: nothing starts, and the log files already made for rank 0 are removed
    # again, so the directory holds only what the other run wrote.
    ctx = aioelastic.start_processes(
        "again", "true", {0: (), 1: ()}, envs(2), log_dir=tmp_path, redirects=aioelastic.Std.ALL
    )
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "stdout.log").write_text("earlier\n")
    with pytest.raises(FileExistsError):
        async with ctx:
            pytest.fail("the workers started")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["1/stdout.log"]
    assert (tmp_path / "1" / "stdout.log").read_text() == "earlier\n"


@pytest.mark.parametrize("last_exit", [0, 3])
async def test_the_last_worker_decides_the_outcome_after_the_others_succeeded(
    tmp_path: Path, last_exit: int
) -> None:
    # The group's outcome is counted as each worker settles: fifteen successes must
    # neither end the wait early nor hide the sixteenth worker's failure.
    n = 16
    gate = make_fifo(tmp_path, "gate.fifo")
    # Read-write: the worker's open for reading finds a writer and does not block; its
    # read then waits for the line written below.
    gate_fd = os.open(gate, os.O_RDWR)
    args = {r: ("-c", "exit 0") for r in range(n - 1)}
    args[n - 1] = ("-c", f"read line < {gate}; exit {last_exit}")
    try:
        async with aioelastic.start_processes("last", "sh", args, envs(n)) as ctx:
            with anyio.fail_after(30):
                for worker in ctx._ranked()[:-1]:
                    await worker.settled.wait()
            assert await ctx.wait(timeout=0) is None
            os.write(gate_fd, b"go\n")
            result = await ctx.wait()
    finally:
        os.close(gate_fd)
    assert result is not None
    assert not result.stopped
    if last_exit == 0:
        assert not result.is_failed()
        assert result.return_values == dict.fromkeys(range(n))
    else:
        assert list(result.failures) == [n - 1]
        assert result.failures[n - 1].exitcode == last_exit
