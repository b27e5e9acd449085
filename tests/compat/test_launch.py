"""aioelastic.launch: torch.distributed env, failures, and signals to the launching process.

Signals are never sent to the test runner: the SIGINT/SIGTERM tests run `launch` in a
child program (``python -m tests.children.spawn launch-until-signal``) and signal that.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import FrameType

import anyio
import anyio.to_thread
import pytest

from aioelastic._compat._launch import MainProcessError, WorkerError, free_port, launch
from aioelastic._core.reports._failures import ChildFailedError
from tests.children import spawn as children
from tests.support.paths import REPO
from tests.support.waits import is_running, make_fifo

pytestmark = pytest.mark.timeout(60)


@pytest.mark.asyncio
async def test_each_worker_gets_the_distributed_env_and_returns_by_rank() -> None:
    before = dict(os.environ)
    values = await launch(children.launch_env, {"lr": 0.1}, nprocs=3, master_port=29123)
    assert values == [
        {
            "args": {"lr": 0.1},
            "WORLD_SIZE": "3",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": "29123",
        }
        for rank in range(3)
    ]
    assert dict(os.environ) == before


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_master_port_0_gives_the_workers_a_free_port() -> None:
    values = await launch(children.launch_env, None, nprocs=2, master_port=0)
    ports = {int(v["MASTER_PORT"]) for v in values}
    assert len(ports) == 1
    assert 0 < ports.pop() < 65536


@pytest.mark.asyncio
async def test_the_parent_environment_is_untouched_while_workers_run(tmp_path: Path) -> None:
    ready, go = make_fifo(tmp_path, "ready"), make_fifo(tmp_path, "go")
    values: list[object] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            values.extend(
                await launch(
                    children.launch_env_when_told,
                    (str(ready), str(go)),
                    nprocs=1,
                    master_addr="127.0.0.1",
                )
            )

        tg.start_soon(run)
        with anyio.fail_after(30):
            assert await anyio.to_thread.run_sync(ready.read_text) == "ready\n"
        # The worker is running now: a set-then-restore launcher would show it here.
        assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)
        await anyio.to_thread.run_sync(go.write_text, "go\n")
    (env,) = values
    assert isinstance(env, dict)
    assert env["RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert int(env["MASTER_PORT"]) > 0  # picked by free_port()


@pytest.mark.asyncio
async def test_a_failing_worker_raises_worker_error_after_stopping_the_others() -> None:
    with pytest.raises(WorkerError) as info:
        await launch(children.launch_exit_at, (1, 3), nprocs=3, grace_period=5)
    err = info.value
    assert (err.exitcode, err.worker_id) == (3, 1)
    assert str(err) == "worker[1] failed with exitcode=3"
    assert isinstance(err.__cause__, ChildFailedError)
    assert set(err.__cause__.failures) == {1}  # the stopped siblings are not failures


@pytest.mark.asyncio
async def test_previous_handlers_are_back_after_launch() -> None:
    def custom(signum: int, frame: FrameType | None) -> None:
        pass

    before_int = signal.getsignal(signal.SIGINT)
    before_term = signal.signal(signal.SIGTERM, custom)
    try:
        await launch(children.launch_env, None, nprocs=1)
        assert signal.getsignal(signal.SIGINT) is before_int
        assert signal.getsignal(signal.SIGTERM) is custom
        with pytest.raises(WorkerError):
            await launch(children.launch_exit_at, (0, 1), nprocs=1)
        assert signal.getsignal(signal.SIGINT) is before_int
        assert signal.getsignal(signal.SIGTERM) is custom
    finally:
        signal.signal(signal.SIGTERM, before_term)


@pytest.mark.asyncio
async def test_cancelling_launch_stops_its_workers(tmp_path: Path) -> None:
    # The leak check of tests/conftest.py fails this test if a worker survives.
    ready, go = make_fifo(tmp_path, "ready"), make_fifo(tmp_path, "go")
    before = signal.getsignal(signal.SIGINT)
    async with anyio.create_task_group() as tg:
        tg.start_soon(launch, children.launch_env_when_told, (str(ready), str(go)), 1)
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(ready.read_text)
        tg.cancel_scope.cancel()
    assert signal.getsignal(signal.SIGINT) is before


def test_off_the_main_thread_launch_warns_once_and_still_works() -> None:
    outcome: dict[str, object] = {}

    def run() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome["values"] = asyncio.run(launch(children.launch_env, 7, nprocs=2))
        outcome["warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
        ]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(50)
    assert not thread.is_alive()
    values = outcome["values"]
    assert isinstance(values, list)
    assert [v["RANK"] for v in values] == ["0", "1"]
    caught = outcome["warnings"]
    assert isinstance(caught, list)
    assert len(caught) == 1
    assert "SIGINT, SIGTERM stay with the host program" in caught[0]


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("localhost", port))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"func": "not callable"}, TypeError, "func must be callable"),
        ({"nprocs": 0}, ValueError, "nprocs"),
        ({"master_addr": ""}, ValueError, "master_addr"),
        ({"nprocs": True}, TypeError, "nprocs: True is a bool"),
        ({"master_port": 70000}, ValueError, "master_port: 70000 is not a port number 0..65535"),
        ({"master_port": "x"}, ValueError, "master_port: 'x' is not a port number"),
    ],
)
async def test_misuse_is_refused_before_anything_starts(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    call: dict[str, object] = {"func": children.launch_env, "args": None, "nprocs": 1, **kwargs}
    with pytest.raises(error, match=match):
        await launch(**call)  # type: ignore[arg-type]


def test_main_process_error_names_the_signal() -> None:
    err = MainProcessError(signal.SIGTERM)
    assert err.signal_no == signal.SIGTERM
    assert str(err) == "SIGTERM received, exiting due to Terminated."
    import pickle

    assert pickle.loads(pickle.dumps(err)).signal_no == signal.SIGTERM
    assert pickle.loads(pickle.dumps(WorkerError(3, 1))).worker_id == 1


# --- signals to a process running launch ---------------------------------------------------


class Program:
    """A child program whose stdout lines are read with a timeout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.children.spawn", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(remaining, 0))
            except queue.Empty:
                raise AssertionError(
                    f"no line {prefix!r} in {timeout} s; got {self.seen}"
                ) from None
            if line is None:
                raise AssertionError(f"program ended before {prefix!r}; got {self.seen}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        while (line := self.lines.get_nowait()) is not None:
            self.seen.append(line)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _pids(directory: Path) -> list[int]:
    return [int(p) for f in directory.glob("*.pid") for p in f.read_text().split()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_parent_stops_every_worker_and_names_the_signal(
    sig: signal.Signals, tmp_path: Path
) -> None:
    program = Program("launch-until-signal", str(tmp_path))
    try:
        program.expect("ready")
        program.expect("ready")
        program.proc.send_signal(sig)
        code = program.finish()
    finally:
        program.kill()
    out = "\n".join(program.seen)
    assert code == 128 + sig, out
    assert f"MainProcessError signal_no={int(sig)}: {sig.name} received" in out
    # Checked by the program itself while still alive: the teardown stopped them, not
    # the parent-death signal that would follow its exit.
    assert "checked 4 pids, alive: []" in out  # 2 workers and their `sleep` children
    assert "SIGINT restored in loop: True" in out
    assert "SIGTERM restored: True" in out
    assert "SIGINT after launch: KeyboardInterrupt" in out
    pids = _pids(tmp_path)
    assert len(pids) == 4
    assert not [pid for pid in pids if is_running(pid)]


def test_a_second_sigint_while_stopping_kills_at_once(tmp_path: Path) -> None:
    # The workers ignore SIGTERM and the grace period is 10 minutes: only the escalation
    # can make this program finish within the test's timeout.
    program = Program("launch-until-signal", str(tmp_path), "--stubborn", "--grace", "600")
    try:
        program.expect("ready")
        program.expect("ready")
        program.proc.send_signal(signal.SIGINT)
        program.expect("sigterm")  # the first SIGINT started the graceful stop
        escalated = time.monotonic()
        program.proc.send_signal(signal.SIGINT)
        code = program.finish(timeout=50)
        elapsed = time.monotonic() - escalated
    finally:
        program.kill()
    out = "\n".join(program.seen)
    assert code == 128 + signal.SIGINT, out
    assert "MainProcessError signal_no=2: SIGINT received" in out
    assert "checked 4 pids, alive: []" in out
    assert "SIGINT after launch: KeyboardInterrupt" in out
    assert elapsed < 50


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.asyncio
async def test_torch_gloo_all_reduce_on_four_workers() -> None:
    pytest.importorskip("torch")
    world_size = 4
    values = await launch(
        children.torch_launch_all_reduce, None, nprocs=world_size, master_addr="127.0.0.1"
    )
    assert values == [float(sum(range(1, world_size + 1)))] * world_size
