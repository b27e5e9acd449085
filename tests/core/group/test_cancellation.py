"""Cancellation safety: cancelled at any await point of start, wait or close, nothing is left.

How every await point is reached, deterministically: :class:`CancelAfterSuspensions`
drives the supervising coroutine itself and counts each time it suspends (yields to the
event loop — an ``await`` that really waits), labelling each suspension with the phase the
scenario is in: ``start``, ``wait`` and ``close`` inside the PContext's own methods
(:func:`_labelled`), a scenario's own label (``ready``) for its awaits in between. A first
run goes uncancelled and shows the phases; then, phase by phase, run ``n`` cancels the
surrounding :class:`anyio.CancelScope` right after the ``n``-th suspension in that phase,
through a loop callback, exactly as a cancellation from another task would arrive. ``n``
goes 1, 2, 3, ... until a run finishes the phase before its ``n``-th suspension there: by
then every suspension point of the scenario has received a cancellation in some run.

Why not the alternatives: ``move_on_after`` with growing deadlines lands wherever timing
puts it and skips points; wrapping a few core primitives (``anyio.wait_readable``,
``on_launcher_thread``) with a counter reaches only the points one thought of, while this
reaches every suspension of the supervising task, including anyio's own checkpoints and
the ones inside task groups. Shielded sections (launches, teardown) receive the
cancellation at their end, as they should — that is part of what is tested.

The number of suspensions can differ by a few between runs (an exit already visible at
the first look saves a wait), which only shifts which run hits which point of a phase —
counting by phase keeps a few more in ``start`` from pushing the sweep past a short
``wait``; each run is checked the same way: every worker started is stopped and reaped,
its process group is empty, no descriptor or zombie is left, and no empty temporary
directory remains. And what was covered is checked: every test asserts in which phases its
cancellations landed, and at least how many in each, or a scenario that stopped
suspending somewhere (or at all) would pass having tested nothing there.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Coroutine, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic import Std
from aioelastic._core.aio import _pace
from aioelastic._core.process import _platform
from tests.children import core, soak
from tests.support.audit import Audit, audit_fds, new_zombies, open_fds, reaped, zombie_children
from tests.support.groups import envs, ranks
from tests.support.waits import ReadyFifo

pytestmark = pytest.mark.asyncio

#: Safety bound on the runs of one scenario (each run is one more suspension point).
MAX_RUNS = 400


@dataclass
class Run:
    """What one run of a scenario shares with the test: its contexts and where it is."""

    #: Every PContext the run made, for the check after it.
    contexts: list[aioelastic.PContext] = field(default_factory=list)
    #: The phase the scenario is in now: the label of its next suspensions.
    phase: str = "scenario"


class CancelAfterSuspensions:
    """Await ``coro``, cancelling ``scope`` right after its ``n``-th suspension in ``phase``.

    The cancellation is requested from a loop callback scheduled before the coroutine
    suspends, so it is delivered while the coroutine waits at that very point (or, inside
    a shielded section, when the section ends). Each suspension is counted under
    ``run.phase`` as it is then; with ``phase=None`` nothing is cancelled.
    """

    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        run: Run,
        scope: anyio.CancelScope,
        phase: str | None = None,
        n: int = 0,
    ) -> None:
        self._coro = coro
        self._run = run
        self._scope = scope
        self._phase = phase
        self._n = n
        #: Phase -> suspensions in it so far, in the order the phases came.
        self.suspensions: Counter[str] = Counter()

    @property
    def fired(self) -> bool:
        """Whether the cancellation was requested (the coroutine got that far)."""
        return self._phase is not None and self.suspensions[self._phase] >= self._n

    def __await__(self) -> Generator[Any, Any, Any]:
        loop = asyncio.get_running_loop()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = self._coro.send(value) if error is None else self._coro.throw(error)
            except StopIteration as stop:
                return stop.value
            phase = self._run.phase
            self.suspensions[phase] += 1
            if phase == self._phase and self.suspensions[phase] == self._n:
                loop.call_soon(self._scope.cancel)
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # delivered to the coroutine where it waits
                value, error = None, exc


Scenario = Callable[[Run], Coroutine[Any, Any, None]]


@dataclass
class Coverage:
    """What :func:`_each_run` exercised."""

    #: Runs made, the first one uncancelled.
    runs: int
    #: Phase -> runs whose cancellation landed in it.
    cancelled_in: Counter[str]
    #: Phase -> suspensions of the uncancelled run in it.
    suspensions: Counter[str]

    @property
    def points(self) -> int:
        """Suspensions of the uncancelled run."""
        return sum(self.suspensions.values())

    def assert_cancelled_in(self, **at_least: int) -> None:
        """Cancellations landed in exactly these phases, at least so many in each.

        The bounds are the real code's floors: ``wait`` and ``close`` are the same in
        every run, ``ready`` depends on how many reads the ready lines take, ``start``
        varies with the launches' timing (2 to 10 measured on a loaded machine), so its
        bound only says that the start was cancelled in at all.
        """
        assert set(self.cancelled_in) == set(at_least), self
        short = {p: n for p, n in at_least.items() if self.cancelled_in[p] < n}
        assert not short, f"fewer cancellations than {short}: {self}"


_PHASE_OF = {"__aenter__": "start", "wait": "wait", "close": "close", "__aexit__": "close"}


@contextmanager
def _labelled(run: Run) -> Iterator[None]:
    """Label the suspensions inside the PContext's lifecycle methods with their phase.

    The innermost method names it (a failed start's own ``close()`` is ``close``); on
    return the caller's label is back.
    """
    real = {name: getattr(aioelastic.PContext, name) for name in _PHASE_OF}

    def labelled(name: str) -> Callable[..., Any]:
        method = real[name]

        async def wrapper(self: aioelastic.PContext, *args: Any, **kwargs: Any) -> Any:
            outer, run.phase = run.phase, _PHASE_OF[name]
            try:
                return await method(self, *args, **kwargs)
            finally:
                run.phase = outer

        return wrapper

    for name in _PHASE_OF:
        setattr(aioelastic.PContext, name, labelled(name))
    try:
        yield
    finally:
        for name, method in real.items():
            setattr(aioelastic.PContext, name, method)


def blocking_group(method: str, fifo: ReadyFifo, **kwargs: Any) -> aioelastic.PContext:
    """Two workers that say ready and block until stopped."""
    if method == "binary":
        return aioelastic.start_processes(
            "blk",
            sys.executable,
            ranks(2, "-m", "tests.children.core", "block", str(fifo.path)),
            envs(2),
            **kwargs,
        )
    return aioelastic.start_processes(
        "blk",
        core.block_forever,
        ranks(2, str(fifo.path)),
        envs(2),
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


async def _each_run(scenario: Scenario, tmp: Path, *, fifo: _Fifo | None = None) -> Coverage:
    """Run ``scenario`` uncancelled, then cancelled after each suspension of each phase."""
    first = await _checked_run(scenario, tmp, fifo)
    cancelled_in: Counter[str] = Counter()
    runs = 1
    for phase in first.suspensions:
        for n in itertools.count(1):
            if runs == MAX_RUNS:
                raise AssertionError(f"the scenario still suspended after {MAX_RUNS} runs")
            runs += 1
            if not (await _checked_run(scenario, tmp, fifo, phase, n)).fired:
                break
            cancelled_in[phase] += 1
    return Coverage(runs, cancelled_in, first.suspensions)


async def _checked_run(
    scenario: Scenario, tmp: Path, fifo: _Fifo | None, phase: str | None = None, n: int = 0
) -> CancelAfterSuspensions:
    """One run, cancelled after the ``n``-th suspension in ``phase``, and its check."""
    fds_before = open_fds()
    zombies_before = set(zombie_children())
    temp_before = set(os.listdir(tmp))
    run = Run()
    with anyio.CancelScope() as scope, _labelled(run):
        driver = CancelAfterSuspensions(scenario(run), run, scope, phase, n)
        await driver
    if fifo is not None:
        fifo.pending_discard()
    audit = Audit()
    for ctx in run.contexts:
        await _check_stopped(ctx, audit)
    zombies = new_zombies(zombies_before)
    if zombies:
        audit.fail("zombies", f"unreaped children {zombies}")
    audit_fds(fds_before, audit)
    for name in set(os.listdir(tmp)) - temp_before:
        path = tmp / name
        if not any(p.is_file() for p in path.rglob("*")):
            audit.fail("temp files", f"empty temporary directory {name} left")
    where = f"cancelled after suspension {n} in {phase}" if phase else "uncancelled"
    assert not audit.problems, f"{where}: {audit.problems}"
    return driver


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
) -> Coverage:
    """:func:`_each_run`, its summary printed and ``fifo`` closed."""
    try:
        coverage = await _each_run(scenario, tmp, fifo=fifo)
    finally:
        if fifo is not None:
            fifo.close()
    with capsys.disabled():
        print(
            f"\n{what}: {coverage.points} suspension points, {coverage.runs} runs, "
            f"cancelled in {dict(coverage.cancelled_in)}, nothing left behind"
        )
    return coverage


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn", "binary"])
@pytest.mark.timeout(300)
async def test_cancel_anywhere_in_start_wait_close(
    method: str, tmp_path: Path, private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Start two blocking workers, wait for them, check, close explicitly, leave."""
    fifo = _Fifo(tmp_path)

    async def scenario(run: Run) -> None:
        ctx = blocking_group(method, fifo, redirects=Std.ERR, grace_period=5)
        run.contexts.append(ctx)
        async with ctx:
            run.phase = "ready"
            await fifo.lines(2)
            assert await ctx.wait(timeout=0) is None
            await ctx.close()
            await ctx.wait()

    coverage = await _run_each(
        scenario, private_tmp, capsys, f"start/wait/close ({method})", fifo=fifo
    )
    # wait(timeout=0) suspends once, and so does the wait() of a group already done (an
    # anyio checkpoint); the explicit close, the one on leaving and the task group's exit.
    coverage.assert_cancelled_in(start=1, ready=1, wait=2, close=3)


@pytest.mark.timeout(300)
async def test_cancel_anywhere_between_the_turns_of_a_binary_start(
    tmp_path: Path,
    private_tmp: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Binaries are handed to the watchdog within the loop's budget per turn; a cancellation
    between two records and stops the ones handed over, and starts no other."""
    monkeypatch.setattr(_pace, "TURN", 0.0)  # every worker a turn of its own
    fifo = _Fifo(tmp_path)

    async def scenario(run: Run) -> None:
        ctx = blocking_group("binary", fifo, redirects=Std.ERR, grace_period=5)
        run.contexts.append(ctx)
        async with ctx:
            run.phase = "ready"
            await fifo.lines(2)
            await ctx.close()

    coverage = await _run_each(scenario, private_tmp, capsys, "sliced binary start", fifo=fifo)
    coverage.assert_cancelled_in(start=1, ready=1, close=3)


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

    async def scenario(run: Run) -> None:
        ctx = aioelastic.start_processes(
            "fail",
            soak.run,
            {r: (p,) for r, p in enumerate(plans)},
            envs(2),
            start_method="fork",
            grace_period=0.3,
        )
        run.contexts.append(ctx)
        async with ctx:
            run.phase = "ready"
            ready = [line.split() for line in await fifo.lines(3)]
            pid = next(int(w[2]) for w in ready if w[:2] == ["ready", "0"])
            os.kill(pid, signal.SIGUSR1)  # rank 0: fail now
            result = await ctx.wait()
            assert result is not None
            assert {r: f.exitcode for r, f in result.failures.items()} == {0: 3}

    coverage = await _run_each(scenario, private_tmp, capsys, "failure teardown", fifo=fifo)
    # wait() suspends waiting for the failure, then for the teardown it started (rank 1
    # outlasts its grace): a cancellation lands in each. Leaving: close() and the task group.
    coverage.assert_cancelled_in(start=1, ready=1, wait=2, close=2)


@pytest.mark.timeout(300)
async def test_cancel_anywhere_in_a_grace_period(
    tmp_path: Path, private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Workers and their children ignore SIGTERM: close() waits out its grace, then kills."""
    fifo = _Fifo(tmp_path)

    async def scenario(run: Run) -> None:
        ctx = aioelastic.start_processes(
            "grace",
            core.grandchild_then,
            ranks(2, str(fifo.path), -1, True),
            envs(2),
            start_method="forkserver",
            grace_period=0.2,
        )
        run.contexts.append(ctx)
        async with ctx:
            run.phase = "ready"
            await fifo.lines(2)
            await ctx.close()

    coverage = await _run_each(
        scenario, private_tmp, capsys, "close with a grace period", fifo=fifo
    )
    # The explicit close() waits for its teardown (grace, SIGKILL, reap) to its end; the
    # one on leaving still goes through to_the_end (nothing left to do); the task group.
    coverage.assert_cancelled_in(start=1, ready=1, close=3)


@pytest.mark.parametrize("method", ["fork", "binary"])
@pytest.mark.timeout(300)
async def test_cancel_anywhere_in_run_processes(
    method: str, private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run_processes (start + wait + close) of workers that succeed, output redirected."""

    async def scenario(run: Run) -> None:
        if method == "binary":
            result = await aioelastic.run_processes(
                "run", "true", ranks(3), envs(3), redirects=Std.ALL
            )
        else:
            result = await aioelastic.run_processes(
                "run", core.add, ranks(3, 1, 2), envs(3), start_method=method, redirects=Std.ALL
            )
        assert not result.is_failed()

    coverage = await _run_each(
        _collecting(scenario), private_tmp, capsys, f"run_processes ({method})"
    )
    # wait() suspends even when the workers are already done (an anyio checkpoint).
    coverage.assert_cancelled_in(start=1, wait=1, close=2)


def _collecting(scenario: Scenario) -> Scenario:
    """Let the check see the PContext that run_processes makes inside."""

    async def wrapped(run: Run) -> None:
        real_init = aioelastic.PContext.__init__

        def init(self: aioelastic.PContext, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            run.contexts.append(self)

        aioelastic.PContext.__init__ = init  # type: ignore[method-assign]
        try:
            await scenario(run)
        finally:
            aioelastic.PContext.__init__ = real_init  # type: ignore[method-assign]

    return wrapped


@pytest.mark.timeout(120)
async def test_cancel_anywhere_in_a_start_that_fails(
    private_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fork server whose preload fails to import: start raises, having started nothing."""

    async def scenario(run: Run) -> None:
        ctx = aioelastic.start_processes(
            "badpreload",
            core.add,
            ranks(2, 1, 1),
            envs(2),
            start_method="forkserver",
            forkserver_preload=("tests.children.import_fails",),
        )
        run.contexts.append(ctx)
        with pytest.raises(RuntimeError, match="could not import"):
            async with ctx:
                pass

    coverage = await _run_each(scenario, private_tmp, capsys, "a start that fails")
    # Start: its floor (4 to 6 measured); close: the failed start's own close(). The body
    # never runs: no wait.
    coverage.assert_cancelled_in(start=1, close=1)
