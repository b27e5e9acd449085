"""``python -m tests.children.binary_loop MARKER``: start binary workers until killed.

Each group of 4 ``sh`` workers carries MARKER in its command line; one line per started
group goes to stdout. The test SIGKILLs this supervisor mid-stream.
"""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack

import anyio

import aioelastic


async def main(marker: str) -> None:
    async with AsyncExitStack() as stack:
        for n in range(1000):
            await stack.enter_async_context(
                aioelastic.start_processes(
                    f"g{n}",
                    "/bin/sh",
                    {rank: ("-c", "sleep 600; :", marker) for rank in range(4)},
                    {rank: {} for rank in range(4)},
                )
            )
            sys.stdout.write("started\n")
            sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
