"""The elastic agent, for real, on one node: workers, restarts, signals, stores.

The agent runs in this process. Agents on several nodes, each its own process, are in
tests/elastic/agent/test_agents_on_nodes.py; ``elastic_launch`` over the agent in
tests/elastic/launch/test_elastic_launch.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

pytest.importorskip("torch.distributed")

from aioelastic._core.aio._signals import SignalReceived
from aioelastic._core.start import _forkserver
from aioelastic._elastic.agent._agent import LocalElasticAgent
from aioelastic._elastic.agent._types import RestartBackoff, WorkerSpec, WorkerState
from aioelastic._elastic.launch._elastic_launch import LaunchConfig, elastic_launch
from aioelastic._elastic.observe._events import (
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
from tests.children import agent as children
from tests.support.agents import FUNCTION_START, ReadyChannel, kinds, run_collecting, seen_files
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.torch,
    pytest.mark.usefixtures("torch_store_warmed", "agent_env", "collect_stores"),
]


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
