"""Run four workers, collect their return values, then watch a failure stop the group.

python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import os
import time

import aioelastic
from aioelastic import Std


def square(x: int) -> int:
    print(f"worker {os.environ['LOCAL_RANK']}: squaring {x}", flush=True)
    return x * x


def flaky(rank: int) -> None:
    if rank == 2:
        raise RuntimeError("rank 2 hit a bad batch")
    time.sleep(60)  # the supervisor stops these as soon as rank 2 fails


async def main() -> None:
    n = 4
    envs = {rank: {"LOCAL_RANK": rank} for rank in range(n)}
    result = await aioelastic.run_processes(
        name="square",
        entrypoint=square,
        args={rank: (rank + 1,) for rank in range(n)},
        envs=envs,
        tee=Std.ALL,
    )
    print("return values:", result.return_values)

    started = time.monotonic()
    async with aioelastic.start_processes(
        "flaky", flaky, {rank: (rank,) for rank in range(n)}, envs, grace_period=5
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    print(f"failure seen and group stopped in {time.monotonic() - started:.2f} s")
    print(aioelastic.ChildFailedError("flaky", result.failures).format_msg())


if __name__ == "__main__":
    asyncio.run(main())
