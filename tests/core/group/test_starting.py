"""Starting a group: a failure while siblings are still starting stops them too.

Found by the soak (tests/core/group/test_soak.py), made deterministic here.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic._core.start import _launchers
from tests.support.waits import ReadyFifo


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failure_while_siblings_start_stops_them_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails before rank 1 is started: rank 1 must be stopped all the same.

    Deterministic version of a race the soak finds (AIOELASTIC_SOAK_STRICT=1) and
    tests/core/group/test_pcontext.py::test_unpicklable_return_value_fails_that_rank[fork] hits now
    and then: rank 1's launch is held until rank 0's failure has been handled.
    """
    from aioelastic._core.worker._teardown import stop_workers
    from tests.children import core

    fifo = ReadyFifo(tmp_path)
    real = _launchers.on_launcher_thread
    forks = 0
    first: list[int] = []
    first_started = anyio.Event()

    async def held(fn: Callable[..., Any], *args: object) -> Any:
        nonlocal forks
        if fn is not _launchers.start_fork:
            return await real(fn, *args)
        forks += 1
        if forks == 1:
            launched = await real(fn, *args)
            first.append(launched.pid)
            first_started.set()
            return launched
        await first_started.wait()
        pidfd = os.pidfd_open(first[0])
        try:
            await anyio.wait_readable(pidfd)  # rank 0 exited...
        finally:
            os.close(pidfd)
        await anyio.wait_all_tasks_blocked()  # ...and the supervisor has reacted
        return await real(fn, *args)

    monkeypatch.setattr(_launchers, "on_launcher_thread", held)
    ctx = aioelastic.start_processes(
        "early",
        core.behave,
        {0: ("exit", 3), 1: ("block", str(fifo.path))},
        {0: {}, 1: {}},
        start_method="fork",
        grace_period=1,
    )
    done = anyio.Event()
    result: list[aioelastic.RunProcsResult | None] = []

    async def supervise() -> None:
        async with ctx:
            result.append(await ctx.wait())
        done.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervise)
            with anyio.move_on_after(8):  # well under a second once fixed
                await done.wait()
            in_time = done.is_set()
            if not in_time:
                # The bug: rank 1 was never signalled and the block waits for its exit.
                # Stop the missed workers with the core's own teardown to end the test.
                left = [w for w in ctx._workers if not w.reaped]
                await stop_workers(left, signal.SIGKILL, 0, anyio.Event())
    finally:
        fifo.close()
    assert in_time, "rank 1, started after rank 0 failed, was never stopped"
    assert result[0] is not None
    assert {r: f.exitcode for r, f in result[0].failures.items()} == {0: 3}
