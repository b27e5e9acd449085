"""Job channels over one in-memory store, as the nodes of a round share the rendezvous store.

Shared by the channel's unit tests (``test_protocols.py``, ``test_protocol_faults.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from aioelastic._elastic.channel._job_channel import JobChannel
from tests.elastic.channel.memory_store import MemoryStore

SCOPE = "aioelastic/attempt0"
RESTARTS = "aioelastic/restarts"
BEAT = 0.05
#: What a bound allows beyond the mechanism's own time: a thread hop and a few beats on a
#: loaded machine.
ALLOWANCE = 2.0


@contextmanager
def channels(
    store: MemoryStore, nodes: int, *, dead_after: float = 5.0
) -> Iterator[list[JobChannel]]:
    """One channel per node of a round, node ``i`` at host ``h{i}``; closed after."""
    made = [
        JobChannel(
            store,
            SCOPE,
            node=node,
            nodes=nodes,
            host=f"h{node}",
            restarts=(store, RESTARTS),
            beat=BEAT,
            dead_after=dead_after,
        )
        for node in range(nodes)
    ]
    try:
        yield made
    finally:
        for channel in made:
            channel.close()


def stacks_of(node: int) -> Callable[[], Awaitable[list[tuple[int, int, str]]]]:
    """A node's stack capture: its one rank (``10 * node``), a recognisable text."""

    async def capture() -> list[tuple[int, int, str]]:
        return [(10 * node, 100 + node, f"stack of node {node}")]

    return capture
