"""The training script of the multi-node tests, run by ``aioelastic-run`` on every node.

    python tests/children/multinode_job.py MODE OUT_DIR

Every worker first prints ``ready rank=R restart=K pid=P``. Then the worker whose global
rank is ``TEST_FAIL_RANK`` (if any) opens the FIFO ``OUT_DIR/go`` for reading — which
blocks until the test opens it for writing — and exits 7, in every attempt before
``TEST_FAIL_UNTIL`` (default 1; ``-1``: every attempt). From that attempt on, every
worker prints ``done rank=R restart=K`` and exits 0. Until then the other workers block
the way NCCL ranks do, noticing nothing of a dead peer:

* ``hang``: in an endless wait of their own;
* ``store``: in a wait on a key nobody sets, on the workers' store at
  ``MASTER_ADDR:MASTER_PORT`` (torch imported).

The worker whose global rank is ``TEST_ODD_RANK`` waits in a function of its own
(`stuck_elsewhere`), for the grouped stack reports.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta


def stuck_elsewhere() -> None:
    """Where the odd rank waits."""
    threading.Event().wait()


def main(mode: str, out_dir: str) -> int:
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    fail_rank = int(os.environ.get("TEST_FAIL_RANK", "-1"))
    fail_until = int(os.environ.get("TEST_FAIL_UNTIL", "1"))
    store = None
    if mode == "store":
        import torch.distributed as dist

        store = dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=300),
        )
    print(f"ready rank={rank} restart={restart} pid={os.getpid()}", flush=True)
    failing = fail_until < 0 or restart < fail_until
    if rank == fail_rank and failing:
        with open(os.path.join(out_dir, "go")) as go:
            go.read()
        print(f"failing rank={rank} restart={restart}", flush=True)
        return 7
    if failing:
        if store is not None:
            store.wait(["nobody-sets-this"])
        elif rank == int(os.environ.get("TEST_ODD_RANK", "-1")):
            stuck_elsewhere()
        else:
            threading.Event().wait()
    print(f"done rank={rank} restart={restart}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
