"""The launcher's own lines (``observe._narrate``): readable, torchrun-like, no reprs."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from aioelastic._core.reports._failures import ProcessFailure
from aioelastic._elastic.observe._events import (
    FailureReason,
    GroupRestarting,
    GroupStopping,
    RendezvousCompleted,
    RunFailed,
    RunSucceeded,
    StopReason,
    WorkerFailed,
    WorkersStarted,
)
from aioelastic._elastic.observe._narrate import LauncherFormatter, Narrator
from tests.support.paths import CHILDREN, REPO

SCRIPT = str(CHILDREN / "cli.py")

pytestmark = pytest.mark.timeout(60)


def _common(attempt: int = 0, restart_count: int = 0, at: float = 100.0) -> dict[str, object]:
    return {
        "timestamp": at,
        "role": "trainer",
        "run_id": "job",
        "attempt": attempt,
        "restart_count": restart_count,
    }


def _rendezvous(world: int, nodes: int, at: float, attempt: int = 0) -> RendezvousCompleted:
    return RendezvousCompleted(
        **_common(attempt=attempt, at=at),
        group_rank=1,
        group_world_size=nodes,
        world_size=world,
        master_addr="node0",
        master_port=29400,
        global_ranks=(4, 5, 6, 7),
    )


def _worker_failed(exitcode: int, signal: str | None = None) -> WorkerFailed:
    failure = ProcessFailure(local_rank=1, pid=4113, exitcode=exitcode, error_file="<N/A>")
    return WorkerFailed(
        **_common(at=101.0),
        global_rank=5,
        local_rank=1,
        pid=4113,
        exitcode=exitcode,
        signal=signal,
        message="boom",
        failure=failure,
    )


def test_a_restart_story_in_lines() -> None:
    narrator = Narrator()
    story = [
        _rendezvous(8, 2, at=100.0),
        WorkersStarted(**_common(at=100.5), pids={4: 10, 5: 11, 6: 12, 7: 13}),
        _worker_failed(5),
        GroupStopping(**_common(at=101.0), reason=StopReason.WORKER_FAILED),
        GroupRestarting(
            **_common(attempt=1, restart_count=1, at=101.2),
            reason=StopReason.WORKER_FAILED,
            delay=2.0,
            restarts_left=2,
        ),
        _worker_failed(-9, "SIGKILL"),
        GroupStopping(
            **_common(attempt=1, restart_count=1, at=110.0),
            reason=StopReason.MEMBERSHIP_CHANGE,
            detail="1 node(s) waiting to join",
        ),
        GroupRestarting(
            **_common(attempt=2, restart_count=1, at=110.1),
            reason=StopReason.MEMBERSHIP_CHANGE,
            delay=0.0,
            restarts_left=2,
        ),
        _rendezvous(12, 3, at=111.0, attempt=2),
        RunSucceeded(**_common(attempt=2, restart_count=1, at=130.5), global_ranks=(4, 5)),
    ]
    said = [line for event in story for line in narrator.lines(event)]
    loud = [text for level, text in said if level >= logging.WARNING]
    assert loud == [
        "failed (exitcode: 5) local_rank: 1 (global rank: 5, pid: 4113)",
        "Worker group FAILED. 3/3 attempts left; will restart worker group "
        "(restart 1 of 3, after 2.0 s backoff)",
        "failed (signal: SIGKILL) local_rank: 1 (global rank: 5, pid: 4113)",
        "membership change (1 node(s) waiting to join): re-rendezvous without using a restart",
        "new membership: world size 12 (3 node(s)), this node is node 1",
        "run succeeded after 1 restart(s), 1 membership change(s) in 30.0 s",
    ]
    quiet = [text for level, text in said if level == logging.INFO]
    assert quiet[0].startswith("rendezvous complete in ")
    assert "started 4 worker(s) (global ranks 4-7) in 0.50 s" in quiet


@pytest.mark.parametrize(
    ("reason", "detail", "decision"),
    [
        (FailureReason.RESTARTS_EXHAUSTED, "", "Worker group FAILED. 0/2 attempts left; giving up"),
        (
            FailureReason.NO_RETRY_EXIT_CODE,
            "exit code 3 is in no_retry_exit_codes",
            "Worker group FAILED; not retried: exit code 3 is in no_retry_exit_codes",
        ),
    ],
)
def test_the_decision_to_stop(reason: FailureReason, detail: str, decision: str) -> None:
    event = RunFailed(**_common(attempt=2, restart_count=2), reason=reason, detail=detail)
    lines = Narrator().lines(event)
    assert lines[0] == (logging.ERROR, decision)
    assert lines[1][0] == logging.ERROR
    assert lines[1][1].startswith("run failed after 2 restart(s)")


@pytest.mark.parametrize(
    ("reason", "detail", "line"),
    [
        (FailureReason.SIGNAL, "SIGTERM", (logging.WARNING, "stopped by SIGTERM in 0.0 s")),
        (FailureReason.CANCELLED, "", (logging.INFO, "cancelled in 0.0 s")),
        (
            FailureReason.ERROR,
            "RendezvousTimeoutError: no peers",
            (logging.ERROR, "agent error: RendezvousTimeoutError: no peers in 0.0 s"),
        ),
    ],
)
def test_a_run_ended_from_outside_is_one_line(
    reason: FailureReason, detail: str, line: tuple[int, str]
) -> None:
    event = RunFailed(**_common(), reason=reason, detail=detail)
    assert Narrator().lines(event) == [line]


def test_debug_lists_fields_never_a_repr(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aioelastic.agent")
    Narrator()(_worker_failed(5))
    texts = [r.getMessage() for r in caplog.records]
    assert texts[0].startswith("worker_failed run_id=job attempt=0 restart_count=0 ")
    assert "global_rank=5" in texts[0]
    assert not any("WorkerFailed(" in t or "ProcessFailure(" in t for t in texts)


class _FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("no_color", "coloured"), [("", True), ("1", False)])
def test_colour_only_on_a_terminal_and_never_with_no_color(
    monkeypatch: pytest.MonkeyPatch, no_color: str, coloured: bool
) -> None:
    monkeypatch.setenv("NO_COLOR", no_color)
    record = logging.LogRecord("aioelastic.agent", logging.ERROR, "", 0, "failed", None, None)
    on_tty = LauncherFormatter("prog", _FakeTty()).format(record)
    assert on_tty == ("\x1b[31m[prog] ERROR:\x1b[0m failed" if coloured else "[prog] ERROR: failed")
    assert LauncherFormatter("prog", io.StringIO()).format(record) == "[prog] ERROR: failed"


def test_at_the_default_level_a_restart_is_said_out_loud() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "aioelastic.run", "--max-restarts", "2",
         "--nproc-per-node", "2", SCRIPT, "flaky", "--fail-times", "1", "--code", "5"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("[aioelastic-run]")]
    assert len(lines) == 3, done.stderr
    assert lines[0].startswith(
        "[aioelastic-run] ERROR: [default] failed (exitcode: 5) local_rank: 0 "
        "(global rank: 0, pid: "
    )
    assert lines[1] == (
        "[aioelastic-run] WARNING: [default] Worker group FAILED. 2/2 attempts left; "
        "will restart worker group (restart 1 of 2)"
    )
    assert lines[2].startswith("[aioelastic-run] WARNING: [default] run succeeded after 1 restart")
