"""Groups started by the warm fork server in tests/core/start, and the server stopped after.

Each test names its server by its preload; one of its own (a preload no other test gives)
is a server no other test has warmed.
"""

from __future__ import annotations

import aioelastic
from aioelastic._core.start._forkserver import fork_server
from tests.children import core
from tests.support.groups import envs


def stop_fork_server(preload: tuple[str, ...]) -> None:
    """Stop the fork server of ``preload`` (a test's ``finally``)."""
    fork_server(preload).stop()


async def add_on_server(
    name: str, preload: tuple[str, ...], *pairs: tuple[int, int]
) -> aioelastic.RunProcsResult:
    """Run one ``core.add`` worker per pair, forked by the fork server of ``preload``."""
    return await aioelastic.run_processes(
        name,
        core.add,
        dict(enumerate(pairs)),
        envs(len(pairs)),
        start_method="forkserver",
        forkserver_preload=preload,
    )
