"""Under anyio's trio backend every entry point refuses at once, creating nothing."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic._core.aio._signals import handle_signals

pytestmark = pytest.mark.timeout(60)

MESSAGE = (
    "aioelastic needs the asyncio backend, but {what} runs under trio: run it with "
    "anyio.run(main, backend='asyncio') or asyncio.run(main())."
)


def work(*args: Any) -> int:
    return 0


async def _enter_context() -> None:
    async with aioelastic.start_processes("g", work, {0: ()}, {0: {}}):
        pass


async def _signals() -> None:
    async with handle_signals():
        pass


async def _agent() -> None:
    spec = aioelastic.WorkerSpec(local_world_size=1, entrypoint=work)
    await aioelastic.LocalElasticAgent(spec).run()


async def _elastic_launch() -> None:
    config = aioelastic.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    await aioelastic.elastic_launch(config, work)()


ENTRY_POINTS: dict[str, tuple[str, Callable[[], Awaitable[Any]]]] = {
    "start_processes": ("start_processes()", _enter_context),
    "run_processes": (
        "start_processes()",
        lambda: aioelastic.run_processes("g", work, {0: ()}, {0: {}}),
    ),
    "spawn": ("start_processes()", lambda: aioelastic.spawn(work, nprocs=1)),
    "launch": ("launch()", lambda: aioelastic.launch(work, (), nprocs=1)),
    "agent": ("LocalElasticAgent.run()", _agent),
    "elastic_launch": ("elastic_launch", _elastic_launch),
    "handle_signals": ("handle_signals()", _signals),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_trio_before_creating_anything(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    what, call = ENTRY_POINTS[entry]
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        anyio.run(call, backend="trio")
    assert time.monotonic() - started < 10
    assert str(caught.value).startswith(MESSAGE.format(what=what))
    assert os.listdir(private) == []
