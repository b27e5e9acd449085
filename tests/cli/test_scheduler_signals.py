"""``aioelastic-run`` under the signals a scheduler sends: to every process of the job.

SLURM (``scancel``, the time limit), systemd (``KillMode=control-group``) and Kubernetes
(a pod's termination) send SIGCONT and SIGTERM to *every* process of a job at once: the
launcher, its helpers (the watchdog, the fork server and its spares) and the workers;
``--signal=USR1`` reaches every launcher, or every process. These tests list the
launcher's process tree through ``/proc`` and signal each pid, as the scheduler does.
Each waits for the workers' ``ready`` lines first, and for what it checks on files,
lines and pidfds, never for a time.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.support.audit import process_tree
from tests.support.cli_child import READY, SCRIPT
from tests.support.cli_run import Launcher, launcher, with_env
from tests.support.waits import wait_all_gone, wait_signal_held

#: How each start method is asked for: a script exec'd by the watchdog (the default), a
#: fork of the warm fork server (``--preload``), a spawned interpreter (``--run-path``).
METHODS = {
    "exec": [],
    "forkserver": ["--preload", "json"],
    "spawn": ["--run-path", "--start-method", "spawn"],
}
GRACE = 5.0
#: A rank's checkpoint on SIGTERM: well inside the grace period.
SAVE = 1.0
#: Past the grace period: the teardown's reaping and the launcher's own exit (its fork
#: server and watchdog stopped), on a loaded two-core machine.
ALLOWANCE = 10.0
RANKS = [0, 1]
HANDLED_USR1 = re.compile(r"handled SIGUSR1 rank=(\d+)")


def _job(tmp_path: Path, method: str, *flags: str, env: dict[str, str] | None = None) -> Launcher:
    argv = ["--nproc-per-node", "2", "--shutdown-timeout", str(GRACE), *METHODS[method], *flags]
    return Launcher([*argv, SCRIPT, "job", "--out", str(tmp_path), "--save", str(SAVE)], env)


def _marked(tmp_path: Path, name: str) -> list[int]:
    return [rank for rank in RANKS if (tmp_path / f"{name}{rank}").exists()]


def _signal_each(pids: list[int], *signals: int) -> None:
    for pid in pids:
        for sig in signals:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # a process that ended on an earlier signal


def _command(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")


def _helpers(run: Launcher) -> list[int]:
    """Every process of the job but the launcher and its workers (from their ready lines)."""
    workers = {int(m[2]) for m in run.wait_for(READY, 2)}
    return [pid for pid in process_tree(run.proc.pid)[1:] if pid not in workers]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("times", [1, 2])
@pytest.mark.parametrize("method", list(METHODS))
def test_sigterm_to_every_process_of_the_job_runs_every_rank_handler(
    tmp_path: Path, method: str, times: int
) -> None:
    run = _job(tmp_path, method)
    try:
        run.wait_for(READY, 2)
        job = process_tree(run.proc.pid)
        assert len(job) >= 4, job  # the launcher, a helper or two, two workers
        started = time.monotonic()
        _signal_each(job, signal.SIGCONT, signal.SIGTERM)
        # A repeat reaches the helpers and the workers, not the launcher: a second signal
        # to the launcher is the user's "kill now" (SIGKILL at once, as documented, and
        # tested in test_launcher_signals.py), which could land before a rank's handler
        # ran; to a helper or an already signalled worker it is no reason to kill.
        for _ in range(times - 1):
            _signal_each(job[1:], signal.SIGCONT, signal.SIGTERM)
        assert run.finish(timeout=GRACE + ALLOWANCE) == 128 + signal.SIGTERM, run.stderr
        took = time.monotonic() - started
    finally:
        run.kill()
    assert _marked(tmp_path, "term") == RANKS, run.stderr
    if times == 1:
        # Checkpointed to the end: no helper's death cut it short, no SIGKILL came early.
        assert _marked(tmp_path, "saved") == RANKS, run.stderr
    assert took < GRACE + ALLOWANCE, took
    assert "stopped by SIGTERM" in run.stderr
    assert wait_all_gone(job, ALLOWANCE) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "signals",
    [
        [signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT],
        [signal.SIGUSR1, signal.SIGUSR2],
    ],
    ids=["stops", "user"],
)
@pytest.mark.parametrize("method", ["exec", "forkserver"])
def test_a_signal_to_a_helper_kills_nothing(
    tmp_path: Path, method: str, signals: list[int]
) -> None:
    """SIGTERM, SIGUSR1... sent to the helpers alone (the watchdog; the fork server and
    its spares): the job goes on.

    The watchdog also gets its parent-death signal (SIGRTMIN) by ``kill`` while its parent
    lives: no reason to kill either.
    """
    with launcher(
        "--nproc-per-node", "2", "--forward-signals", "USR1", *METHODS[method],
        SCRIPT, "job", "--out", str(tmp_path),
    ) as run:  # fmt: skip
        helpers = _helpers(run)
        assert helpers, process_tree(run.proc.pid)
        _signal_each(helpers, *signals)
        _signal_each([p for p in helpers if "_watchdog_process" in _command(p)], signal.SIGRTMIN)
        held = [s for s in signals if s != signal.SIGCONT]
        for pid in helpers:
            for sig in held:
                assert wait_signal_held(pid, sig, 10), (pid, signal.Signals(sig).name)
        # The job goes on: the workers answer a forwarded SIGUSR1 and end it normally.
        run.proc.send_signal(signal.SIGUSR1)
        assert run.finish(timeout=30) == 0, run.stderr
    assert sorted(HANDLED_USR1.findall(run.stdout)) == ["0", "1"], run.stdout
    assert _marked(tmp_path, "term") == []
    assert wait_all_gone(helpers, ALLOWANCE) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", list(METHODS))
def test_a_forwarded_sigusr1_reaches_every_rank_and_the_job_ends_0(
    tmp_path: Path, method: str
) -> None:
    with launcher(
        "--nproc-per-node", "2", "--forward-signals", "USR1", *METHODS[method],
        SCRIPT, "job", "--out", str(tmp_path),
    ) as run:  # fmt: skip
        pids = [int(m[2]) for m in run.wait_for(READY, 2)]
        run.proc.send_signal(signal.SIGUSR1)
        assert run.finish(timeout=30) == 0, run.stderr
    assert sorted(HANDLED_USR1.findall(run.stdout)) == ["0", "1"], run.stdout
    assert _marked(tmp_path, "usr1") == RANKS
    assert wait_all_gone(pids, 0) == []


@pytest.mark.timeout(60)
def test_a_forwarded_signal_a_worker_does_not_handle_is_its_failure(tmp_path: Path) -> None:
    with launcher(
        "--nproc-per-node", "2", "--forward-signals", "USR2", SCRIPT, "job", "--out", str(tmp_path)
    ) as run:
        run.wait_for(READY, 2)
        run.proc.send_signal(signal.SIGUSR2)
        # The exit status of a worker killed by signal N, as for any failure: 128 + N.
        assert run.finish(timeout=30) == 128 + signal.SIGUSR2, run.stderr
    assert "SIGUSR2" in run.stderr
    assert _marked(tmp_path, "term") == []  # died of it: not stopped by the launcher


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_a_user_signal_not_forwarded_never_ends_the_launcher(tmp_path: Path, sig: int) -> None:
    with launcher(
        "--nproc-per-node", "2", SCRIPT, "job", "--out", str(tmp_path),
        env=with_env(LOGLEVEL="INFO"),
    ) as run:  # fmt: skip
        run.wait_for(READY, 2)
        run.proc.send_signal(sig)
        run.wait_for_stderr(f"received {signal.Signals(sig).name}", timeout=30)
        # Still supervising: a SIGTERM now stops the job as usual.
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish(timeout=GRACE + ALLOWANCE + 30) == 128 + signal.SIGTERM, run.stderr
    assert _marked(tmp_path, "term") == RANKS
    assert _marked(tmp_path, "usr1") == []
