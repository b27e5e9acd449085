"""Faults of the environment on the exit path: each ends in time, truthfully, with nothing left.

Real faults only: a full tmpfs under the log directory, SIGCHLD ignored in a supervisor
started for the test, return values whose unpickling raises in the supervisor, low
RLIMIT_NOFILE, a console pipe whose reader went away, ``wait()`` racing ``close()``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from tests.children import core, faults
from tests.support.groups import envs
from tests.support.paths import REPO
from tests.support.waits import ReadyFifo, close_with_reporter_stopped, make_fifo


def python_m(
    module: str, *argv: str, timeout: float = 90, preexec_fn: Callable[[], object] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``python -m module *argv`` from the repository root: the process and its seconds."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )
    return proc, time.monotonic() - start


def supervise(*argv: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``python -m tests.children.faults *argv``; its JSON lines are on stderr."""
    return python_m("tests.children.faults", *argv, timeout=timeout)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: the log directory's disk, soon full."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


# -- the return value is a trust boundary, but must not end the supervisor -------------


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize(
    ("fn", "raised"),
    [(faults.returns_exit, "SystemExit(3)"), (faults.returns_interrupt, "KeyboardInterrupt()")],
)
@pytest.mark.asyncio
async def test_unpickling_that_raises_systemexit_or_keyboardinterrupt_fails_that_rank(
    method: str, fn: Any, raised: str
) -> None:
    with anyio.fail_after(60):
        result = await aioelastic.run_processes(
            "evil", fn, {0: (), 1: ()}, envs(2), start_method=method
        )
    assert result.is_failed()
    assert result.return_values == {}
    failure = result.failures[min(result.failures)]
    assert failure.exitcode == 0  # its real exit status
    assert failure.message == (
        f"worker {failure.local_rank} its return value could not be unpickled by the "
        f"supervisor: {raised}"
    )


# -- a full disk under the log directory -------------------------------------------------

_NOT_WRITTEN = (
    r"worker 0 log {path} not written past byte (\d+): \[Errno 28\] No space left on device"
)


@pytest.mark.asyncio
async def test_full_log_disk_is_reported_and_the_worker_is_not_blocked(full_tmpfs: Path) -> None:
    log_dir = full_tmpfs / "logs"
    start = time.monotonic()
    with anyio.fail_after(60):
        result = await aioelastic.run_processes(
            "full",
            faults.write_bytes,
            {0: (400_000,)},
            envs(1),
            log_dir=log_dir,
            redirects=aioelastic.Std.OUT,
        )
    assert time.monotonic() - start < 60
    assert result.is_failed()
    failure = result.failures[0]
    assert failure.exitcode == 0
    log = log_dir / "0" / "stdout.log"
    match = re.fullmatch(_NOT_WRITTEN.format(path=re.escape(str(log))), failure.message)
    assert match, failure.message
    # Every byte up to the reported one is in the file, and nothing after it.
    assert log.stat().st_size == int(match.group(1))
    assert 0 < int(match.group(1)) < 400_000


@pytest.mark.asyncio
async def test_a_full_log_disk_does_not_stop_the_other_workers(full_tmpfs: Path) -> None:
    import os

    ready = ReadyFifo(full_tmpfs.parent)
    go = make_fifo(full_tmpfs.parent, "go.fifo")
    log_dir = full_tmpfs / "logs"
    try:
        ctx = aioelastic.start_processes(
            "partial",
            faults.flood_or_wait,
            {r: (str(ready.path), str(go), 400_000) for r in range(2)},
            {0: {"ROLE": "flood"}, 1: {}},
            log_dir=log_dir,
            redirects={0: aioelastic.Std.OUT, 1: aioelastic.Std.NONE},
        )
        with anyio.fail_after(60):
            async with ctx:
                (line,) = await ready.lines(1)
                assert line.startswith("ready ")
                # Rank 0 exits (seen without reaping it) with its log cut short...
                flooder = ctx.pids()[0]
                await anyio.to_thread.run_sync(
                    os.waitid, os.P_PID, flooder, os.WEXITED | os.WNOWAIT
                )
                # ...and rank 1 is still there to be released, not stopped.
                with open(go, "w") as f:
                    f.write("go\n")
                assert await ready.lines(1) == ["released"]
                result = await ctx.wait()
    finally:
        ready.close()
    assert result is not None
    assert set(result.failures) == {0}
    assert result.failures[0].exitcode == 0
    assert "not written past byte" in result.failures[0].message
    assert result.return_values == {}


