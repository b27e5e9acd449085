"""Running an elastic agent in the test process and hearing from its workers.

For the tests of the agent and of ``elastic_launch``: the events of a run collected beside
it, what workers recorded in files, and a Unix socket workers say ``ready`` on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

if TYPE_CHECKING:
    from aioelastic._elastic.agent._agent import LocalElasticAgent
    from aioelastic._elastic.agent._types import RunResult
    from aioelastic._elastic.observe._events import AgentEvent

#: Start method for function workers that need no warm server.
FUNCTION_START = "spawn"


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
    """The kinds of ``events``, in order."""
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
