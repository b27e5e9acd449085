"""Stall detection: no output and no timer request from any local worker for S seconds.

:func:`wait_for_stall` sleeps until the moment the group would have been idle for
``timeout`` seconds, then checks whether anything happened meanwhile; each piece of
activity pushes that moment back. It wakes at deadlines, never on a polling interval.
What the group was doing when it stalled is a :class:`StallReport`; how it is told is
its group's choice (a :data:`StallTeller`: an elastic agent tells every node's stacks).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import anyio


@dataclass(frozen=True)
class RankActivity:
    """What one rank last did: when (CLOCK_MONOTONIC) and the text it last wrote."""

    rank: int
    last_output: float | None
    last_text: str = ""


@dataclass(frozen=True)
class StallReport:
    """A stalled group: how long it was idle, each rank's last output, every stack."""

    timeout: float
    idle: float
    ranks: list[RankActivity]
    stacks: Mapping[int, str] = field(default_factory=dict)
    #: When the stall was declared (CLOCK_MONOTONIC).
    at: float = field(default_factory=time.monotonic)

    def reason(self) -> str:
        """One line: ``stalled: no output and no timer request for 31.2s (--stall-timeout 30)``."""
        return (
            f"stalled: no worker wrote output or sent a timer request for {self.idle:.1f}s "
            f"(stall timeout {self.timeout:g}s)"
        )

    def rank_line(self, activity: RankActivity) -> str:
        """How long ago ``activity``'s rank last wrote, and what."""
        if activity.last_output is None:
            return f"rank {activity.rank}: no output since it started"
        ago = self.at - activity.last_output
        return f"rank {activity.rank}: last output {ago:.1f}s ago: {activity.last_text!r}"

    def head(self) -> str:
        """The reason, then each rank's last output: the report without the stacks."""
        lines = [self.reason()]
        lines += [f"  {self.rank_line(a)}" for a in self.ranks]
        return "\n".join(lines) + "\n"

    def format(self) -> str:
        """The whole report: the reason, each rank's last output, then each rank's stack."""
        lines = [self.head().rstrip("\n")]
        for rank, stack in sorted(self.stacks.items()):
            lines.append(f"--- stack of local rank {rank} ---")
            lines.append(stack.rstrip("\n"))
        return "\n".join(lines) + "\n"


StallTeller = Callable[[StallReport], Awaitable[str]]
"""Turns a stall into the text the launcher prints, before the group is stopped."""


async def wait_for_stall(timeout: float, last_activity: Callable[[], float]) -> float:
    """Return once ``last_activity()`` (CLOCK_MONOTONIC) is ``timeout`` seconds old.

    Returns the idle time at that moment. ``timeout`` must be positive.
    """
    if not timeout > 0:
        raise ValueError(f"stall timeout must be a positive number of seconds, got {timeout!r}")
    while True:
        idle = time.monotonic() - last_activity()
        if idle >= timeout:
            return idle
        await anyio.sleep(timeout - idle)
