"""Subreaper mode sweeps what descends from the workers, and nothing else.

Subreaper mode cannot be undone, so it never runs in the test process: the tests run the
launcher, or a host program of its own (``tests/children/subreaper.py``), as a
subprocess. The marks themselves (``lineage_env``, the ``/proc`` readers) are checked here.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from aioelastic._core.process import _platform
from aioelastic._core.process._runtime import runtime
from aioelastic._core.process._subreaper import LINEAGE_ENV, lineage_env
from tests.children import subreaper as child
from tests.support.cli_run import launch
from tests.support.paths import CHILDREN, REPO
from tests.support.soak_rounds import Seen, SoakFifo
from tests.support.waits import wait_all_gone

CLI_SCRIPT = str(CHILDREN / "cli.py")
SUBREAPER_SCRIPT = str(CHILDREN / "subreaper.py")


def _swept_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "left behind by workers" in line]


# -- the launcher ------------------------------------------------------------------------------

#: How a container entrypoint starts a sidecar next to the launcher: the background job
#: is the launcher's child from the ``exec`` on.
_ENTRYPOINT = """
sleep 1004 </dev/null >/dev/null 2>&1 &
echo "sidecar $!"
exec "$0" -m aioelastic.run --max-restarts 1 --nproc-per-node 1 "$1" flaky
"""


@pytest.mark.timeout(90)
def test_the_launcher_leaves_a_sidecar_it_was_given_alone_across_a_restart() -> None:
    proc = subprocess.Popen(
        ["sh", "-c", _ENTRYPOINT, sys.executable, CLI_SCRIPT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready, "the entrypoint printed no sidecar pid"
    word, pid = proc.stdout.readline().split()
    assert word == "sidecar"
    sidecar = os.pidfd_open(int(pid))  # holds on to this process, whatever its pid becomes
    try:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        # The first attempt failed, its teardown ran, and the second one succeeded.
        assert "attempt restart_count=0" in out
        assert "attempt restart_count=1" in out
        readable, _, _ = select.select([sidecar], [], [], 0)
        assert not readable, "the sidecar was killed"
        assert _swept_lines(err) == [], err
    finally:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(sidecar, signal.SIGKILL)
        select.select([sidecar], [], [], 10)
        os.close(sidecar)
        if proc.returncode is None:
            proc.kill()
            proc.communicate()


@pytest.mark.timeout(60)
def test_the_launcher_sweeps_a_daemon_a_worker_left_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "daemon"
    run = launch("--nproc-per-node", "1", SUBREAPER_SCRIPT, "escape", str(path), "exec")
    assert run.proc.returncode == 0, run.stderr
    daemon = int(path.read_text())
    assert wait_all_gone([daemon], 10) == []
    # One line at the default level, naming the daemon's pid and command.
    lines = _swept_lines(run.stderr)
    assert len(lines) == 1, run.stderr
    assert "WARNING" in lines[0]
    assert f"{daemon} ({' '.join(child.DAEMON_ARGV)})" in lines[0]


# -- a host program --------------------------------------------------------------------------


def _host(tmp_path: Path, method: str, how: str) -> tuple[dict[str, object], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.children.subreaper", "host", method, how, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


#: Every start method, with a daemon that was executed and one forked without exec (but
#: the fork-started worker's fork: the documented limit, checked below).
_DAEMONS = [
    (method, how)
    for method in ("spawn", "fork", "forkserver", "binary")
    for how in ("exec", "fork")
    if (method, how) != ("fork", "fork")
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("method", "how"), _DAEMONS)
def test_a_host_keeps_its_children_and_a_worker_daemon_is_swept(
    tmp_path: Path, method: str, how: str
) -> None:
    report, stderr = _host(tmp_path, method, how)
    assert report["ok"], stderr
    # The host's children: the running one was not killed, the exited one not reaped.
    assert report["running_state"] not in (None, "Z"), report
    assert report["running_status"] == -signal.SIGKILL, report
    assert report["exited_status"] == 7, report
    # The worker's daemon was swept, and said so; its child in its group was reaped.
    assert report["daemon_state"] is None, report
    assert report["zombies"] == [], report
    lines = _swept_lines(stderr)
    assert len(lines) == 1, stderr
    assert f"{report['daemon']} (" in lines[0]
    if how == "exec":
        assert f"({' '.join(child.DAEMON_ARGV)})" in lines[0]


@pytest.mark.timeout(60)
def test_a_fork_workers_daemon_forked_without_exec_is_not_recognised(tmp_path: Path) -> None:
    """The limit the docs state: its /proc environment is the supervisor's own, unmarked."""
    report, stderr = _host(tmp_path, "fork", "fork")
    assert report["ok"], stderr
    assert report["daemon_state"] not in (None, "Z"), report  # the host killed it after
    assert report["zombies"] == [], report
    assert report["running_status"] == -signal.SIGKILL, report
    assert report["exited_status"] == 7, report
    assert _swept_lines(stderr) == [], stderr


