"""The training script of the multinode measure: ranks on three nodes that notice nothing.

Run by ``torchrun`` / ``aioelastic-run`` on every node as a script, so it imports nothing
from the project::

    python benchmarks/programs/_multinode_job.py DIR WAIT FAIL_NODE

``BENCH_NODE`` (set by the benchmark in each launcher's environment, inherited by its
workers) is the node's index, 0 for the launcher that hosts the store. Every worker first
writes its pid to ``DIR/pid{NODE}.{LOCAL_RANK}`` (the benchmark kills a lost node's
workers by pid: torchrun starts each in a session of its own), then:

- ``WAIT=silent``: nothing more; the rank blocks in an endless wait of its own, as an
  NCCL rank blocks in a collective whose peer died: it notices nothing.
- ``WAIT=gloo``: imports torch, joins the job's gloo process group and passes a barrier;
  then it calls ``all_reduce``, which the failing rank never joins. gloo sees the dead
  peer's connection close and raises, and the rank exits 1: the backend tells.

Once set up, each worker writes one byte to the FIFO ``DIR/ready``. The last local rank of
node ``FAIL_NODE`` (``-1``: none) then reads one byte from the FIFO ``DIR/go``, writes the
clock (``CLOCK_MONOTONIC``, the benchmark's) to ``DIR/fail`` and exits 7 at once.

A worker that finds its pid file already written is a rank of the next attempt, after a
node was lost (the ``recover`` cases): it writes the clock to ``DIR/back{NODE}.{LOCAL_RANK}``,
one byte to the FIFO ``DIR/back`` and returns: the job completes.
"""

import os
import sys
import threading
import time
from collections.abc import Callable

#: How long a blocked rank waits before it exits by itself; only a broken benchmark lets it
#: run that long (every repetition kills what is left of its job).
_TTL_S = 300.0


def _stamp(path: str) -> None:
    stamp = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    with open(path, "w") as f:
        f.write(str(stamp))


def _join_gloo() -> Callable[[], object]:
    """Join the job's gloo group, pass a barrier; the collective the survivors then wait in."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    return lambda: dist.all_reduce(torch.ones(1))


def main() -> int:
    """Set up, say ready, then fail (one rank) or block (the others); see above."""
    directory, wait, fail_node = sys.argv[1], sys.argv[2], int(sys.argv[3])
    node, local_rank = int(os.environ["BENCH_NODE"]), int(os.environ["LOCAL_RANK"])
    failing = node == fail_node and local_rank == int(os.environ["LOCAL_WORLD_SIZE"]) - 1
    pid_file = os.path.join(directory, f"pid{node}.{local_rank}")
    if os.path.exists(pid_file):
        _stamp(os.path.join(directory, f"back{node}.{local_rank}"))
        back = os.open(os.path.join(directory, "back"), os.O_WRONLY)
        os.write(back, b"b")
        os.close(back)
        return 0
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    block = _join_gloo() if wait == "gloo" else lambda: threading.Event().wait(_TTL_S)
    # A read-write open of a FIFO never blocks (Linux); the byte waits in it for the read.
    go = os.open(os.path.join(directory, "go"), os.O_RDWR) if failing else -1
    # The benchmark holds the read end open: this write-only open does not block either.
    ready = os.open(os.path.join(directory, "ready"), os.O_WRONLY)
    os.write(ready, b"r")
    os.close(ready)
    if failing:
        os.read(go, 1)
        _stamp(os.path.join(directory, "fail"))
        os._exit(7)
    block()
    return 2  # only after the TTL: a blocked rank is stopped by its launcher


if __name__ == "__main__":
    sys.exit(main())
