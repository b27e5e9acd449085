"""A script every rank runs alike, for the collapsing of identical console lines.

A plain script (standard library only), as a user's training script would be::

    python tests/children/collapse.py READY GO HOLD [RANK]

Each rank writes its rank to the FIFO ``READY``, then opens the FIFO ``GO``, which blocks
until the test opens it: so every rank writes at about the same time, however slowly the
ranks started. It then writes :func:`lines` (a warning every rank writes, lines of its
own, a common last line; a warning on stderr) and, with ``HOLD`` 1, stays until ``GO``
reaches end-of-file (the test closes it), so the lines are shown while it still runs.
``RANK`` comes from the environment when not given.
"""

from __future__ import annotations

import os
import sys

WARNING = "UserWarning: the same warning from every rank"
LAST = "every rank is done"
ERR_WARNING = "stderr: the same from every rank"


def lines(rank: int) -> tuple[list[str], list[str]]:
    """What ``rank`` writes to stdout and to stderr, in order."""
    own = [f"rank {rank} line {i}" for i in range(3)]
    return [WARNING, *own, LAST], [ERR_WARNING]


def main(argv: list[str]) -> None:
    ready, go, hold = argv[0], argv[1], argv[2] == "1"
    rank = int(argv[3]) if len(argv) > 3 else int(os.environ["RANK"])
    with open(ready, "w") as f:
        f.write(f"{rank}\n")
    fd = os.open(go, os.O_RDONLY)
    out, err = lines(rank)
    for line in out:
        print(line, flush=True)
    for line in err:
        print(line, file=sys.stderr, flush=True)
    if hold:
        while os.read(fd, 1):
            pass
    os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1:])
