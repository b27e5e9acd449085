"""Child programs for the subreaper tests: a worker that leaves a daemon, and a host.

``python tests/children/subreaper.py escape PATH HOW`` (a worker, as a script or as
``-m tests.children.subreaper``; standard library only) starts a daemon out of its
process group, writes the daemon's pid to ``PATH`` and exits 0. ``HOW``: ``exec``, a
``setsid`` child that runs ``sleep``; ``fork``, a child forked without exec that calls
``setsid`` itself.

``python -m tests.children.subreaper host METHOD HOW DIR`` is a host program that uses
aioelastic in-process with subreaper mode on. It has children of its own (one exited and
not reaped yet, one running in a session of its own, as a stray would), runs one worker
with ``start_method=METHOD`` that leaves a daemon (``escape DIR/daemon HOW``), then prints
one JSON line: the daemon's state and what the host then finds of its own children.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

# Run as a script by the launcher, whose sys.path starts at this folder: the repository's
# root is added so that the tests' one /proc reader is importable here too.
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
from tests.support.waits import process_state

#: The daemon's command line when ``HOW`` is ``exec`` (a test looks for it in the warning).
DAEMON_ARGV = ["sleep", "1003"]
#: The host's running child (in a session of its own, as an escaped process would be).
HOST_CHILD_ARGV = ["sleep", "1002"]
#: The worker's child that stays in the worker's process group.
GROUP_CHILD_ARGV = ["sleep", "1005"]


def escape(path: str, how: str) -> None:
    """Leave a daemon outside our process group, write its pid to ``path``, return.

    A child in our group is left behind too: re-parented to the supervisor when we exit,
    it is stopped by the teardown of our group and must not stay a zombie there.
    """
    import subprocess

    subprocess.Popen(GROUP_CHILD_ARGV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    if how == "exec":
        daemon = subprocess.Popen(
            DAEMON_ARGV,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ).pid
    else:
        r, w = os.pipe()
        daemon = os.fork()
        if daemon == 0:
            # Never unwinds into the worker's code (the worker bootstrap, a fork server's
            # loop), whatever ends it.
            try:
                os.close(r)
                os.setsid()
                os.write(w, b"s")  # out of the worker's group: it may exit now
                os.close(w)
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"s"
        os.close(r)
    with open(path, "w") as f:
        f.write(str(daemon))


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids += [int(pid) for pid in f.read().split()]
    return pids


def _reap(pid: int) -> int | str:
    """The exit code (negative: signal) of our child ``pid``; ``"ECHILD"`` if not ours any more."""
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except ChildProcessError:
        return "ECHILD"


def host(method: str, how: str, directory: str) -> dict[str, Any]:
    """See the module documentation."""
    import anyio

    import aioelastic
    from tests.children import subreaper

    assert aioelastic.enable_subreaper()
    # Their stdio is /dev/null: they must not hold the test's pipes, whatever happens.
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    exited = os.posix_spawnp("sh", ["sh", "-c", "exit 7"], os.environ, file_actions=quiet)
    os.waitid(os.P_PID, exited, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    running = os.posix_spawnp(
        HOST_CHILD_ARGV[0], HOST_CHILD_ARGV, os.environ, file_actions=quiet, setsid=True
    )
    report: dict[str, Any] = {}
    try:
        path = os.path.join(directory, "daemon")
        options: dict[str, Any] = {"start_method": method}
        entrypoint: Any = subreaper.escape
        args: tuple[str, ...] = (path, how)
        if method == "binary":
            options = {}
            entrypoint = sys.executable
            args = ("-m", "tests.children.subreaper", "escape", path, how)

        async def run() -> bool:
            result = await aioelastic.run_processes(
                "escape", entrypoint, {0: args}, {0: {}}, **options
            )
            return not result.is_failed()

        report["ok"] = anyio.run(run)
        with open(path) as f:
            report["daemon"] = daemon = int(f.read())
        report["daemon_state"] = process_state(daemon)
        report["running_state"] = process_state(running)
        report["zombies"] = [
            pid for pid in _children() if pid != exited and process_state(pid) == "Z"
        ]
        if report["daemon_state"] is not None:
            # Left running (not recognised): ours to end now.
            os.kill(daemon, signal.SIGKILL)
            _reap(daemon)
    finally:
        # The host's own children are still the host's to end and reap.
        if process_state(running) not in (None, "Z"):
            os.kill(running, signal.SIGKILL)
        report["running_status"] = _reap(running)
        report["exited_status"] = _reap(exited)
    return report


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "escape":
        escape(*args)
    elif command == "host":
        print(json.dumps(host(*args)), flush=True)
    else:
        sys.exit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