# -- the marks ---------------------------------------------------------------------------------


def test_lineage_env_is_empty_outside_subreaper_mode() -> None:
    assert not runtime.subreaper_enabled
    assert lineage_env({LINEAGE_ENV: "outer"}) == {}


def test_lineage_env_appends_this_process_token_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The flag only: the kernel side (prctl) cannot be undone in the test process.
    monkeypatch.setattr(runtime, "subreaper_enabled", True)
    monkeypatch.setattr(runtime, "lineage_token", None)
    ours = lineage_env({})[LINEAGE_ENV]
    assert ours == runtime.lineage_token
    assert len(ours) == 16
    assert lineage_env({LINEAGE_ENV: "outer"}) == {LINEAGE_ENV: f"outer:{ours}"}
    assert lineage_env({LINEAGE_ENV: f"outer:{ours}"}) == {LINEAGE_ENV: f"outer:{ours}"}


def test_proc_readers_see_the_executed_environment_and_command_line() -> None:
    code = "import os, sys; os.environ['MARK'] = 'later'; print('set', flush=True); input()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "MARK": "exec'd"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"set\n"
        assert _platform.exec_environ_value(proc.pid, "MARK") == "exec'd"
        assert _platform.exec_environ_value(proc.pid, "NO_SUCH_VARIABLE") is None
        command = _platform.command_line(proc.pid)
        assert command.startswith(f"{sys.executable} -c 'import os, sys;"), command
        assert len(_platform.command_line(proc.pid, limit=20)) == 20
    finally:
        proc.communicate(b"\n")
    assert _platform.exec_environ_value(proc.pid, "MARK") is None


@pytest.mark.asyncio
async def test_default_mode_cannot_stop_a_descendant_in_its_own_session(tmp_path: Path) -> None:
    """The documented limit (README "Limits"): without subreaper mode a ``setsid`` escapes.

    Run in a supervisor of its own that is a subreaper for the kernel only, so the escaped
    process is re-parented to it: aioelastic's default mode does not stop it at close(),
    the supervisor reports it alive, then kills and reaps it itself. The soak's subreaper
    rounds show the same descendants stopped when subreaper mode is on.
    """
    fifo = SoakFifo(tmp_path)
    plan = {
        "rank": 0,
        "kind": "hang",
        "fifo": str(fifo.path),
        "block": "event",
        "children": ["setsid", "daemon"],
        "output": {},
    }
    config = {
        "plans": [plan],
        "method": "fork",
        "log_dir": str(tmp_path / "logs"),
        "redirects": [0],
        "grace": 0.5,
        "kernel_subreaper_only": True,
    }
    seen = Seen()
    try:
        async with await anyio.open_process(
            [sys.executable, "-m", "tests.children.soak", "supervise", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
        ) as proc:
            assert proc.stdin is not None
            assert proc.stdout is not None
            out = BufferedByteReceiveStream(proc.stdout)
            await out.receive_until(b"\n", 1 << 20)
            await seen.until_ready(fifo, [plan], proc.wait)
            await proc.stdin.send(b"close\n")
            line = await out.receive_until(b"\n", 1 << 20)
            assert await proc.wait() == 0
    finally:
        fifo.close()
        seen.close()
    report = json.loads(line.split(b" ", 1)[1])
    assert sorted(report["escaped_alive"]) == sorted(seen.grandchildren)
    assert len(seen.grandchildren) == 2
    assert report["zombies"] == []