def test_full_log_disk_through_aioelastic_run(full_tmpfs: Path) -> None:
    log_dir = full_tmpfs / "logs"
    proc, took = python_m(
        "aioelastic.run",
        "--nproc-per-node",
        "1",
        "--log-dir",
        str(log_dir),
        "--redirects",
        "1",
        "--no-python",
        "sh",
        "-c",
        "head -c 400000 /dev/zero | tr '\\0' x",
    )
    assert took < 90
    assert proc.returncode == 1, proc.stderr
    logs = list(log_dir.rglob("stdout.log"))
    assert len(logs) == 1
    assert re.search(
        r"log " + re.escape(str(logs[0])) + r" not written past byte \d+: \[Errno 28\] "
        r"No space left on device",
        proc.stderr,
    ), proc.stderr


def test_file_size_limit_on_the_log_is_reported_at_the_exact_byte(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    proc, took = supervise("fsize", "30000", str(log_dir))
    assert took < 90
    assert proc.returncode == 0, proc.stderr
    log = log_dir / "0" / "stdout.log"
    assert json_lines(proc.stderr) == [
        {
            "exitcodes": {"0": 0},
            "messages": {
                "0": f"worker 0 log {log} not written past byte 30000: [Errno 27] File too large"
            },
            "return_values": {},
            "failed": True,
        }
    ]
    assert log.read_bytes() == (b"x" * 99 + b"\n") * 300


# -- inherited signal state ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_sigchld_ignored_in_the_supervisor_still_gives_exact_exit_statuses(method: str) -> None:
    proc, took = supervise("sigchld_ignored", method)
    assert took < 90
    assert proc.returncode == 0, proc.stderr
    ok, three, killed, disposition = json_lines(proc.stderr)
    assert ok == {"exitcodes": {}, "messages": {}, "return_values": {"0": "None"}, "failed": False}
    assert three["exitcodes"] == {"0": 3}
    assert killed["exitcodes"] == {"0": -9}
    assert killed["messages"] == {"0": "killed by SIGKILL (signal 9)"}
    assert disposition == {"sigchld_default": True}


@pytest.mark.asyncio
async def test_workers_start_with_default_signal_dispositions_and_an_empty_mask(
    tmp_path: Path,
) -> None:

    # What a shell under nohup or a host program hands down: SIGHUP and SIGUSR2 ignored,
    # SIGUSR1 blocked. None of it may reach a worker.
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    old_usr2 = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        for method in ("spawn", "fork", "forkserver"):
            with anyio.fail_after(60):
                result = await aioelastic.run_processes(
                    "sigs", faults.signal_state, {0: ()}, envs(1), start_method=method
                )
            assert result.return_values == {0: ("SIG_DFL", "SIG_DFL", "default_int_handler", [])}
        with anyio.fail_after(60):
            result = await aioelastic.run_processes(
                "sigs-bin",
                sys.executable,
                {0: ("-c", faults.SHOW_SIGNALS)},
                envs(1),
                log_dir=tmp_path / "logs",
                redirects=aioelastic.Std.OUT,
            )
        assert not result.is_failed()
        # From /proc: nothing blocked, nothing ignored but what Python itself ignores
        # at startup (SIGPIPE and SIGXFSZ: bits 12 and 24) — and glibc's two internal
        # signals (32, 33: bits 31 and 32), which glibc's posix_spawn (the watchdog starts
        # binaries with it) leaves ignored whatever it is asked; a glibc program installs
        # its own handlers for them, and they are never sent to a worker.
        blocked_label, blocked, ignored_label, ignored = (
            (tmp_path / "logs" / "0" / "stdout.log").read_text().split()
        )
        assert (blocked_label, blocked, ignored_label) == ("SigBlk:", "0" * 16, "SigIgn:")
        assert int(ignored, 16) & ~((1 << 31) | (1 << 32)) == (1 << 12) | (1 << 24)
    finally:
        signal.signal(signal.SIGHUP, old_hup)
        signal.signal(signal.SIGUSR2, old_usr2)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def test_sigchld_ignored_through_aioelastic_run() -> None:
    # A shell's `trap "" CHLD` before exec: the launcher starts with SIGCHLD ignored.
    proc, took = python_m(
        "aioelastic.run",
        "--nproc-per-node",
        "2",
        "--no-python",
        "sh",
        "-c",
        'if [ "$LOCAL_RANK" = 1 ]; then exit 3; fi',
        preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN),
    )
    assert took < 90
    assert proc.returncode != 0, proc.stderr
    assert "rank      : 1 (local_rank: 1)" in proc.stderr
    assert re.search(r"exitcode  : 3 \(pid: \d+\)", proc.stderr), proc.stderr
    assert "traceback : exited with code 3" in proc.stderr


