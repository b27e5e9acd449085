"""Every rank's stack across the job, grouped: one report instead of one py-spy per machine.

When a multi-node job hangs, the question is which rank is somewhere the others are not.
The stacks of every rank (gathered through the rendezvous store, see `JobChannel`) are
grouped by their main thread's frames; the groups are printed smallest first — the odd ones
out lead — each with a one-line summary of where its ranks are, its ranks with their node,
host and pid, and the stack once::

    stacks of 6 ranks on 3 nodes, asked by node 0 (10.0.0.1)
    rank 5 (node 2 10.0.0.3 pid 4242): wait <- stuck_in_barrier train.py:9 <- <module> train.py:20
      Current thread 0x00007f... (most recent call first):
        File "/usr/lib/python3.11/threading.py", line 327 in wait
        ...
    ranks 0-4 (nodes 0,1,2): wait <- all_reduce train.py:14 <- <module> train.py:20
      rank 0: node 0 10.0.0.1 pid 4100
      ...
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from ..observe._narrate import rank_ranges

__all__ = ["JobStacks", "RankStack"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
# How many frames the summary line names, innermost first.
_SUMMARY_FRAMES = 3


@dataclass(frozen=True)
class RankStack:
    """One rank's stack as its node captured it.

    Attributes:
        rank: its global rank.
        node: its node's group rank.
        host: its node's address.
        pid: its process id.
        text: every thread's stack (faulthandler's format), or why there is none.
    """

    rank: int
    node: int
    host: str
    pid: int
    text: str

    def frames(self) -> tuple[tuple[str, int, str], ...]:
        """The first thread's frames, innermost first: ``(file, line, function)``."""
        frames: list[tuple[str, int, str]] = []
        for line in self.text.splitlines():
            if frames and not line.strip():
                break  # the end of the first thread's section
            match = _FRAME.match(line)
            if match:
                frames.append((match["file"], int(match["line"]), match["func"]))
            elif frames and line.startswith(("Thread", "Current thread")):
                break
        return tuple(frames)

    def summary(self) -> str:
        """``"wait <- step train.py:42 <- <module> train.py:60"``: where the rank is."""
        frames = self.frames()
        if not frames:
            first = self.text.strip().splitlines()[:1]
            return first[0] if first else "no stack"
        parts = [frames[0][2]]
        for file, line, func in frames[1:_SUMMARY_FRAMES]:
            parts.append(f"{func} {file.rsplit('/', 1)[-1]}:{line}")
        return " <- ".join(parts)


@dataclass(frozen=True)
class JobStacks:
    """The stacks of every rank of the job, and who did not answer.

    Attributes:
        stacks: one per rank that answered.
        missing: the nodes that did not answer in time (``"node 2 (10.0.0.3)"``).
        asked_by: the node that asked (``"node 0 (10.0.0.1)"``).
        note: why the report is short, when it is (``"the c10d store at ... failed
            (...): the other nodes could not be asked"``).
    """

    stacks: tuple[RankStack, ...]
    missing: tuple[str, ...] = ()
    asked_by: str = ""
    note: str = ""

    def groups(self) -> list[list[RankStack]]:
        """Ranks whose first thread has the same frames, the smallest groups first."""
        by_frames: dict[object, list[RankStack]] = defaultdict(list)
        for stack in sorted(self.stacks, key=lambda s: s.rank):
            key: object = stack.frames() or stack.text
            by_frames[key].append(stack)
        return sorted(by_frames.values(), key=lambda group: (len(group), group[0].rank))

    def format(self) -> str:
        """The report (see the module documentation)."""
        nodes = {stack.node for stack in self.stacks}
        head = f"stacks of {_count(len(self.stacks), 'rank')} on {_count(len(nodes), 'node')}"
        lines = [head + (f", asked by {self.asked_by}" if self.asked_by else "")]
        lines += [self.note] if self.note else []
        lines += [f"{missing}: no answer" for missing in self.missing]
        for group in self.groups():
            first = group[0]
            if len(group) == 1:
                who = f"rank {first.rank} (node {first.node} {first.host} pid {first.pid})"
            else:
                group_nodes = ",".join(str(n) for n in sorted({s.node for s in group}))
                who = f"ranks {rank_ranges([s.rank for s in group])} (nodes {group_nodes})"
            lines.append(f"{who}: {first.summary()}")
            if len(group) > 1:
                lines += [f"  rank {s.rank}: node {s.node} {s.host} pid {s.pid}" for s in group]
            lines += ["    " + line for line in first.text.rstrip("\n").splitlines()]
        return "\n".join(lines) + "\n"


def _count(number: int, noun: str) -> str:
    """``"1 rank"``, ``"6 ranks"``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
