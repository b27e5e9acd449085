"""Cancellation safety: cancelled at any await point of start, wait or close, nothing is left.

How every await point is reached, deterministically: :class:`CancelAfterSuspensions`
drives the supervising coroutine itself and counts each time it suspends (yields to the
event loop — an ``await`` that really waits). Run ``n`` cancels the surrounding
:class:`anyio.CancelScope` right after the ``n``-th suspension, through a loop callback,
exactly as a cancellation from another task would arrive. ``n`` goes 1, 2, 3, ... until a
run finishes before its ``n``-th suspension: by then every suspension point of the
scenario has received a cancellation in some run.

Why not the alternatives: ``move_on_after`` with growing deadlines lands wherever timing
puts it and skips points; wrapping a few core primitives (``anyio.wait_readable``,
``on_launcher_thread``) with a counter reaches only the points one thought of, while this
reaches every suspension of the supervising task, including anyio's own checkpoints and
the ones inside task groups. Shielded sections (launches, teardown) receive the
cancellation at their end, as they should — that is part of what is tested.

The number of suspensions can differ by a few between runs (an exit already visible at
the first look saves a wait), which only shifts which run hits which point; each run is
checked the same way: every worker started is stopped and reaped, its process group is
empty, no descriptor or zombie is left, and no empty temporary directory remains.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic import Std
from aioelastic._core import _pcontext, _platform
from tests.audit import Audit, audit_fds, new_zombies, open_fds, reaped, zombie_children
from tests.children import core, soak
from tests.waits import ReadyFifo

pytestmark = pytest.mark.asyncio

#: Safety bound on the runs of one scenario (each run is one more suspension point).
MAX_RUNS = 400


class CancelAfterSuspensions:
    """Await ``coro``, cancelling ``scope`` right after its ``n``-th suspension.

    The cancellation is requested from a loop callback scheduled before the coroutine
    suspends, so it is delivered while the coroutine waits at that very point (or, inside
    a shielded section, when the section ends).
    """

    def __init__(self, coro: Coroutine[Any, Any, Any], n: int, scope: anyio.CancelScope) -> None:
        self._coro = coro
        self._n = n
        self._scope = scope
        self.suspensions = 0

    @property
    def fired(self) -> bool:
        """Whether the cancellation was requested (the coroutine got that far)."""
        return self.suspensions >= self._n

    def __await__(self) -> Generator[Any, Any, Any]:
        loop = asyncio.get_running_loop()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = self._coro.send(value) if error is None else self._coro.throw(error)
            except StopIteration as stop:
                return stop.value
            self.suspensions += 1
            if self.suspensions == self._n:
                loop.call_soon(self._scope.cancel)
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # delivered to the coroutine where it waits
                value, error = None, exc


Scenario = Callable[[list[aioelastic.PContext]], Awaitable[None]]


def _ranks(n: int, *args: Any) -> dict[int, tuple[Any, ...]]:
    return {r: args for r in range(n)}


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {r: {} for r in range(n)}


def blocking_group(method: str, fifo: ReadyFifo, **kwargs: Any) -> aioelastic.PContext:
    """Two workers that say ready and block until stopped."""
    if method == "binary":
        return aioelastic.start_processes(
            "blk",
            sys.executable,
            _ranks(2, "-m", "tests.children.core", "block", str(fifo.path)),
            _envs(2),
            **kwargs,
        )
    return aioelastic.start_processes(
        "blk",
        core.block_forever,
        _ranks(2, str(fifo.path)),
        _envs(2),
        start_method=method,
        **kwargs,
    )


class _Fifo(ReadyFifo):
    def pending_discard(self) -> None:
        """Drop what the last run's workers wrote (a cancelled run may not have read it)."""
        while True:
            try:
                if not os.read(self._fd, 65536):
                    break
            except BlockingIOError:
                break
        self._buffer = b""


