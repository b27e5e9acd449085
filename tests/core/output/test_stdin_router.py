"""Every start method gives its workers the stdin terminal the router writes typed lines to.

The supervisor's console is made to look like a terminal's (``ConsoleTerminals.probe``),
and the router is replaced by the test itself: each worker's target gets a line written
into its master side, which the worker reads from its stdin. Under a real terminal, with
the real router, see ``tests/core/output/test_terminal_keyboard.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

import aioelastic
from aioelastic import Std
from aioelastic._core.output._stdin_router import StdinRouter, StdinTarget
from aioelastic._core.output._terminal import ConsoleTerminals
from aioelastic._core.start._forkserver import fork_server
from tests.children import core
from tests.support.audit import spare_pids
from tests.support.groups import envs

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

PRELOAD = ("tests.children.core", "json")


@pytest.fixture
def typed(monkeypatch: pytest.MonkeyPatch) -> list[StdinTarget]:
    """Pretend stdin is our terminal; type ``line for local rank N`` to each worker."""
    attached: list[StdinTarget] = []

    def probe(cls: type[ConsoleTerminals]) -> ConsoleTerminals:
        return cls(stdin=True, stdout=False, stderr=False)

    async def attach(self: StdinRouter, target: StdinTarget) -> None:
        attached.append(target)
        try:
            os.write(target.master, b"line for local rank %d\n" % target.local_rank)
            await anyio.sleep_forever()
        finally:
            os.close(target.master)

    async def run(self: StdinRouter) -> None:
        pass  # never reads the test runner's own stdin

    monkeypatch.setattr(ConsoleTerminals, "probe", classmethod(probe))
    monkeypatch.setattr(StdinRouter, "attach", attach)
    monkeypatch.setattr(StdinRouter, "run", run)
    return attached


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver", "forkserver-spares"])
async def test_each_function_worker_reads_its_own_stdin_terminal(
    method: str, typed: list[StdinTarget]
) -> None:
    start_method = method.split("-")[0]
    spares: set[int] = set()  # forked ahead before the second start
    idle: set[int] = set()  # those still waiting after it
    try:
        if method == "forkserver-spares":
            # A first start leaves spares forked ahead; the second start's workers are them.
            await aioelastic.run_processes(
                "warm", core.add, {0: (1, 2), 1: (3, 4)}, envs(2),
                start_method="forkserver", forkserver_preload=PRELOAD,
            )  # fmt: skip
            server = fork_server(PRELOAD)
            with anyio.fail_after(30):
                assert await server.spares_ready() == 2
            spares = set(spare_pids(server.pid))
            assert len(spares) == 2
        typed.clear()
        result = await aioelastic.run_processes(
            "stdin", core.stdin_line, {0: (), 1: ()}, envs(2),
            start_method=start_method, forkserver_preload=PRELOAD,
        )  # fmt: skip
        if spares:
            idle = set(spare_pids(fork_server(PRELOAD).pid)) & spares
    finally:
        fork_server(PRELOAD).stop()
    assert not result.is_failed(), result.failures
    assert sorted(t.local_rank for t in typed) == [0, 1]
    for rank, (isatty, line, pid) in result.return_values.items():
        assert isatty is True
        assert line == f"line for local rank {rank}\n"
        assert pid == next(t.pid for t in typed if t.local_rank == rank)
    if method == "forkserver-spares":
        # The workers are spares, their terminals given in the hand-off. The first request
        # takes a spare of those; the server may fork another between two requests (idle
        # for 5 ms on a loaded machine), and the next request takes that one (the newest
        # first), leaving one of those idle. A spare that failed its hand-off is killed,
        # and its request forked: then one of those is neither a worker nor idle.
        workers = {pid for _, _, pid in result.return_values.values()}
        assert workers & spares, (workers, spares)
        assert spares - workers == idle, (workers, spares, idle)


async def test_each_binary_worker_reads_its_own_stdin_terminal(
    typed: list[StdinTarget], tmp_path: Path
) -> None:
    code = "import os, sys; print(os.isatty(0), sys.stdin.readline().strip())"
    result = await aioelastic.run_processes(
        "stdin", sys.executable, {0: ("-c", code), 1: ("-c", code)}, envs(2),
        log_dir=str(tmp_path), redirects=Std.OUT,
    )  # fmt: skip
    assert not result.is_failed(), result.failures
    for rank, path in result.stdouts.items():
        assert Path(path).read_text() == f"True line for local rank {rank}\n"


async def test_without_a_terminal_every_stdin_is_dev_null() -> None:
    if ConsoleTerminals.probe().stdin:
        pytest.skip("run with the terminal as stdin (pytest -s): see test_terminal_workers.py")
    result = await aioelastic.run_processes(
        "stdin", core.stdin_line, {0: (), 1: ()}, envs(2), start_method="fork"
    )
    assert not result.is_failed(), result.failures
    assert [value[:2] for value in result.return_values.values()] == [(False, "")] * 2
