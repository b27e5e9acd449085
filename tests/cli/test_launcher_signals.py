"""``aioelastic-run`` stopped by signals, as a user stops it: a subprocess, real workers.

SIGTERM and SIGINT within the shutdown timeout, the trainer stopped before its helpers
(``--stop-leader-first``), a second signal, SIGKILL of the launcher itself, and the
signals passed on to the workers (``--signals-to-handle``). The tests wait for the
workers' ``ready`` lines before they signal the launcher, and on their pidfds to check
that the processes are gone.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.support.cli_child import READY, SCRIPT
from tests.support.cli_run import launcher, with_env
from tests.support.waits import wait_all_gone


def child_pids(pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


@pytest.mark.timeout(60)
def test_sigterm_stops_workers_and_their_children_within_the_shutdown_timeout() -> None:
    with launcher("--nproc-per-node", "2", "--shutdown-timeout", "1", SCRIPT, "hold") as run:
        ready = run.wait_for(READY, 2)
        pids = [int(m[2]) for m in ready] + [int(m[3]) for m in ready]
        started = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == 128 + signal.SIGTERM
        took = time.monotonic() - started
    assert wait_all_gone(pids, 0) == []
    # The children ignore SIGTERM, so they hold their groups for the whole grace period.
    assert 1.0 <= took < 15, took
    assert "stopped by SIGTERM" in run.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("flags", "saved"), [(["--stop-leader-first"], "saved step 0"), ([], "helper gone")]
)
def test_stop_leader_first_lets_a_trainer_checkpoint_with_its_helper_on_sigterm(
    tmp_path: Path, flags: list[str], saved: str
) -> None:
    """The trainer saves on SIGTERM through its helper child: with the flag the helper is
    still there to answer (and stopped right after); without it, as under torchrun, the
    helper got the SIGTERM too."""
    with launcher(*flags, SCRIPT, "checkpoint", "--out", str(tmp_path)) as run:
        (ready,) = run.wait_for(READY, 1)
        pids = [int(ready[2]), int(ready[3])]
        started = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == 128 + signal.SIGTERM, run.stderr
        took = time.monotonic() - started
    assert (tmp_path / "rank0").read_text() == saved
    assert wait_all_gone(pids, 0) == []
    assert took < 20, took  # far from the 30 s grace period: nothing waited it out


@pytest.mark.timeout(60)
def test_a_worker_child_that_left_its_process_group_is_stopped_too() -> None:
    with launcher("--nproc-per-node", "2", SCRIPT, "hold", "--escape") as run:
        ready = run.wait_for(READY, 2)
        children = [int(m[3]) for m in ready]
        assert all(os.getpgid(c) == c for c in children)  # out of the workers' groups
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == 128 + signal.SIGTERM, run.stderr
    # Orphaned when their worker stopped, re-parented to the launcher (a subreaper), and
    # swept by its teardown.
    assert wait_all_gone(children, 0) == []


@pytest.mark.timeout(60)
def test_sigint_exits_130_and_a_second_signal_kills_at_once() -> None:
    with launcher(
        "--nproc-per-node", "2", "--shutdown-timeout", "300", SCRIPT, "hold", "--ignore-signals",
        env=with_env(LOGLEVEL="INFO"),
    ) as run:  # fmt: skip
        ready = run.wait_for(READY, 2)
        pids = [int(m[2]) for m in ready] + [int(m[3]) for m in ready]
        run.proc.send_signal(signal.SIGINT)
        run.wait_for_stderr("received SIGINT")
        # The workers and their children ignore SIGTERM and SIGINT alike: only the second
        # signal's SIGKILL ends them, long before the 300 s grace period.
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 128 + signal.SIGINT
    assert wait_all_gone(pids, 0) == []


@pytest.mark.timeout(60)
def test_three_quick_sigterms_leave_nothing_alive() -> None:
    # The kernel merges a signal sent while the same one is still pending, so the launcher
    # may see one, two or three of these: whichever, it must stop everything and exit 143
    # (torchrun exits at the second with its workers still running).
    with launcher(
        "--nproc-per-node", "2", "--shutdown-timeout", "2", SCRIPT, "hold", "--ignore-signals"
    ) as run:
        ready = run.wait_for(READY, 2)
        pids = [int(m[2]) for m in ready] + [int(m[3]) for m in ready]
        for _ in range(3):
            run.proc.send_signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 128 + signal.SIGTERM
    assert wait_all_gone(pids, 0) == []


@pytest.mark.timeout(60)
def test_sigkill_to_the_launcher_leaves_no_worker_and_no_worker_child() -> None:
    with launcher("--nproc-per-node", "2", SCRIPT, "hold", "--ignore-signals") as run:
        ready = run.wait_for(READY, 2)
        workers = [int(m[2]) for m in ready]
        children = [int(m[3]) for m in ready]
        helpers = [p for p in child_pids(run.proc.pid) if p not in workers]
        run.proc.kill()
        assert run.finish() == -signal.SIGKILL
    # Workers die of PR_SET_PDEATHSIG; their children (re-parented to init) and the
    # watchdog go right after.
    assert wait_all_gone(workers + children + helpers, 10) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("handled", "sent"), [("SIGTERM,SIGINT", signal.SIGINT), ("SIGUSR1", signal.SIGUSR1)]
)
def test_workers_receive_the_signal_the_launcher_received(handled: str, sent: int) -> None:
    with launcher(
        "--nproc-per-node", "2", "--signals-to-handle", handled, SCRIPT, "catch"
    ) as run:  # fmt: skip
        run.wait_for(READY, 2)
        run.proc.send_signal(sent)
        assert run.finish() == 128 + sent, run.stderr
    name = signal.Signals(sent).name
    assert sorted(re.findall(rf"caught {name} rank=(\d)", run.stdout)) == ["0", "1"], run.stdout
