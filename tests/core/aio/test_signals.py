"""Scoped signal handling (aioelastic._core.aio._signals).

Signals are sent to the test process itself, so only SIGUSR1/SIGUSR2: the `guard` fixture
gives both a recording Python handler for every test, so a handler that is not installed
(or not restored) shows up as a recorded signal instead of killing the test run. SIGINT
is exercised in a child process by tests/compat/test_launch.py.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from types import FrameType

import anyio
import pytest

from aioelastic._core.aio._signals import SignalReceived, SignalScope, handle_signals
from tests.support.paths import CHILDREN, REPO
from tests.support.waits import is_running

pytestmark = pytest.mark.timeout(30)

USR1 = signal.SIGUSR1
USR2 = signal.SIGUSR2


class Recorder:
    """A plain Python signal handler that records what reached it."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.seen.append(signum)


@pytest.fixture
def guard() -> Iterator[Recorder]:
    recorder = Recorder()
    previous = {sig: signal.signal(sig, recorder) for sig in (USR1, USR2)}
    try:
        yield recorder
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _signal_self_and_wait(scope: SignalScope, sig: int, count: int) -> signal.Signals:
    os.kill(os.getpid(), sig)
    with anyio.fail_after(10):
        return await scope.wait(count)


@pytest.mark.asyncio
async def test_custom_previous_handler_is_restored_exactly(guard: Recorder) -> None:
    async with handle_signals((USR1, USR2)) as sigs:
        assert sigs.installed == {USR1, USR2}
        assert signal.getsignal(USR1) is not guard
        assert await _signal_self_and_wait(sigs, USR1, 1) == USR1
    assert signal.getsignal(USR1) is guard
    assert signal.getsignal(USR2) is guard
    assert guard.seen == []  # the signal went to the scope, not to the old handler
    os.kill(os.getpid(), USR1)
    assert guard.seen == [USR1]  # ...and the old handler works again afterwards


@pytest.mark.asyncio
async def test_records_signals_in_order_with_exit_code(guard: Recorder) -> None:
    async with handle_signals((USR1, USR2)) as sigs:
        assert sigs.first is None
        assert sigs.exit_code is None
        await _signal_self_and_wait(sigs, USR2, 1)
        assert await _signal_self_and_wait(sigs, USR1, 2) == USR1
    assert sigs.received == (USR2, USR1)
    assert sigs.first == USR2
    assert sigs.exit_code == 128 + USR2
    assert guard.seen == []


@pytest.mark.asyncio
async def test_run_until_signal_cancels_the_work_and_raises(guard: Recorder) -> None:
    unwound = False

    async def work() -> None:
        nonlocal unwound
        try:
            os.kill(os.getpid(), USR1)
            await anyio.sleep_forever()
        finally:
            unwound = True

    async with handle_signals((USR1,)) as sigs:
        with anyio.fail_after(10), pytest.raises(SignalReceived) as info:
            await sigs.run_until_signal(work())
    assert unwound
    assert info.value.signum == USR1
    assert info.value.exit_code == 128 + USR1
    assert "SIGUSR1" in str(info.value)


@pytest.mark.asyncio
async def test_run_until_signal_returns_the_result_when_no_signal(guard: Recorder) -> None:
    async def work() -> int:
        await anyio.sleep(0)
        return 42

    async with handle_signals((USR1,)) as sigs:
        assert await sigs.run_until_signal(work()) == 42
        # The scope used for that run is gone: a later signal cancels nothing.
        await _signal_self_and_wait(sigs, USR1, 1)
        await anyio.sleep(0)


@pytest.mark.asyncio
async def test_run_until_signal_after_a_signal_raises_at_once(guard: Recorder) -> None:
    async with handle_signals((USR1,)) as sigs:
        await _signal_self_and_wait(sigs, USR1, 1)
        with anyio.fail_after(10), pytest.raises(SignalReceived):
            await sigs.run_until_signal(anyio.sleep_forever())


@pytest.mark.asyncio
async def test_outer_cancellation_is_not_turned_into_signal_received(guard: Recorder) -> None:
    async with handle_signals((USR1,)) as sigs:
        with anyio.move_on_after(0.05) as outer:
            await sigs.run_until_signal(anyio.sleep_forever())
        assert outer.cancelled_caught
        assert sigs.received == ()


@pytest.mark.asyncio
async def test_escalate_runs_action_on_the_second_signal_only(guard: Recorder) -> None:
    calls: list[signal.Signals] = []
    escalated = anyio.Event()

    async def action(sig: signal.Signals) -> None:
        calls.append(sig)
        await anyio.sleep(0)
        escalated.set()

    async with handle_signals((USR1, USR2)) as sigs:
        await _signal_self_and_wait(sigs, USR1, 1)
        async with sigs.escalate(action, after=2):
            await anyio.sleep(0.01)
            assert calls == []  # the first signal alone does not escalate
            os.kill(os.getpid(), USR2)
            with anyio.fail_after(10):
                await escalated.wait()
    assert calls == [USR2]