async def _each_run(scenario: Scenario, tmp: Path, *, fifo: _Fifo | None = None) -> tuple[int, int]:
    """Run ``scenario`` cancelled after its 1st, 2nd, ... suspension; check each run.

    Returns (runs, suspensions of the uncancelled run).
    """
    for n in range(1, MAX_RUNS + 1):
        fds_before = open_fds()
        zombies_before = set(zombie_children())
        temp_before = set(os.listdir(tmp))
        contexts: list[aioelastic.PContext] = []
        with anyio.CancelScope() as scope:
            driver = CancelAfterSuspensions(scenario(contexts), n, scope)
            await driver
        if fifo is not None:
            fifo.pending_discard()
        audit = Audit()
        for ctx in contexts:
            await _check_stopped(ctx, audit)
        zombies = new_zombies(zombies_before)
        if zombies:
            audit.fail("zombies", f"unreaped children {zombies}")
        audit_fds(fds_before, audit)
        for name in set(os.listdir(tmp)) - temp_before:
            path = tmp / name
            if not any(p.is_file() for p in path.rglob("*")):
                audit.fail("temp files", f"empty temporary directory {name} left")
        assert not audit.problems, f"cancelled after suspension {n}: {audit.problems}"
        if not driver.fired:
            return n, driver.suspensions
    raise AssertionError(f"the scenario still suspended after {MAX_RUNS} runs")


async def _check_stopped(ctx: aioelastic.PContext, audit: Audit) -> None:
    pids = ctx.pids()
    for rank, pid in pids.items():
        state = await reaped(pid, 5.0)
        if state is not None:
            audit.fail("processes", f"worker {rank} (pid {pid}) left in state {state}")
    members = _platform.live_group_members(set(pids.values()))
    if members:
        audit.fail("processes", f"process groups still have members: {members}")


