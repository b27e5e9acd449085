"""Binary workers are started by the watchdog with ``posix_spawn``, never by a fork of us.

What that path must keep: the worker's own process group, default signal dispositions
and an empty mask, no descriptor but its stdio, its own argv and environment however many
start at once and however large, our current working directory and stdout, and exec
errors reported as such with nothing left behind. The watchdog's and the supervisor's
deaths: test_watchdog_deaths.py; how starts reach the watchdog: test_binary_batches.py.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

import aioelastic
from aioelastic._core.start._binary_start import MAX_BATCH, BinaryLauncher, BinaryStart
from aioelastic._core.start._watchdog import watchdog

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


#: glibc's posix_spawn leaves its two internal signals (32, 33) ignored in every child it
#: starts, whatever it is asked; a glibc program installs its own handlers for them.
_GLIBC_INTERNAL = (1 << 31) | (1 << 32)


def _status_fields(text: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@pytest.mark.parametrize("fresh_watchdog", ["pidfd", "waitid-thread"], indirect=True)
async def test_binary_worker_is_the_watchdogs_child_in_its_own_group_with_clean_signals(
    tmp_path: Path, fresh_watchdog: None
) -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        started = time.monotonic()
        result = await aioelastic.run_processes(
            "status",
            "/bin/cat",
            {0: ("/proc/self/status",)},
            {0: {}},
            redirects=aioelastic.Std.OUT,
            log_dir=tmp_path,
        )
        elapsed = time.monotonic() - started
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        signal.signal(signal.SIGHUP, previous)
    assert not result.is_failed()
    assert elapsed < 20
    fields = _status_fields(Path(result.stdouts[0]).read_text())
    assert int(fields["PPid"]) == watchdog.pid
    assert int(fields["SigBlk"], 16) == 0
    assert int(fields["SigIgn"], 16) & ~_GLIBC_INTERNAL == 0
    assert int(fields["SigCgt"], 16) == 0
    # Its own group: cat is the group leader (field 5 of /proc/self/stat is the pgrp).
    assert fields["Pid"] not in (str(os.getpid()), str(os.getpgrp()))


async def test_binary_worker_inherits_no_fd_but_its_stdio(tmp_path: Path) -> None:
    result = await aioelastic.run_processes(
        "fds",
        "/bin/ls",
        {rank: ("/proc/self/fd",) for rank in range(3)},
        {rank: {} for rank in range(3)},
        redirects=aioelastic.Std.OUT,
        log_dir=tmp_path,
    )
    assert not result.is_failed()
    for rank in range(3):
        # 0-2 are stdio; 3 is ls's own handle on the directory it lists.
        assert Path(result.stdouts[rank]).read_text().split() == ["0", "1", "2", "3"]


async def test_many_concurrent_starts_with_large_environments_each_get_their_own(
    tmp_path: Path,
) -> None:
    # Concurrent starts share messages to the watchdog, and environments this large travel
    # in a memfd: every worker must still get exactly its own argv and environment.
    n = 40
    started = time.monotonic()
    result = await aioelastic.run_processes(
        "big",
        "/bin/sh",
        {rank: ("-c", 'printf "%s %s" "$1" "${#BIG}"', "sh", str(rank)) for rank in range(n)},
        {rank: {"BIG": "x" * (70_000 + rank)} for rank in range(n)},
        redirects=aioelastic.Std.OUT,
        log_dir=tmp_path,
    )
    assert time.monotonic() - started < 40
    assert not result.is_failed()
    outputs = {rank: Path(path).read_text() for rank, path in result.stdouts.items()}
    assert outputs == {rank: f"{rank} {70_000 + rank}" for rank in range(n)}


async def test_binary_runs_in_our_current_directory_and_writes_to_our_current_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    watchdog.ensure_started()  # the watchdog's own directory and stdout are older
    monkeypatch.chdir(tmp_path)
    result = await aioelastic.run_processes("pwd", "pwd", {0: ()}, {0: {}})
    assert not result.is_failed()
    assert capfd.readouterr().out == f"{tmp_path}\n"


async def test_exec_failure_is_reported_with_its_errno_and_nothing_is_left(tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    launcher = BinaryLauncher(os.environ)
    try:
        started = time.monotonic()
        with pytest.raises(
            PermissionError, match=r"Permission denied.*starting '.*not-executable'"
        ):
            await launcher.start(BinaryStart([str(script)], {}, 1, err_w))
        assert time.monotonic() - started < 10
        with pytest.raises(FileNotFoundError, match=r"starting '/no/such/binary'"):
            await launcher.start(BinaryStart(["/no/such/binary"], {}, 1, err_w))
    finally:
        os.close(err_r)
        os.close(err_w)


async def test_a_group_larger_than_one_start_message_gets_each_rank_its_own_argv_and_env(
    tmp_path: Path,
) -> None:
    # More workers than one message to the watchdog holds: the starts travel in several
    # batches, each worker still with its own arguments over the shared environment.
    n = MAX_BATCH + 5
    result = await aioelastic.run_processes(
        "many",
        "/bin/sh",
        {
            rank: ("-c", 'printf "%s %s %s" "$1" "$RANK_VAR" "$HOME"', "sh", str(rank))
            for rank in range(n)
        },
        {rank: {"RANK_VAR": f"v{rank}"} for rank in range(n)},
        redirects=aioelastic.Std.OUT,
        log_dir=tmp_path,
    )
    assert not result.is_failed()
    outputs = {rank: Path(path).read_text() for rank, path in result.stdouts.items()}
    home = os.environ.get("HOME", "")
    assert outputs == {rank: f"{rank} v{rank} {home}" for rank in range(n)}


async def test_binary_without_the_stack_hook_gets_no_stack_fifo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    async with aioelastic.start_processes(
        "plain", "true", {0: (), 1: ()}, {0: {}, 1: {}}, log_dir=tmp_path / "logs"
    ) as ctx:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
        result = await ctx.wait()
    assert result is not None
    assert not result.is_failed()


async def test_a_group_whose_binary_cannot_be_executed_raises_its_errno_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    # Executable, so it passes validation, but its interpreter does not exist: every
    # start of the group fails in posix_spawn itself.
    script = tmp_path / "bad-interpreter"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    with pytest.raises(FileNotFoundError, match=r"starting '.*bad-interpreter'"):
        await aioelastic.run_processes(
            "bad",
            str(script),
            {r: () for r in range(3)},
            {r: {} for r in range(3)},
            log_dir=tmp_path / "logs",
        )
    # The watchdog is still of use: the next group starts.
    result = await aioelastic.run_processes("true", "true", {0: ()}, {0: {}})
    assert not result.is_failed()