@pytest.mark.asyncio
async def test_escalate_counts_signals_that_arrived_before_the_block(guard: Recorder) -> None:
    calls: list[signal.Signals] = []

    async def action(sig: signal.Signals) -> None:
        calls.append(sig)

    async with handle_signals((USR1,)) as sigs:
        await _signal_self_and_wait(sigs, USR1, 1)
        await _signal_self_and_wait(sigs, USR1, 2)
        async with sigs.escalate(action, after=2):
            pass
    # Leaving the block waited for the already-due action instead of cancelling it.
    assert calls == [USR1]


@pytest.mark.asyncio
async def test_escalate_waits_for_a_started_action_and_cancels_an_idle_one(
    guard: Recorder,
) -> None:
    finished = False
    started = anyio.Event()

    async def slow_action(sig: signal.Signals) -> None:
        nonlocal finished
        started.set()
        await anyio.sleep(0.05)
        finished = True

    async def never(sig: signal.Signals) -> None:
        raise AssertionError("must not run")

    async with handle_signals((USR1,)) as sigs:
        async with sigs.escalate(never, after=5):
            pass
        async with sigs.escalate(slow_action, after=1):
            os.kill(os.getpid(), USR1)
            with anyio.fail_after(10):
                await started.wait()
        assert finished


@pytest.mark.asyncio
async def test_escalate_action_failure_propagates(guard: Recorder) -> None:
    async def broken(sig: signal.Signals) -> None:
        raise OSError("boom")

    async def escalate_once(sigs: SignalScope) -> None:
        async with sigs.escalate(broken, after=1):
            await _signal_self_and_wait(sigs, USR1, 1)

    async with handle_signals((USR1,)) as sigs:
        with pytest.raises(RuntimeError, match="escalation failed") as info:
            await escalate_once(sigs)
        assert isinstance(info.value.__cause__, OSError)


@pytest.mark.asyncio
async def test_nested_scopes_both_receive_and_restore_in_turn(guard: Recorder) -> None:
    async with handle_signals((USR1,)) as outer:
        installed = signal.getsignal(USR1)
        async with handle_signals((USR1, USR2)) as inner:
            assert signal.getsignal(USR1) is installed  # shared, not re-installed
            await _signal_self_and_wait(inner, USR1, 1)
            with anyio.fail_after(10):
                await outer.wait(1)
        assert signal.getsignal(USR1) is installed  # outer still active
        assert signal.getsignal(USR2) is guard  # only the inner one wanted it
        await _signal_self_and_wait(outer, USR1, 2)
    assert inner.received == (USR1,)
    assert outer.received == (USR1, USR1)
    assert signal.getsignal(USR1) is guard
    assert guard.seen == []


@pytest.mark.asyncio
async def test_a_handler_the_host_put_on_the_loop_is_restored(guard: Recorder) -> None:
    loop = asyncio.get_running_loop()
    host_got = asyncio.Event()
    loop.add_signal_handler(USR1, host_got.set)
    try:
        async with handle_signals((USR1,)) as sigs:
            await _signal_self_and_wait(sigs, USR1, 1)
        assert not host_got.is_set()
        os.kill(os.getpid(), USR1)
        with anyio.fail_after(10):
            await host_got.wait()
    finally:
        loop.remove_signal_handler(USR1)
    assert guard.seen == []


@pytest.mark.asyncio
async def test_an_ignored_signal_is_handled_in_the_block_and_ignored_again_after(
    guard: Recorder,
) -> None:
    # As torch's launchers do: a background job's inherited SIG_IGN must not make the
    # supervisor deaf to the signals it is told to handle.
    signal.signal(USR2, signal.SIG_IGN)
    async with handle_signals((USR1, USR2)) as sigs:
        assert sigs.installed == {USR1, USR2}
        assert await _signal_self_and_wait(sigs, USR2, 1) == USR2
    assert signal.getsignal(USR2) is signal.SIG_IGN
    assert guard.seen == []