async def _run_each(
    scenario: Scenario,
    tmp: Path,
    capsys: pytest.CaptureFixture[str],
    what: str,
    *,
    fifo: _Fifo | None = None,
) -> int:
    """:func:`_each_run`, its summary printed and ``fifo`` closed; returns the suspensions."""
    try:
        runs, points = await _each_run(scenario, tmp, fifo=fifo)
    finally:
        if fifo is not None:
            fifo.close()
    with capsys.disabled():
        print(f"\n{what}: {points} suspension points, {runs} runs, nothing left behind")
    return points


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn", "binary"])
@pytest.mark.timeout(300)
async def test_cancel_anywhere_in_start_wait_close(
    method: str, tmp_path: Path, private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Start two blocking workers, wait for them, check, close explicitly, leave."""
    fifo = _Fifo(tmp_path)

    async def scenario(contexts: list[aioelastic.PContext]) -> None:
        ctx = blocking_group(method, fifo, redirects=Std.ERR, grace_period=5)
        contexts.append(ctx)
        async with ctx:
            await fifo.lines(2)
            assert await ctx.wait(timeout=0) is None
            await ctx.close()
            await ctx.wait()

    points = await _run_each(
        scenario, private_tmp, capsys, f"start/wait/close ({method})", fifo=fifo
    )
    assert points >= 3


@pytest.mark.timeout(300)
async def test_cancel_anywhere_between_the_slices_of_a_binary_start(
    tmp_path: Path,
    private_tmp: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Binaries are handed to the watchdog in slices of the event loop; a cancellation
    between two records and stops the ones handed over, and starts no other."""
    monkeypatch.setattr(_pcontext, "_SLICE", 0.0)  # every worker a slice of its own
    fifo = _Fifo(tmp_path)

    async def scenario(contexts: list[aioelastic.PContext]) -> None:
        ctx = blocking_group("binary", fifo, redirects=Std.ERR, grace_period=5)
        contexts.append(ctx)
        async with ctx:
            await fifo.lines(2)
            await ctx.close()

    points = await _run_each(scenario, private_tmp, capsys, "sliced binary start", fifo=fifo)
    assert points >= 3


@pytest.mark.timeout(300)
async def test_cancel_anywhere_while_a_failure_tears_the_group_down(
    tmp_path: Path, private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 fails once released, rank 1 ignores SIGTERM: wait() runs the teardown."""
    fifo = _Fifo(tmp_path)
    plans = [
        {"rank": 0, "kind": "exit", "code": 3, "fifo": str(fifo.path), "children": []},
        {"rank": 1, "kind": "ignore_term", "fifo": str(fifo.path), "children": ["exec"]},
    ]

    async def scenario(contexts: list[aioelastic.PContext]) -> None:
        ctx = aioelastic.start_processes(
            "fail",
            soak.run,
            {r: (p,) for r, p in enumerate(plans)},
            _envs(2),
            start_method="fork",
            grace_period=0.3,
        )
        contexts.append(ctx)
        async with ctx:
            ready = [line.split() for line in await fifo.lines(3)]
            pid = next(int(w[2]) for w in ready if w[:2] == ["ready", "0"])
            os.kill(pid, signal.SIGUSR1)  # rank 0: fail now
            result = await ctx.wait()
            assert result is not None
            assert {r: f.exitcode for r, f in result.failures.items()} == {0: 3}

    await _run_each(scenario, private_tmp, capsys, "failure teardown", fifo=fifo)


@pytest.mark.timeout(300)
async def test_cancel_anywhere_in_a_grace_period(
    tmp_path: Path, private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Workers and their children ignore SIGTERM: close() waits out its grace, then kills."""
    fifo = _Fifo(tmp_path)

    async def scenario(contexts: list[aioelastic.PContext]) -> None:
        ctx = aioelastic.start_processes(
            "grace",
            core.grandchild_then,
            _ranks(2, str(fifo.path), -1, True),
            _envs(2),
            start_method="forkserver",
            grace_period=0.2,
        )
        contexts.append(ctx)
        async with ctx:
            await fifo.lines(2)
            await ctx.close()

    await _run_each(scenario, private_tmp, capsys, "close with a grace period", fifo=fifo)


@pytest.mark.parametrize("method", ["fork", "binary"])
@pytest.mark.timeout(300)
async def test_cancel_anywhere_in_run_processes(
    method: str, private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run_processes (start + wait + close) of workers that succeed, output redirected."""

    async def scenario(contexts: list[aioelastic.PContext]) -> None:
        if method == "binary":
            result = await aioelastic.run_processes(
                "run", "true", _ranks(3), _envs(3), redirects=Std.ALL
            )
        else:
            result = await aioelastic.run_processes(
                "run", core.add, _ranks(3, 1, 2), _envs(3), start_method=method, redirects=Std.ALL
            )
        assert not result.is_failed()

    await _run_each(_collecting(scenario), private_tmp, capsys, f"run_processes ({method})")


def _collecting(scenario: Scenario) -> Scenario:
    """Let the check see the PContext that run_processes makes inside."""

    async def wrapped(contexts: list[aioelastic.PContext]) -> None:
        real_init = aioelastic.PContext.__init__

        def init(self: aioelastic.PContext, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            contexts.append(self)

        aioelastic.PContext.__init__ = init  # type: ignore[method-assign]
        try:
            await scenario(contexts)
        finally:
            aioelastic.PContext.__init__ = real_init  # type: ignore[method-assign]

    return wrapped


@pytest.mark.timeout(120)
async def test_cancel_anywhere_in_a_start_that_fails(
    private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fork server whose preload fails to import: start raises, having started nothing."""

    async def scenario(contexts: list[aioelastic.PContext]) -> None:
        ctx = aioelastic.start_processes(
            "badpreload",
            core.add,
            _ranks(2, 1, 1),
            _envs(2),
            start_method="forkserver",
            forkserver_preload=("tests.children.import_fails",),
        )
        contexts.append(ctx)
        with pytest.raises(RuntimeError, match="could not import"):
            async with ctx:
                pass

    await _run_each(scenario, private_tmp, capsys, "a start that fails")
