"""The job the etcd tests launch: ``aioelastic-run ... tests/children/etcd_job.py [--gate FIFO]``.

A plain script, as a torchrun user writes one: join a gloo process group, ``all_reduce``
the ranks, print what it saw. Lines (stdout, one per worker and step)::

    start rank=R restart=N time=T          # user code runs (T: epoch seconds)
    sum rank=R world=W group=G restart=N sum=S time=T
    ready rank=R world=W group=G restart=N pid=P    # holding at the gate
    done rank=R world=W group=G restart=N sum=S time=T

With ``--gate FIFO`` a worker of the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0)
opens the test's FIFO after its first ``all_reduce``, prints ``ready``, and holds until
the test closes its end (EOF), then does a second ``all_reduce`` and prints ``done``:
the test decides when the job ends, and what happens to the rendezvous meanwhile. A peer
lost while the others hold makes their second ``all_reduce`` fail (exit 1), which is how a
lost node is seen. Later attempts do not hold: the test has closed the gate by then.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gate", help="a FIFO to hold at until its writer closes it")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"start rank={rank} restart={restart} time={time.time():.3f}", flush=True)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        world = dist.get_world_size()
        group = os.environ["GROUP_RANK"]
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        tag = f"rank={rank} world={world} group={group} restart={restart}"
        print(f"sum {tag} sum={value.item():g} time={time.time():.3f}", flush=True)
        if args.gate and restart == 0:
            with open(args.gate, "rb") as gate:
                print(f"ready {tag} pid={os.getpid()}", flush=True)
                gate.read()  # until the test closes its end
            value = torch.tensor([float(rank)])
            dist.all_reduce(value)
            print(f"done {tag} sum={value.item():g} time={time.time():.3f}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
