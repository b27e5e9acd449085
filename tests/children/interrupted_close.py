"""A supervisor whose ``close()`` is interrupted by Ctrl-C (SIGINT under ``anyio.run``).

``python -m tests.children.interrupted_close FIFO``: one fork worker that ignores SIGTERM
(it says ``ready`` on FIFO). On a line on stdin, prints ``closing`` on stderr and closes
the group, which waits out its 2 s grace period; the test sends SIGINT then. Once the
interrupt has ended the run, prints one JSON line on stderr: the children it still has
(running or unreaped workers) and the fds it left open, the watchdog's aside.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import anyio

import aioelastic
from aioelastic._core.start._watchdog import watchdog
from tests.children import core
from tests.support.audit import children_of, open_fds


async def _supervise(fifo: str) -> None:
    async with aioelastic.start_processes(
        "interrupted",
        core.block_forever,
        {0: (fifo, True)},
        {0: {}},
        start_method="fork",
        grace_period=2.0,
    ) as ctx:
        await anyio.wait_readable(0)
        print("closing", file=sys.stderr, flush=True)
        await ctx.close()


def main() -> None:
    """See the module's docstring."""
    fds_before = set(open_fds())
    try:
        anyio.run(_supervise, sys.argv[1])
    except KeyboardInterrupt:
        pass
    except asyncio.CancelledError:
        # Python 3.10: a Ctrl-C inside anyio.run surfaces as this (docs/reliability.md).
        if sys.version_info >= (3, 11):
            raise
    helpers = {watchdog.pid, watchdog.fileno()}
    left = {
        "children": sorted(set(children_of(os.getpid())) - helpers),
        "fds": sorted(set(open_fds()) - fds_before - helpers),
    }
    print(json.dumps(left), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