def test_sigchld_ignored_outside_the_main_thread_is_refused_before_anything_starts() -> None:
    proc, took = supervise("sigchld_ignored_thread")
    assert took < 90
    assert proc.returncode == 0, proc.stderr
    assert json_lines(proc.stderr) == [
        {
            "error": "RuntimeError: SIGCHLD is ignored (SIG_IGN) in this process, so the "
            "kernel would reap the workers before their exit status could be read; call "
            "signal.signal(signal.SIGCHLD, signal.SIG_DFL) in the main thread before "
            "starting workers"
        },
        {"children": []},
    ]


# -- resource limits -----------------------------------------------------------------------


_ULIMIT_ERROR = re.compile(
    r"OSError: \[Errno 24\] cannot start (worker \d|the watchdog process|the output readers) "
    r"of 'nofile': "
    r"Too many open files; raise the limit with `ulimit -n` \(now (\d+)\) or "
    r"start fewer workers"
)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_rlimit_nofile_sweep_ends_each_run_with_a_result_or_a_ulimit_error(method: str) -> None:
    # Every limit from "not even one pipe" to "enough": EMFILE strikes at each step of a
    # start in turn (pipes, log files, the exec, the pidfd of a process that exists).
    proc, took = supervise("nofile_sweep", "14", "60", "3", method, timeout=240)
    assert took < 240
    assert proc.returncode == 0, proc.stderr
    *runs, left = json_lines(proc.stderr)
    assert [run["limit"] for run in runs] == list(range(14, 61))
    ok = {"exitcodes": {}, "messages": {}, "return_values": {"0": "1", "1": "2", "2": "3"}}
    for run in runs:
        if "error" in run:
            match = _ULIMIT_ERROR.fullmatch(run["error"])
            assert match, run
            assert int(match.group(2)) == run["limit"]
        elif run["failed"]:
            # A worker itself out of fds (it inherits the limit): its own failure, told.
            assert any("Too many open files" in m for m in run["messages"].values()), run
        else:
            assert run == {"limit": run["limit"], **ok, "failed": False}
    assert "error" in runs[0]
    assert "error" not in runs[-1]
    assert left == {"children": [], "fds": []}


def test_rlimit_nofile_sweep_of_binaries_ends_each_run_with_a_result_or_a_ulimit_error() -> None:
    # Binaries are set up and handed to the watchdog from one task: EMFILE at each step
    # (pipes, log files, the batch's sockets, the pidfd of a process that exists) fails
    # the start with the ulimit error, and whatever was handed over is stopped and reaped.
    proc, took = supervise("nofile_sweep", "14", "60", "3", "binary", timeout=240)
    assert took < 240
    assert proc.returncode == 0, proc.stderr
    *runs, left = json_lines(proc.stderr)
    assert [run["limit"] for run in runs] == list(range(14, 61))
    none = {str(r): "None" for r in range(3)}
    ok = {"exitcodes": {}, "messages": {}, "return_values": none, "failed": False}
    for run in runs:
        if "error" in run:
            match = _ULIMIT_ERROR.fullmatch(run["error"])
            assert match, run
            assert int(match.group(2)) == run["limit"]
        else:
            assert run == {"limit": run["limit"], **ok}
    assert "error" in runs[0]
    assert "error" not in runs[-1]
    assert left == {"children": [], "fds": []}


def test_teardown_completes_with_no_file_descriptor_left(tmp_path: Path) -> None:
    # Workers whose grandchildren ignore SIGTERM; then every free fd is taken: /proc
    # cannot be listed and no pidfd opened while close() runs. The groups must not be
    # taken for empty: the grandchildren are SIGKILLed, everything is reaped.
    proc, took = supervise("teardown_without_fds", str(tmp_path), timeout=90)
    assert took < 90
    assert proc.returncode == 0, proc.stderr
    assert json_lines(proc.stderr) == [{"close": "closed", "children": [], "members": []}]


def test_teardown_of_workers_that_exited_with_no_file_descriptor_left(tmp_path: Path) -> None:
    # The workers return, leaving grandchildren that ignore SIGTERM in their groups; then
    # every free fd is taken. Teardown's quick end for a group that ended by itself needs
    # /proc to show the groups empty: unlisted, they must be signalled and emptied as ever.
    proc, took = supervise("teardown_without_fds", str(tmp_path), "exited", timeout=90)
    assert took < 90
    assert proc.returncode == 0, proc.stderr
    assert json_lines(proc.stderr) == [{"close": "closed", "children": [], "members": []}]


