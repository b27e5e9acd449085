"""A training script we did not write: rank 1 waits in a barrier no peer reaches.

Under ``TIMER=torch`` or ``TIMER=ours`` it arms a file timer around the barrier (torch's
``FileTimerClient`` or ``aioelastic.timer``), as a user would; with ``TIMER=none`` it
just hangs. Rank 0 prints a step line and waits too.
"""

from __future__ import annotations

import os
import threading
import time


def wait_for_peers_in_barrier() -> None:
    threading.Event().wait()  # a peer never arrives


def other_rank_waits_in_sleep() -> None:
    time.sleep(3600)


if __name__ == "__main__":
    rank = os.environ["LOCAL_RANK"]
    kind = os.environ.get("TIMER", "none")
    print(f"rank {rank} step 1", flush=True)
    if rank != "1":
        other_rank_waits_in_sleep()
    elif kind == "torch":
        from torch.distributed.elastic import timer

        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        with timer.expires(after=2, scope="barrier"):
            wait_for_peers_in_barrier()
    elif kind == "ours":
        import aioelastic.timer

        aioelastic.timer.configure()
        with aioelastic.timer.expires(after=2, scope="barrier"):
            wait_for_peers_in_barrier()
    else:
        wait_for_peers_in_barrier()
