"""The elastic agent, for real: workers, restarts, signals, and agents on several "nodes".

Single-node tests run the agent in this process. Multi-node tests run each agent as its own
process (``python -m tests.children.agent agent``), c10d on 127.0.0.1, whose workers use
gloo.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

torch_distributed = pytest.importorskip("torch.distributed")

from aioelastic._core.aio._signals import SignalReceived  # noqa: E402
from aioelastic._core.reports._failures import ChildFailedError  # noqa: E402
from aioelastic._core.start import _forkserver  # noqa: E402
from aioelastic._elastic.agent._agent import LocalElasticAgent  # noqa: E402
from aioelastic._elastic.agent._types import RestartBackoff, RunResult, WorkerSpec, WorkerState  # noqa: E402
from aioelastic._elastic.launch._elastic_launch import LaunchConfig, elastic_launch  # noqa: E402
from aioelastic._elastic.observe._events import (  # noqa: E402
    AgentEvent,
    FailureReason,
    GroupRestarting,
    GroupStopping,
    RendezvousCompleted,
    RunFailed,
    StopReason,
    WorkerFailed,
    WorkersStarted,
)
from tests.children import agent as children  # noqa: E402
from tests.support.waits import wait_gone  # noqa: E402

pytestmark = pytest.mark.torch

#: Start method for function workers that need no warm server.
FUNCTION_START = "spawn"


@pytest.fixture(scope="module", autouse=True)
def _torch_store_warmed() -> None:
    """torch opens a process-wide pipe with the first TCPStore and keeps it for good.

    Create it before any test's file-descriptor snapshot, so the leak check sees only what
    a test itself leaves open.
    """
    store = torch_distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    del store


@pytest.fixture(autouse=True)
def _collect_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A clean environment for the agent; free dropped TCPStores before the leak check."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    yield
    gc.collect()


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run_collecting(
    agent: LocalElasticAgent,
    during: Callable[[list[AgentEvent]], Awaitable[None]] | None = None,
) -> tuple[RunResult, list[AgentEvent]]:
    """Run the agent while collecting its events (and running ``during`` alongside).

    An exception from ``agent.run()`` is re-raised as is, after every event was collected.
    """
    events: list[AgentEvent] = []
    stream = agent.events()
    error: Exception | None = None

    async def collect() -> None:
        async for event in stream:
            events.append(event)

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect)
        async with anyio.create_task_group() as side:
            if during is not None:
                side.start_soon(during, events)
            try:
                result = await agent.run()
            except Exception as e:
                error = e
            side.cancel_scope.cancel()
    if error is not None:
        raise error
    return result, events


def kinds(events: list[AgentEvent]) -> list[str]:
    return [e.kind for e in events]


def seen_files(out_dir: Path, tag: str = "seen") -> dict[tuple[int, int], dict[str, Any]]:
    """``{(restart, rank): data}`` of what workers recorded."""
    found = {}
    for path in out_dir.glob(f"{tag}-*-*.json"):
        _, restart, rank = path.stem.rsplit("-", 2)
        found[(int(restart), int(rank))] = json.loads(path.read_text())
    return found


class ReadyChannel:
    """A Unix socket workers connect to when they are running user code."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="aioe-agent-")
        self.address = os.path.join(self._dir, "ready.sock")
        self._listener: anyio.abc.SocketListener | None = None

    async def __aenter__(self) -> ReadyChannel:
        self._listener = await anyio.create_unix_listener(self.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._listener is not None
        await self._listener.aclose()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def wait(self, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        """The messages of the next ``count`` workers to say they are ready."""
        assert self._listener is not None
        messages = []
        with anyio.fail_after(timeout):
            for _ in range(count):
                async with await self._listener.accept() as stream:
                    data = b""
                    while not data.endswith(b"\n"):
                        data += await stream.receive()
                messages.append(json.loads(data))
        return messages


# -- one node --------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_four_function_workers_run_with_torchruns_ranks(out_dir: Path) -> None:
    spec = WorkerSpec(
        role="trainer", local_world_size=4, entrypoint=children.report, args=(str(out_dir),)
    )
    agent = LocalElasticAgent(spec, start_method=FUNCTION_START)
    result, events = await run_collecting(agent)

    assert result.state is WorkerState.SUCCEEDED
    assert not result.is_failed()
    assert sorted(result.return_values) == [0, 1, 2, 3]
    assert agent.log_dir is not None
    run_ids = set()
    for rank, seen in result.return_values.items():
        assert seen["RANK"] == seen["ROLE_RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["ROLE_WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "4"
        assert (seen["GROUP_RANK"], seen["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert seen["ROLE_NAME"] == "trainer"
        assert seen["TORCHELASTIC_RESTART_COUNT"] == seen["TORCHELASTIC_MAX_RESTARTS"] == "0"
        # One node: no agent store (and no torch in the agent); worker 0 hosts the store.
        assert seen["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert seen["OMP_NUM_THREADS"] == "1"
        assert seen["TORCHELASTIC_ERROR_FILE"] == str(
            agent.log_dir / "attempt_0" / str(rank) / "error.json"
        )
        run_ids.add(seen["TORCHELASTIC_RUN_ID"])
    assert len(run_ids) == 1

    assert kinds(events) == ["rendezvous_completed", "workers_started", "run_succeeded"]
    assert all(e.run_id in run_ids for e in events)
    assert [e.timestamp for e in events] == sorted(e.timestamp for e in events)
    started = events[1]
    assert isinstance(started, WorkersStarted)
    assert dict(started.pids) == {r: v["pid"] for r, v in result.return_values.items()}
    group = agent.get_worker_group()
    assert group.state is WorkerState.SUCCEEDED
    assert [w.global_rank for w in group.workers] == [0, 1, 2, 3]
    assert all(w.id is None for w in group.workers)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_four_binary_workers_on_a_static_rendezvous(out_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    spec = WorkerSpec(
        local_world_size=4,
        entrypoint=sys.executable,
        args=("-m", "tests.children.agent", "env", str(out_dir), "tag${local_rank}"),
        master_port=port,
    )
    agent = LocalElasticAgent(spec, log_dir=tmp_path / "logs")
    result = await agent.run()

    assert result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: None, 1: None, 2: None, 3: None}
    for rank in range(4):
        env = json.loads((out_dir / f"{rank}-tag{rank}.json").read_text())
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["ROLE_NAME"] == "default"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert env["TORCHELASTIC_RUN_ID"] == "none"  # torchrun's --rdzv-id default
        assert env["TORCHELASTIC_ERROR_FILE"].startswith(str(tmp_path / "logs" / "attempt_0"))
    assert agent.log_dir == tmp_path / "logs"


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_restarts_count_up_and_reuse_the_warm_fork_server(
    out_dir: Path, tmp_path: Path
) -> None:
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=children.fail_until,
        args=(str(out_dir), 2, 1, 3),  # local rank 1 exits 3 on restarts 0 and 1
        max_restarts=3,
    )
    agent = LocalElasticAgent(
        spec,
        start_method="forkserver",
        log_dir=tmp_path / "logs",
        forkserver_preload=("tests.children.agent",),
    )
    result, events = await run_collecting(agent)

    assert result.state is WorkerState.SUCCEEDED
    assert sorted(result.return_values) == [0, 1]
    seen = seen_files(out_dir)
    # Rank 0 may be stopped before it records anything in a failed attempt.
    assert {(0, 1), (1, 1), (2, 0), (2, 1)} <= set(seen)
    for (restart, rank), env in seen.items():
        assert env["TORCHELASTIC_RESTART_COUNT"] == str(restart)
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["RANK"] == str(rank)
    assert len({env["TORCHELASTIC_RUN_ID"] for env in seen.values()}) == 1
    # Every attempt forked from the same warm server: a restart costs a fork.
    parents = {env["ppid"] for env in seen.values()}
    assert len(parents) == 1
    assert parents <= set(_forkserver.running_server_pids())

    failed = [e for e in events if isinstance(e, WorkerFailed)]
    assert [(e.attempt, e.global_rank, e.local_rank, e.exitcode, e.signal) for e in failed] == [
        (0, 1, 1, 3, None),
        (1, 1, 1, 3, None),
    ]
    restarting = [e for e in events if isinstance(e, GroupRestarting)]
    assert [(e.attempt, e.restart_count, e.reason, e.restarts_left) for e in restarting] == [
        (1, 1, StopReason.WORKER_FAILED, 2),
        (2, 2, StopReason.WORKER_FAILED, 1),
    ]
    assert kinds(events)[-1] == "run_succeeded"
    assert events[-1].restart_count == 2
    # No attempt's logs are ever removed.
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "attempt_0",
        "attempt_1",
        "attempt_2",
    ]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_past_max_restarts_the_run_fails_with_failures_by_global_rank(
    out_dir: Path, tmp_path: Path
) -> None:
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=children.fail_until,
        args=(str(out_dir), 99, 0, 3),
        max_restarts=2,
    )
    agent = LocalElasticAgent(spec, start_method=FUNCTION_START, log_dir=tmp_path / "logs")
    result, events = await run_collecting(agent)

    assert result.is_failed()
    assert result.state is WorkerState.FAILED
    assert agent.get_worker_group().state is WorkerState.FAILED
    assert list(result.failures) == [0]
    assert result.failures[0].exitcode == 3
    assert result.return_values == {}
    assert kinds(events).count("workers_started") == 3
    assert kinds(events).count("group_restarting") == 2
    last = events[-1]
    assert isinstance(last, RunFailed)
    assert last.reason is FailureReason.RESTARTS_EXHAUSTED
    assert list(last.failures) == [0]
    assert len(list((tmp_path / "logs").iterdir())) == 3


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_exit_code_marked_no_retry_fails_at_once(out_dir: Path, tmp_path: Path) -> None:
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=children.fail_until,
        args=(str(out_dir), 99, 1, 2),
        max_restarts=5,
        no_retry_exit_codes={2, -9},
    )
    agent = LocalElasticAgent(spec, start_method=FUNCTION_START, log_dir=tmp_path / "logs")
    result, events = await run_collecting(agent)

    assert result.is_failed()
    assert list(result.failures) == [1]
    assert result.failures[1].exitcode == 2
    assert kinds(events) == [
        "rendezvous_completed",
        "workers_started",
        "worker_failed",
        "group_stopping",
        "run_failed",
    ]
    last = events[-1]
    assert isinstance(last, RunFailed)
    assert last.reason is FailureReason.NO_RETRY_EXIT_CODE
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["attempt_0"]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_backoff_waits_between_failure_restarts(out_dir: Path) -> None:
    spec = WorkerSpec(
        local_world_size=1,
        entrypoint=children.fail_until,
        args=(str(out_dir), 2, 0, 3),
        max_restarts=2,
        restart_backoff=RestartBackoff(initial=0.3, maximum=5.0, multiplier=3.0, jitter=0.0),
    )
    agent = LocalElasticAgent(spec, start_method=FUNCTION_START)
    result, events = await run_collecting(agent)

    assert not result.is_failed()
    restarting = [e for e in events if isinstance(e, GroupRestarting)]
    assert [e.delay for e in restarting] == pytest.approx([0.3, 0.9])
    for event in restarting:
        rejoined = next(
            e for e in events if isinstance(e, RendezvousCompleted) and e.attempt == event.attempt
        )
        assert rejoined.timestamp - event.timestamp >= event.delay - 0.01


def test_backoff_delays_grow_cap_and_jitter() -> None:
    exact = RestartBackoff(initial=1.0, maximum=10.0, multiplier=2.0, jitter=0.0)
    assert [exact.delay(k) for k in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert exact.delay(100_000) == 10.0  # no overflow, just the cap
    full = RestartBackoff(initial=4.0, maximum=4.0, jitter=1.0)
    rng = random.Random(7)
    samples = [full.delay(1, rng) for _ in range(200)]
    assert all(0.0 <= s <= 4.0 for s in samples)
    assert max(samples) - min(samples) > 2.0
    half = RestartBackoff(initial=2.0, maximum=2.0, jitter=0.5)
    assert all(1.0 <= half.delay(3, rng) <= 2.0 for _ in range(100))
    with pytest.raises(ValueError, match="jitter"):
        RestartBackoff(jitter=1.5)
    with pytest.raises(ValueError, match="multiplier"):
        RestartBackoff(multiplier=0.5)
    with pytest.raises(ValueError, match="maximum"):
        RestartBackoff(initial=5.0, maximum=1.0)
    # The command line's duration parser: text is read as seconds, other types refused.
    assert RestartBackoff(initial="1").initial == 1.0  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initial"):
        RestartBackoff(initial=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="counts from 1"):
        exact.delay(0)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_sigterm_stops_the_workers_and_ends_with_128_plus_n() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    async with ReadyChannel() as ready:
        spec = WorkerSpec(local_world_size=2, entrypoint=children.hold, args=(ready.address,))
        agent = LocalElasticAgent(spec, start_method=FUNCTION_START)

        async def signal_when_ready(events: list[AgentEvent]) -> None:
            await ready.wait(2)
            os.kill(os.getpid(), signal.SIGTERM)

        with pytest.raises(SignalReceived) as caught:
            await run_collecting(agent, signal_when_ready)
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous
    assert agent.get_worker_group().state is WorkerState.STOPPED


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_second_signal_kills_workers_that_ignore_sigterm_at_once() -> None:
    async with ReadyChannel() as ready:
        spec = WorkerSpec(local_world_size=2, entrypoint=children.hold, args=(ready.address, True))
        agent = LocalElasticAgent(spec, start_method=FUNCTION_START, shutdown_timeout=120)
        watch = agent.events()

        async def signal_twice(events: list[AgentEvent]) -> None:
            await ready.wait(2)
            os.kill(os.getpid(), signal.SIGINT)
            async for event in watch:
                if isinstance(event, GroupStopping):
                    assert (event.reason, event.detail) == (StopReason.SIGNAL, "SIGINT")
                    break
            await watch.aclose()
            os.kill(os.getpid(), signal.SIGINT)

        started = time.monotonic()
        with pytest.raises(SignalReceived) as caught:
            await run_collecting(agent, signal_twice)
    # Far less than the 120 s grace period: the second signal skipped it.
    assert time.monotonic() - started < 60
    assert caught.value.exit_code == 128 + signal.SIGINT


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_cancelling_run_stops_the_workers() -> None:
    async with ReadyChannel() as ready:
        spec = WorkerSpec(local_world_size=2, entrypoint=children.hold, args=(ready.address,))
        agent = LocalElasticAgent(spec, start_method=FUNCTION_START, signals_to_handle="")
        events: list[AgentEvent] = []
        stream = agent.events()

        async def collect() -> None:
            async for event in stream:
                events.append(event)

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            with anyio.CancelScope() as scope:
                tg.start_soon(lambda: _cancel_when_ready(ready, scope))
                await agent.run()
    assert scope.cancelled_caught
    assert kinds(events)[-2:] == ["group_stopping", "run_failed"]
    assert events[-2].reason is StopReason.CANCELLED  # type: ignore[attr-defined]
    assert events[-1].reason is FailureReason.CANCELLED  # type: ignore[attr-defined]


async def _cancel_when_ready(ready: ReadyChannel, scope: anyio.CancelScope) -> None:
    await ready.wait(2)
    scope.cancel()


@pytest.mark.asyncio
async def test_a_spare_node_the_job_never_needed_ends_quietly() -> None:
    from tests.support.spare_node import SpareNodeHandler

    spec = WorkerSpec(
        local_world_size=2, entrypoint=children.report, rdzv_handler=SpareNodeHandler()
    )
    agent = LocalElasticAgent(spec, signals_to_handle="")
    result, events = await run_collecting(agent)
    assert (result.state, result.return_values, result.failures) == (WorkerState.SUCCEEDED, {}, {})
    assert kinds(events) == ["run_succeeded"]
    assert agent.log_dir is not None
    assert not agent.log_dir.exists()  # an empty temporary log root is removed


@pytest.mark.asyncio
async def test_misuse_is_refused_before_anything_starts(tmp_path: Path) -> None:
    def spec(**kw: Any) -> WorkerSpec:
        return WorkerSpec(**{"local_world_size": 1, "entrypoint": children.report, **kw})

    with pytest.raises(ValueError, match="local_world_size"):
        spec(local_world_size=0)
    with pytest.raises(TypeError, match="entrypoint"):
        spec(entrypoint=42)
    with pytest.raises(ValueError, match="max_restarts"):
        spec(max_restarts=-1)
    with pytest.raises(ValueError, match="monitor_interval"):
        spec(monitor_interval=0)
    with pytest.raises(TypeError, match="no_retry_exit_codes"):
        spec(no_retry_exit_codes=2)
    with pytest.raises(ValueError, match="0 is success"):
        spec(no_retry_exit_codes={0})
    with pytest.raises(TypeError, match="restart_backoff"):
        spec(restart_backoff=1.0)
    with pytest.raises(TypeError):
        WorkerSpec(1, children.report)  # type: ignore[misc]  # keyword-only, unlike torch
    assert spec(args=["a"]).args == ("a",)
    assert spec().get_entrypoint_name() == "report"
    assert spec(entrypoint="/usr/bin/env").get_entrypoint_name() == "env"

    with pytest.raises(ValueError, match="start_method"):
        LocalElasticAgent(spec(), start_method="thread")
    with pytest.raises(ValueError, match="signals_to_handle"):
        LocalElasticAgent(spec(), signals_to_handle="SIGTERM,SIGKILL")
    with pytest.raises(ValueError, match="shutdown_timeout"):
        LocalElasticAgent(spec(), shutdown_timeout=-1)
    with pytest.raises(ValueError, match="5"):
        LocalElasticAgent(spec(), redirects={5: 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="forkserver_preload"):
        LocalElasticAgent(spec(), forkserver_preload="torch")

    used = tmp_path / "used"
    (used / "attempt_0").mkdir(parents=True)
    agent = LocalElasticAgent(spec(), log_dir=used)
    with pytest.raises(ValueError, match="attempt_0"):
        await agent.run()
    with pytest.raises(RuntimeError, match="already ran"):
        await agent.run()

    with pytest.raises(ValueError, match="min_nodes"):
        LaunchConfig(min_nodes=2, max_nodes=1, nproc_per_node=1)
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1)
    with pytest.raises(ValueError, match="event_log_handler"):
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, event_log_handler="console")
    with pytest.raises(TypeError, match="LaunchConfig"):
        elastic_launch({"min_nodes": 1}, children.report)  # type: ignore[arg-type]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_timeout=60)
    assert config.rdzv_configs == {"timeout": 60}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_elastic_launch_returns_by_global_rank_or_raises_child_failed(
    out_dir: Path,
) -> None:
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0, start_method=FUNCTION_START
    )
    launch = elastic_launch(config, children.report)
    stream = launch.events()
    outputs = await launch(str(out_dir))
    assert sorted(outputs) == [0, 1]
    assert outputs[1]["RANK"] == "1"
    assert outputs[0]["ROLE_NAME"] == "default_role"  # torch's LaunchConfig default
    assert outputs[0]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert [e.kind async for e in stream][-1] == "run_succeeded"

    failing = elastic_launch(config, children.fail_until)
    with pytest.raises(ChildFailedError) as caught:
        await failing(str(out_dir), 99, 1, 4)
    assert list(caught.value.failures) == [1]
    assert caught.value.failures[1].exitcode == 4
    assert caught.value.name == "fail_until"


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "static"])
async def test_the_same_config_launches_again_in_the_same_process(
    out_dir: Path, backend: str
) -> None:
    # A fixed endpoint and run id: the second launch must find the port free and a fresh
    # rendezvous, not the first launch's closed one (the same after a failed launch).
    endpoint = f"127.0.0.1:{free_port()}"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        max_restarts=0,
        run_id="again",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        # static reads no join_timeout (refused for it, as every key a backend never reads).
        rdzv_configs={"join_timeout": 30} if backend == "c10d" else {},
        start_method=FUNCTION_START,
    )
    started = time.monotonic()
    with pytest.raises(ChildFailedError):
        await elastic_launch(config, children.fail_until)(str(out_dir), 99, 1, 4)
    for _ in range(2):
        outputs = await elastic_launch(config, children.report)(str(out_dir))
        assert sorted(outputs) == [0, 1]
    assert time.monotonic() - started < 90
    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:  # nothing of the launches listens there any more
        s.bind((host, int(port)))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_without_store_sharing_each_attempt_gets_a_new_worker_port(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=children.fail_until,
        args=(str(out_dir), 1, 0, 3),
        max_restarts=1,
    )
    agent = LocalElasticAgent(spec, start_method=FUNCTION_START, run_id="job-9")
    result, events = await run_collecting(agent)
    assert not result.is_failed()
    for seen in result.return_values.values():
        assert seen["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # worker 0 hosts the store
        assert (seen["TORCHELASTIC_RUN_ID"], seen["GROUP_WORLD_SIZE"]) == ("job-9", "1")
    rounds = [e for e in events if isinstance(e, RendezvousCompleted)]
    assert len({e.master_port for e in rounds}) == 2
    assert {e.run_id for e in events} == {"job-9"}


def test_one_node_without_store_sharing_keeps_torch_out_of_the_launcher(out_dir: Path) -> None:
    code = (
        "import asyncio, json, sys\n"
        "from aioelastic._elastic.launch._elastic_launch import LaunchConfig, elastic_launch\n"
        "from tests.children.agent import report\n"
        "config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0)\n"
        "out = asyncio.run(elastic_launch(config, report)(sys.argv[1]))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'out': out}))\n"
    )
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["torch"] is False
    assert sorted(report["out"]) == ["0", "1"]
    assert report["out"]["1"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sharing", ["agent store", "worker store"])
async def test_restarted_gloo_workers_get_a_fresh_store(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch, sharing: str
) -> None:
    # torchrun 2.13 fails this with its default (agent store): the restarted workers read
    # the first attempt's keys from its one store and gloo's connectFullMesh connects to
    # dead addresses.
    if sharing == "worker store":
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=children.collective,
        args=(str(out_dir), "restart"),
        max_restarts=1,
    )
    agent = LocalElasticAgent(
        spec, start_method="forkserver", forkserver_preload=("torch", "torch.distributed")
    )
    result, events = await run_collecting(agent)
    assert not result.is_failed(), result.failures
    assert [v["sum"] for v in result.return_values.values()] == [1.0, 1.0]
    assert all(v["TORCHELASTIC_RESTART_COUNT"] == "1" for v in result.return_values.values())
    ports = {e.master_port for e in events if isinstance(e, RendezvousCompleted)}
    assert len(ports) == 2


# -- several nodes ---------------------------------------------------------------------


class AgentProcess:
    """One node: ``python -m tests.children.agent agent ...``, its events read as they come."""

    def __init__(self, process: anyio.abc.Process, name: str) -> None:
        self.process = process
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.result: dict[str, Any] | None = None
        self.output: list[str] = []
        self._changed = anyio.Event()

    async def read(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        async for chunk in self.process.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                self.output.append(line)
                if line.startswith("EVENT "):
                    self.events.append(json.loads(line[6:]))
                elif line.startswith("RESULT "):
                    self.result = json.loads(line[7:])
            self._changed.set()
            self._changed = anyio.Event()
        self._changed.set()

    async def event(self, kind: str, **match: Any) -> dict[str, Any]:
        """Wait for an event of ``kind`` whose fields equal ``match``."""
        while True:
            for event in self.events:
                if event["kind"] == kind and all(event.get(k) == v for k, v in match.items()):
                    return event
            if self.process.returncode is not None:
                raise AssertionError(
                    f"agent {self.name} exited {self.process.returncode} without {kind} "
                    f"{match}:\n" + "\n".join(self.output[-40:])
                )
            await self._changed.wait()


@contextlib.asynccontextmanager
async def agents(
    tmp_path: Path, ready: ReadyChannel, *specs: dict[str, Any]
) -> AsyncIterator[tuple[list[AgentProcess], Callable[[dict[str, Any]], Awaitable[AgentProcess]]]]:
    """Start agent processes; another can be added later with the returned function.

    Their workers say ready on ``ready``. Leaving the block waits for every agent to exit.
    """
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = uuid.uuid4().hex[:8]
    started: list[AgentProcess] = []
    async with anyio.create_task_group() as tg:

        async def start(spec: dict[str, Any]) -> AgentProcess:
            name = spec["name"]
            argv = [
                sys.executable,
                "-m",
                "tests.children.agent",
                "agent",
                "--nnodes",
                spec.get("nnodes", "2"),
                "--nproc",
                "2",
                "--endpoint",
                endpoint,
                "--run-id",
                run_id,
                "--local-addr",
                spec["local_addr"],
                "--last-call",
                str(spec.get("last_call", 1)),
                "--max-restarts",
                str(spec.get("max_restarts", 0)),
                "--scenario",
                spec["scenario"],
                "--out",
                str(spec["out"]),
                "--log-dir",
                str(tmp_path / f"logs-{name}"),
            ]
            if spec.get("host"):
                argv.append("--host")
            env = {**os.environ, "TEST_NODE": spec.get("node", name), "TEST_READY": ready.address}
            process = await anyio.open_process(argv, env=env, stderr=None)
            agent = AgentProcess(process, name)
            started.append(agent)
            tg.start_soon(agent.read)
            return agent

        for spec in specs:
            await start(spec)
        try:
            yield started, start
            with anyio.fail_after(90):
                for agent in started:
                    await agent.process.wait()
        finally:
            with anyio.CancelScope(shield=True):
                for agent in started:
                    if agent.process.returncode is None:
                        agent.process.kill()
                    await agent.process.wait()
                    await agent.process.aclose()


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_two_agents_rendezvous_over_c10d_and_all_reduce(
    tmp_path: Path, out_dir: Path
) -> None:
    node = {"nnodes": "2", "scenario": "once", "out": out_dir, "last_call": 1}
    async with (
        ReadyChannel() as ready,
        agents(
            tmp_path,
            ready,
            {**node, "name": "a", "local_addr": "127.0.0.1", "host": True},
            {**node, "name": "b", "local_addr": "127.0.0.2"},
        ) as (nodes, _),
    ):
        pass
    for agent in nodes:
        assert agent.process.returncode == 0, "\n".join(agent.output[-40:])
    results = seen_files(out_dir, "result-4")
    assert sorted(rank for _, rank in results) == [0, 1, 2, 3]
    assert all(r["WORLD_SIZE"] == "4" and r["sum"] == 6.0 for r in results.values())
    assert nodes[0].result is not None
    assert nodes[1].result is not None
    assert sorted(nodes[0].result) == ["0", "1"]  # 127.0.0.1 sorts first: group rank 0
    assert sorted(nodes[1].result) == ["2", "3"]


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_node_joining_restarts_the_group_at_the_larger_size(
    tmp_path: Path, out_dir: Path
) -> None:
    node = {"nnodes": "1:2", "scenario": "grow", "out": out_dir, "last_call": 1}
    async with (
        ReadyChannel() as ready,
        agents(tmp_path, ready, {**node, "name": "a", "local_addr": "127.0.0.1", "host": True}) as (
            nodes,
            start,
        ),
    ):
        first = nodes[0]
        await ready.wait(2)  # both workers run at world size 2
        assert first.events[0]["world_size"] == 2
        second = await start({**node, "name": "b", "local_addr": "127.0.0.2"})
        await second.event("rendezvous_completed", world_size=4)
    for agent in nodes:
        assert agent.process.returncode == 0, "\n".join(agent.output[-40:])
    restarts = [e for e in first.events if e["kind"] == "group_restarting"]
    assert [(e["reason"], e["restart_count"], e["delay"]) for e in restarts] == [
        ("membership_change", 0, 0.0)
    ]
    assert len(seen_files(out_dir, "small")) == 2
    results = seen_files(out_dir, "result-4")
    assert sorted(rank for _, rank in results) == [0, 1, 2, 3]
    assert all(r["sum"] == 6.0 and r["TORCHELASTIC_RESTART_COUNT"] == "0" for r in results.values())
    # The membership change got its own log directory; the first attempt's is kept.
    assert sorted(p.name for p in (tmp_path / "logs-a").iterdir()) == ["attempt_0", "attempt_1"]


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(150)
async def test_a_sigkilled_agent_takes_its_workers_and_the_survivor_shrinks(
    tmp_path: Path, out_dir: Path
) -> None:
    node = {"nnodes": "1:2", "scenario": "lose_peer", "out": out_dir, "max_restarts": 2}
    async with (
        ReadyChannel() as ready,
        agents(
            tmp_path,
            ready,
            {**node, "name": "a", "local_addr": "127.0.0.1", "host": True, "last_call": 2},
            {**node, "name": "b", "local_addr": "127.0.0.2", "node": "victim", "last_call": 2},
        ) as (nodes, _),
    ):
        survivor, victim = nodes
        await ready.wait(4, timeout=90)  # all four all_reduced once at world size 4
        started = [e for e in victim.events if e["kind"] == "workers_started"][-1]
        victim_workers = [int(pid) for pid in started["pids"].values()]
        victim.process.send_signal(signal.SIGKILL)
        await victim.process.wait()
        for pid in victim_workers:
            await wait_gone(pid)
        await survivor.event("rendezvous_completed", world_size=2)
    assert survivor.process.returncode == 0, "\n".join(survivor.output[-40:])
    assert victim.process.returncode == -signal.SIGKILL
    restarts = [e for e in survivor.events if e["kind"] == "group_restarting"]
    assert restarts
    assert restarts[0]["reason"] == "worker_failed"
    results = seen_files(out_dir, "result-2")
    assert sorted(rank for _, rank in results) == [0, 1]
    assert all(r["sum"] == 1.0 for r in results.values())


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_fork_server_killed_during_an_attempt_is_replaced_for_the_restart(
    tmp_path: Path,
) -> None:
    # Attempt 0: local rank 1 SIGKILLs the fork server, which takes both workers with it.
    # The restart must find the server gone and start a fresh one, not fail on the dead one.
    from tests.children import forkserver as fs_children

    preload = ("tests.children.forkserver",)
    spec = WorkerSpec(
        local_world_size=2, entrypoint=fs_children.kill_server_then_block, max_restarts=1
    )
    agent = LocalElasticAgent(
        spec, start_method="forkserver", log_dir=tmp_path / "logs", forkserver_preload=preload
    )
    try:
        result, events = await run_collecting(agent)
        assert result.state is WorkerState.SUCCEEDED
        assert result.return_values == {0: 0, 1: 1}
        failed = [e for e in events if isinstance(e, WorkerFailed)]
        assert failed
        assert {(e.attempt, e.exitcode) for e in failed} == {(0, -signal.SIGKILL)}
        assert events[-1].restart_count == 1
        fresh = _forkserver.fork_server(preload).pid
        assert fresh is not None
        assert fresh in _forkserver.running_server_pids()
    finally:
        _forkserver.fork_server(preload).stop()