def test_a_process_whose_pidfd_cannot_be_opened_is_killed_and_reaped() -> None:
    # One fork worker: some limit leaves exactly the fds of its pipes and log files free,
    # so the fork succeeds and the pidfd of the new process fails with EMFILE.
    proc, took = supervise("nofile_sweep", "10", "30", "1", "fork", timeout=240)
    assert took < 240
    assert proc.returncode == 0, proc.stderr
    *runs, left = json_lines(proc.stderr)
    at_pidfd = [run for run in runs if run.get("in") == "pidfd_open"]
    assert at_pidfd, runs
    for run in at_pidfd:
        assert _ULIMIT_ERROR.fullmatch(run["error"]), run
    # The process existed; it was killed and reaped before the error was raised.
    assert left == {"children": [], "fds": []}


# -- the console's reader goes away ------------------------------------------------------


def _close_after_first_line(argv: list[str]) -> tuple[subprocess.Popen[bytes], bytes, str]:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    proc.wait(timeout=90)
    return proc, first, err


def test_console_pipe_closed_by_its_reader() -> None:
    start = time.monotonic()
    proc, first, err = _close_after_first_line(
        [sys.executable, "-m", "tests.children.faults", "tee_lines", "20000"]
    )
    assert time.monotonic() - start < 90
    assert first == b"[tee0]:line 0\n"
    (line,) = json_lines(err)
    assert line == {
        "exitcodes": {},
        "messages": {},
        "return_values": {"0": "20000"},
        "failed": False,
    }
    assert proc.returncode == 0, err


def test_console_pipe_closed_through_aioelastic_run() -> None:
    start = time.monotonic()
    proc, first, err = _close_after_first_line(
        [
            sys.executable,
            "-m",
            "aioelastic.run",
            "--nproc-per-node",
            "1",
            "--tee",
            "3",
            "--no-python",
            "sh",
            "-c",
            "i=0; while [ $i -lt 20000 ]; do echo line $i; i=$((i+1)); done",
        ]
    )
    assert time.monotonic() - start < 90
    assert first.endswith(b"line 0\n"), first
    assert proc.returncode == 0, err


# -- wait() racing close() -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_wait_that_loses_the_race_against_close_says_stopped(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        ctx = aioelastic.start_processes(
            "race", core.block_forever, {0: (str(fifo.path),), 1: (str(fifo.path),)}, envs(2)
        )
        results: list[aioelastic.RunProcsResult | None] = []
        start = time.monotonic()
        async with ctx:
            await fifo.lines(2)

            async def waiter() -> None:
                results.append(await ctx.wait())

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    await ctx.close(grace_period=5)
        assert time.monotonic() - start < 60
        (result,) = results
        assert result is not None
        assert result.stopped
        assert result.is_failed()
        assert result.failures == {}
        assert result.return_values == {}
    finally:
        fifo.close()


# -- a worker whose exit is never reported ------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_teardown_is_bounded_when_an_exit_is_never_reported(tmp_path: Path) -> None:
    import os

    from aioelastic._core.start._forkserver import fork_server

    # A private fork server (its own preload list), stopped with SIGSTOP: the workers die
    # of SIGKILL, but the server that must report their exits never does.
    preload = ("tests.children.faults",)
    fifo = ReadyFifo(tmp_path)
    server_pid = None
    try:
        ctx = aioelastic.start_processes(
            "unreported",
            core.block_forever,
            {0: (str(fifo.path), True)},
            envs(1),
            start_method="forkserver",
            forkserver_preload=preload,
            grace_period=0.5,
        )
        async with ctx:
            await fifo.lines(1)
            server_pid = fork_server(preload).pid
            assert server_pid is not None
            await close_with_reporter_stopped(ctx, server_pid, grace=0.5)
    finally:
        fifo.close()
        if server_pid is not None:
            os.kill(server_pid, signal.SIGCONT)
    # Continued, the server finds the release of the given-up worker and that worker's
    # exit in one batch of events, in either order, and serves on (it once died of it).
    again = await aioelastic.run_processes(
        "after",
        core.add,
        {0: (1, 2)},
        envs(1),
        start_method="forkserver",
        forkserver_preload=preload,
    )
    assert again.return_values == {0: 3}
    assert fork_server(preload).pid == server_pid
