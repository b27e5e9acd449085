"""Stacks on demand from real hung processes: the faulthandler hook and its FIFO."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.abc
import pytest

import aioelastic
from aioelastic._core.child._stack_hook import STACK_SIGNAL, STACKS_FIFO_ENV, script_argv
from aioelastic._core.hangs._stacks import StackChannel, StackChannels, _still_dumping
from tests.children import hangs
from tests.support.paths import CHILDREN
from tests.support.waits import ReadyFifo, is_running, started_in_own_session

pytestmark = pytest.mark.timeout(60)

HANGS = str(CHILDREN / "hangs.py")
FIDELITY = str(CHILDREN / "main_fidelity.py")


@pytest.mark.parametrize(
    ("how", "names"),
    [
        ("sleep", ["stuck_in_sleep"]),
        ("event", ["stuck_in_event_wait"]),
        ("read", ["stuck_in_blocking_read"]),
        ("thread", ["stuck_in_helper_thread", "helper_thread_stuck_here"]),
    ],
)
@pytest.mark.asyncio
async def test_script_we_did_not_write_gives_every_thread_stack(
    tmp_path: Path, how: str, names: list[str]
) -> None:
    ready = ReadyFifo(tmp_path)
    channel = StackChannel(tmp_path / "stacks.fifo")
    channel.open()
    try:
        argv = script_argv(sys.executable, HANGS, [str(ready.path), how])
        async with started_in_own_session(argv, channel.env()) as proc:
            await ready.lines(1)
            begin = time.monotonic()
            text = await channel.capture(proc.pid, timeout=30)
            elapsed = time.monotonic() - begin
            assert text is not None
            for name in names:
                assert f"in {name}" in text, text
            assert "most recent call first" in text
            assert elapsed < 15
            # Asked twice: a second dump is a fresh one, and the worker keeps running.
            again = await channel.capture(proc.pid, timeout=10)
            assert again is not None
            assert again.count("Current thread") == 1
            assert is_running(proc.pid)
    finally:
        channel.close()
        ready.close()
    assert not (tmp_path / "stacks.fifo").exists()


@pytest.mark.asyncio
async def test_process_without_the_hook_is_unharmed_and_capture_is_bounded(
    tmp_path: Path,
) -> None:
    # SIGURG's default action is "ignore": a binary that never registered the handler
    # survives being asked, and the capture gives up at its timeout.
    ready = ReadyFifo(tmp_path)
    channel = StackChannel(tmp_path / "stacks.fifo")
    channel.open()
    try:
        argv = ["sh", "-c", f'echo ready > "{ready.path}"; exec sleep 3600']
        async with started_in_own_session(argv, channel.env()) as proc:
            await ready.lines(1)
            begin = time.monotonic()
            assert await channel.capture(proc.pid, timeout=0.5) is None
            assert 0.5 <= time.monotonic() - begin < 10
            assert is_running(proc.pid)
    finally:
        channel.close()
        ready.close()


@pytest.mark.asyncio
async def test_exited_process_gives_none_at_once(tmp_path: Path) -> None:
    channel = StackChannel(tmp_path / "stacks.fifo")
    channel.open()
    try:
        async with started_in_own_session(["true"], channel.env()) as proc:
            await proc.wait()
        begin = time.monotonic()
        assert await channel.capture(proc.pid, timeout=30) is None
        assert time.monotonic() - begin < 10
    finally:
        channel.close()


@pytest.mark.asyncio
async def test_many_workers_at_once_and_the_silent_one_says_why(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    channels = StackChannels(range(3))
    channels.open()
    try:
        async with (
            started_in_own_session(
                script_argv(sys.executable, HANGS, [str(ready.path), "sleep"]),
                channels.channels[0].env(),
            ) as p0,
            started_in_own_session(
                script_argv(sys.executable, HANGS, [str(ready.path), "event"]),
                channels.channels[1].env(),
            ) as p1,
            started_in_own_session(
                ["sh", "-c", f'echo ready > "{ready.path}"; exec sleep 3600'],
                channels.channels[2].env(),
            ) as p2,
        ):
            await ready.lines(3)
            begin = time.monotonic()
            stacks = await channels.capture({0: p0.pid, 1: p1.pid, 2: p2.pid}, timeout=3)
            assert time.monotonic() - begin < 8
    finally:
        channels.close()
        ready.close()
    assert "in stuck_in_sleep" in stacks[0]
    assert "in stuck_in_event_wait" in stacks[1]
    assert stacks[2] == (
        f"(no Python stack: pid {p2.pid} did not answer SIGURG within 3s; it is not a "
        "Python process started by aioelastic, it replaced the handler, or it exited)\n"
    )


@pytest.mark.asyncio
async def test_hook_removes_its_variable_and_ignores_a_regular_file(tmp_path: Path) -> None:
    # A regular file where the FIFO should be: the hook declines, the script runs anyway.
    bogus = tmp_path / "not-a-fifo"
    bogus.write_text("")
    code = (
        "import os, signal, faulthandler\n"
        "from aioelastic._core.child._stack_hook import install_from_env, STACKS_FIFO_ENV\n"
        "print(install_from_env(), STACKS_FIFO_ENV in os.environ)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, STACKS_FIFO_ENV: str(bogus)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout == "False False\n"
    assert bogus.read_text() == ""


def test_script_runs_as_python_would_run_it(tmp_path: Path) -> None:
    """``__main__``, ``sys.argv``, ``sys.path[0]`` and ``__file__`` as with ``python x.py``."""
    relative = os.path.relpath(FIDELITY)
    plain = subprocess.run(
        [sys.executable, relative, "a", "--b"], capture_output=True, text=True, timeout=30
    )
    ours = subprocess.run(
        script_argv(sys.executable, relative, ["a", "--b"]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ours.returncode == plain.returncode == 0, ours.stderr
    assert json.loads(ours.stdout) == json.loads(plain.stdout)
    assert json.loads(ours.stdout)["argv"] == [relative, "a", "--b"]


def test_module_runs_as_python_m_would_run_it(tmp_path: Path) -> None:
    plain = subprocess.run(
        [sys.executable, "-m", "json.tool", "--compact"],
        input='{"a": [1, 2]}',
        capture_output=True,
        text=True,
        timeout=30,
    )
    ours = subprocess.run(
        script_argv(sys.executable, "json.tool", ["--compact"], module=True),
        input='{"a": [1, 2]}',
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ours.stdout == plain.stdout == '{"a":[1,2]}\n'


def test_exit_status_of_a_failing_script_is_unchanged(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys\nraise SystemExit(7)\n")
    crash = tmp_path / "crash.py"
    crash.write_text("raise KeyError('boom')\n")
    assert subprocess.run(script_argv(sys.executable, str(script), []), timeout=30).returncode == 7
    out = subprocess.run(
        script_argv(sys.executable, str(crash), []), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1
    assert out.stderr.rstrip().endswith("KeyError: 'boom'")


def test_stack_signal_is_ignored_by_default() -> None:
    # The property the choice of signal rests on.
    assert STACK_SIGNAL == signal.SIGURG
    assert signal.getsignal(STACK_SIGNAL) == signal.SIG_DFL
    assert STACK_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


# -- through the group: ctx.dump_stacks() --------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
async def test_dump_stacks_of_running_function_workers(tmp_path: Path, method: str) -> None:
    ready = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "stuck",
            hangs.stuck,
            {0: (str(ready.path), "event"), 1: (str(ready.path), "read")},
            {0: {}, 1: {}},
            start_method=method,
            grace_period=5,
        ) as ctx:
            await ready.lines(2)
            begin = time.monotonic()
            stacks = await ctx.dump_stacks(timeout=30)
            assert time.monotonic() - begin < 15
            assert set(stacks) == {0, 1}
            assert "in stuck_in_event_wait" in stacks[0]
            assert "in stuck_in_blocking_read" in stacks[1]
            # Not stopped: still running, and nothing reported yet.
            assert await ctx.wait(timeout=0) is None
            assert all(is_running(pid) for pid in ctx.pids().values())
    finally:
        ready.close()


@pytest.mark.asyncio
async def test_dump_stacks_of_a_script_worker_and_of_an_exited_one(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    argv = script_argv(sys.executable, HANGS, [str(ready.path), "sleep"])
    try:
        async with aioelastic.start_processes(
            "script",
            argv[0],
            {0: tuple(argv[1:]), 1: ("-c", "pass")},
            {0: {}, 1: {}},
            grace_period=5,
        ) as ctx:
            await ready.lines(1)
            # Rank 1 exits at once; a finished worker is not running, so not asked.
            with anyio.fail_after(30):
                # The context keeps its workers in the order they started, not by rank.
                rank1 = next(w for w in ctx._workers if w.local_rank == 1)
                await rank1.exited.wait()
            stacks = await ctx.dump_stacks(timeout=10)
            assert list(stacks) == [0]
            assert "in stuck_in_sleep" in stacks[0]
            assert "<module>" in stacks[0]
    finally:
        ready.close()


# -- at the terminal: kill -URG <launcher> --------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_sigurg_to_the_launcher_prints_every_workers_stack(tmp_path: Path) -> None:
    barrier = str(CHILDREN / "barrier.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    argv = [sys.executable, "-m", "aioelastic.run", "--nproc-per-node", "2", barrier]
    async with await anyio.open_process(argv, env=env) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        out, err = b"", b""
        try:
            with anyio.fail_after(60):
                while out.count(b" step 1\n") < 2:
                    out += await proc.stdout.receive()
            names = (b"in other_rank_waits", b"in wait_for_peers")
            with anyio.fail_after(60):
                # "step 1" is printed just before the workers block: a first answer may
                # still show one at its print. Each request gets a full answer; ask again.
                while not all(name in err for name in names):
                    os.kill(proc.pid, signal.SIGURG)
                    with anyio.move_on_after(5):
                        while not all(name in err for name in names):
                            err += await proc.stderr.receive()
            # Nothing was stopped: the launcher and its workers run on.
            assert proc.returncode is None
        finally:
            proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                await proc.wait()
    text = err.decode()
    assert "--- stack of local rank 0 ---" in text
    assert "in other_rank_waits_in_sleep" in text
    assert "in wait_for_peers_in_barrier" in text
    assert proc.returncode == 128 + signal.SIGTERM


@pytest.mark.asyncio
async def test_forked_workers_do_not_keep_the_supervisors_fifos(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    ready = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "forked",
            hangs.stuck,
            {0: (str(ready.path), "sleep"), 1: (str(ready.path), "sleep")},
            {0: {}, 1: {}},
            start_method="fork",
            grace_period=5,
        ) as ctx:
            await ready.lines(2)
            for pid in ctx.pids().values():
                targets = []
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    try:
                        targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                    except OSError:
                        continue
                # Only its own stacks FIFO (write end, from the hook) is left.
                fifos = [
                    t for t in targets if "aioelastic_stacks_" in t or "aioelastic_timer_" in t
                ]
                assert len(fifos) == 1, targets
    finally:
        ready.close()


@pytest.mark.asyncio
async def test_a_plain_binary_keeps_torchruns_environment_and_answers_at_once(
    tmp_path: Path,
) -> None:
    ready = ReadyFifo(tmp_path)
    script = f'env > "{tmp_path}/env.txt"; echo ready > "{ready.path}"; exec sleep 3600'
    try:
        async with aioelastic.start_processes(
            "binary", "sh", {0: ("-c", script)}, {0: {}}, grace_period=5
        ) as ctx:
            await ready.lines(1)
            begin = time.monotonic()
            stacks = await ctx.dump_stacks(timeout=30)
            assert time.monotonic() - begin < 10
    finally:
        ready.close()
    assert stacks == {
        0: "(no Python stack: local rank 0 runs a binary without aioelastic's stack hook, "
        "and py-spy is not installed or may not trace it; see docs/hangs.md)\n"
    }
    assert STACKS_FIFO_ENV not in (tmp_path / "env.txt").read_text()


@pytest.mark.asyncio
async def test_a_python_binary_without_the_hook_is_read_by_py_spy(tmp_path: Path) -> None:
    if shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (it is in the dev extra)")
    ready = ReadyFifo(tmp_path)
    code = (
        "import time\n"
        "def waiting_for_a_peer_without_a_hook():\n"
        f"    open({str(ready.path)!r}, 'w').write('ready\\n')\n"
        "    time.sleep(3600)\n"
        "waiting_for_a_peer_without_a_hook()\n"
    )
    try:
        async with aioelastic.start_processes(
            "nohook", sys.executable, {0: ("-c", code)}, {0: {}}, grace_period=5
        ) as ctx:
            await ready.lines(1)
            begin = time.monotonic()
            stacks = await ctx.dump_stacks(timeout=30)
            assert time.monotonic() - begin < 10
            assert ctx.pids()[0] > 0
    finally:
        ready.close()
    assert "waiting_for_a_peer_without_a_hook" in stacks[0]


def test_a_dump_in_progress_is_seen_in_the_kernels_signal_masks() -> None:
    # While a thread runs the handler the signal is in its blocked mask: the capture then
    # waits for the rest of the dump instead of cutting it at a quiet moment.
    assert not _still_dumping(os.getpid())
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL})
    try:
        assert _still_dumping(os.getpid())
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACK_SIGNAL})
    assert not _still_dumping(os.getpid())
    assert not _still_dumping(2**22 + 12345)  # no such process


def test_a_binary_runs_the_hook_by_its_public_name_or_the_old_private_one() -> None:
    from aioelastic._core.group._start_methods import runs_stack_hook

    assert script_argv("python", "train.py", ["--lr", "1"])[1:4] == [
        "-u",
        "-m",
        "aioelastic.stack_hook",
    ]
    assert runs_stack_hook(("-u", "-m", "aioelastic.stack_hook", "train.py"))
    assert runs_stack_hook(("-m", "aioelastic._core._stack_hook", "train.py"))
    assert not runs_stack_hook(("-c", "aioelastic.stack_hook"))


#: The hook's module path before ``_core`` had rooms: earlier docs told users to run it.
OLD_HOOK = "aioelastic._core._stack_hook"


def test_the_old_private_path_runs_a_script_as_the_public_one_does(tmp_path: Path) -> None:
    relative = os.path.relpath(FIDELITY)
    runs = [
        subprocess.run(
            [sys.executable, "-u", "-m", module, relative, "a", "--b"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        for module in ("aioelastic.stack_hook", OLD_HOOK)
    ]
    assert [run.returncode for run in runs] == [0, 0], runs[1].stderr
    assert runs[1].stderr == ""
    assert json.loads(runs[1].stdout) == json.loads(runs[0].stdout)
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    failing = subprocess.run([sys.executable, "-m", OLD_HOOK, str(script)], timeout=30)
    assert failing.returncode == 3


@pytest.mark.asyncio
async def test_the_old_private_path_answers_for_stacks(tmp_path: Path) -> None:
    ready = ReadyFifo(tmp_path)
    channel = StackChannel(tmp_path / "stacks.fifo")
    channel.open()
    try:
        argv = [sys.executable, "-u", "-m", OLD_HOOK, HANGS, str(ready.path), "sleep"]
        async with started_in_own_session(argv, channel.env()) as proc:
            await ready.lines(1)
            text = await channel.capture(proc.pid, timeout=30)
            assert text is not None
            assert "in stuck_in_sleep" in text
            # The wrapper's frames, the old path's included, are not the user's.
            assert "_stack_hook" not in text
            assert "runpy" not in text
    finally:
        channel.close()
        ready.close()
