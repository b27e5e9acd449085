"""Agents on several "nodes": each agent its own process, c10d on 127.0.0.1, gloo workers.

Each node runs ``python -m tests.children.agent agent``; the test reads the events it
prints and waits for its workers' ``ready`` on a Unix socket. Single-node agents, run in
the test process, are in tests/elastic/agent/test_agent.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

pytest.importorskip("torch.distributed")

from tests.support.agents import ReadyChannel, seen_files
from tests.support.ports import free_port
from tests.support.waits import wait_gone

pytestmark = [
    pytest.mark.torch,
    pytest.mark.usefixtures("torch_store_warmed", "agent_env", "collect_stores"),
]


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
