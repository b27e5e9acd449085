"""What becomes of a worker's exit: its real status, stopped or failed.

Races found by the soak (tests/core/group/test_soak.py): ``close()`` racing the workers'
own exits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import aioelastic
from tests.children import soak
from tests.support.waits import ReadyFifo


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["fork", "forkserver"])
@pytest.mark.timeout(60)
async def test_an_interrupt_on_a_workers_way_out_keeps_its_exit_status(method: str) -> None:
    """Found by the soak (close(SIGINT) racing exits): a worker's sys.exit(7) became exit 0."""
    result = await aioelastic.run_processes(
        "way_out",
        soak.exit_interrupted_on_the_way_out,
        {0: (7,)},
        {0: {}},
        start_method=method,
        grace_period=5,
    )
    failure = result.failures[0]
    assert failure.exitcode == 7, failure.message


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_stopped_worker_that_exits_0_is_not_a_failure(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "graceful", soak.exit_0_on_sigterm, {0: (str(fifo.path),)}, {0: {}}, start_method="fork"
        ) as ctx:
            await fifo.lines(1)
            await ctx.close()
            result = await ctx.wait()
    finally:
        fifo.close()
    assert result is not None
    assert result.failures == {}
