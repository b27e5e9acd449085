"""Resource stability figure: ``python -m benchmarks.resources [--cycles N] [--kind K]``.

Runs N start/wait/close cycles of 4 workers and prints the supervising process's open
fds, resident memory and threads before and after (and the fork server's fds). The
measuring function, :func:`workloads.cycles.measure_cycles`, is the one
``tests/core/group/test_resources.py`` asserts on, so the printed figure and the test's bounds come
from the same code. Run from the repository root.
"""

from __future__ import annotations

import argparse

import anyio

from workloads.cycles import measure_cycles


def main() -> None:
    """Print the figures of one resource-stability run."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resources")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument(
        "--kind", default="forkserver", choices=["binary", "fork", "forkserver", "spawn"]
    )
    args = parser.parse_args()

    async def run() -> None:
        figures = await measure_cycles(cycles=args.cycles, nprocs=args.nprocs, kind=args.kind)
        print(figures.table())

    anyio.run(run)


if __name__ == "__main__":
    main()