@pytest.mark.asyncio
async def test_an_ignored_sighup_stays_ignored_as_nohup_asked() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        async with handle_signals((signal.SIGHUP, USR1)) as sigs:
            assert sigs.installed == {USR1}
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_off_the_main_thread_nothing_is_installed_and_it_warns_once(guard: Recorder) -> None:
    outcome: dict[str, object] = {}

    async def in_thread() -> None:
        async def work() -> str:
            await asyncio.sleep(0)
            return "done"

        async with handle_signals((USR1, USR2)) as sigs:
            outcome["installed"] = sigs.installed
            outcome["handler"] = signal.getsignal(USR1)
            outcome["result"] = await sigs.run_until_signal(work())

    def run() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(in_thread())
        outcome["warnings"] = [w for w in caught if issubclass(w.category, RuntimeWarning)]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    assert outcome["installed"] == frozenset()
    assert outcome["handler"] is guard
    assert outcome["result"] == "done"
    caught = outcome["warnings"]
    assert isinstance(caught, list)
    assert len(caught) == 1
    assert "SIGUSR1" in str(caught[0].message)
    assert "PR_SET_PDEATHSIG" in str(caught[0].message)
    assert signal.getsignal(USR1) is guard


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("signals", "error"),
    [
        (signal.SIGINT, TypeError),
        (("SIGINT",), TypeError),
        ((True,), TypeError),
        ((), ValueError),
        ((signal.SIGKILL,), ValueError),
        ((signal.SIGSTOP,), ValueError),
        ((100000,), ValueError),
    ],
)
async def test_bad_signals_are_refused_before_anything_is_installed(
    signals: object, error: type[Exception], guard: Recorder
) -> None:
    with pytest.raises(error):
        async with handle_signals(signals):  # type: ignore[arg-type]
            pass
    assert signal.getsignal(USR1) is guard


@pytest.mark.asyncio
async def test_bad_counts_are_refused(guard: Recorder) -> None:
    async def action(sig: signal.Signals) -> None:
        pass

    async with handle_signals((USR1,)) as sigs:
        with pytest.raises(ValueError, match="count"):
            await sigs.wait(0)
        with pytest.raises(ValueError, match="after"):
            async with sigs.escalate(action, after=0):
                pass


def test_signal_received_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(SignalReceived(signal.SIGTERM)))
    assert err.signum == signal.SIGTERM
    assert err.exit_code == 143
    assert str(err) == "SIGTERM received"


# -- the launcher as a shell's background job ---------------------------------------------

CLI_SCRIPT = str(CHILDREN / "cli.py")


def _sigint_ignored(status_line: str) -> bool:
    mask = int(status_line.split(":", 1)[1], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.timeout(90)
def test_a_background_job_launcher_is_stopped_by_sigint_with_its_workers() -> None:
    # A non-interactive bash (no job control) starts `cmd &` with SIGINT and SIGQUIT
    # ignored. The background job prints its own SigIgn, then becomes the launcher by
    # exec (same process: the ignored dispositions carry over).
    launch = (
        f"exec {shlex.quote(sys.executable)} -m aioelastic.run --nproc-per-node 2 "
        f"--shutdown-timeout 60 {shlex.quote(CLI_SCRIPT)} catch"
    )
    shell = (
        f"sh -c {shlex.quote('grep ^SigIgn: /proc/$$/status; ' + launch)} &\n"
        "echo launcher=$!\n"
        "wait $!\n"
        "echo status=$?\n"
    )
    proc = subprocess.Popen(
        ["bash", "-c", shell],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a failing test can stop the whole job
    )
    assert proc.stdout is not None
    launcher = 0
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
        # The two lines come from two processes: either order.
        sig_ign, started_as = sorted([first, second])
        assert sig_ign.startswith("SigIgn:"), (first, second)
        assert _sigint_ignored(sig_ign), sig_ign
        launcher = int(started_as.strip().removeprefix("launcher="))
        ready = [proc.stdout.readline() for _ in range(2)]
        assert all(line.startswith("ready rank=") for line in ready), ready
        workers = [int(line.split("pid=")[1]) for line in ready]
        for pid in workers:
            # Started while the launcher's handler was in place: not ignoring SIGINT.
            assert not _sigint_ignored(_status_line(pid, "SigIgn"))
        started = time.monotonic()
        os.kill(launcher, signal.SIGINT)
        rest, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            # The launcher leads no group of its own: the job's group holds bash and it;
            # the workers die with the launcher (PR_SET_PDEATHSIG).
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    # The workers got the SIGINT (they exit at once on it), well before the 60 s grace.
    assert sorted(line for line in rest.splitlines() if line.startswith("caught")) == [
        "caught SIGINT rank=0",
        "caught SIGINT rank=1",
    ], (rest, stderr)
    assert rest.splitlines()[-1] == f"status={128 + signal.SIGINT}", (rest, stderr)
    assert took < 20, took
    assert all(not is_running(pid) for pid in [launcher, *workers])


def _status_line(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line for line in f if line.startswith(key + ":"))
