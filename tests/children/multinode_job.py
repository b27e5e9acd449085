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


def gloo(rank: int, restart: int) -> int:
    """``gloo`` mode: in attempt 0 every rank all_reduces once and says ready, then the
    ranks in ``TEST_HOLD_RANKS`` wait while the others block in a second all_reduce — which
    gloo fails by itself once a held rank's node is gone; later attempts say ready as they
    start, all_reduce once and are done."""
    if restart > 0:  # running again: what a recovery is timed to
        print(f"ready rank={rank} restart={restart} pid={os.getpid()}", flush=True)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    if restart == 0:
        print(f"ready rank={rank} restart={restart} pid={os.getpid()}", flush=True)
        held = {int(r) for r in os.environ.get("TEST_HOLD_RANKS", "").split(",") if r}
        if rank in held:
            threading.Event().wait()
        dist.all_reduce(value)
        return 3  # not reached: a held rank never joins this one
    print(f"done rank={rank} restart={restart} world={int(value.item())}", flush=True)
    dist.destroy_process_group()
    return 0


def main(mode: str, out_dir: str) -> int:
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if mode == "gloo":
        return gloo(rank, restart)
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
