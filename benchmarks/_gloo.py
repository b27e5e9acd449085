"""The real training script of the launcher measure: torch, a gloo process group, a barrier.

Run by ``torchrun`` / ``aioelastic-run`` as a script, so it imports nothing from the
project: ``python benchmarks/_gloo.py DIR`` imports torch, joins the job's process group
(``init_process_group("gloo")`` from the launcher's environment), passes a barrier and then
writes ``DIR/start{LOCAL_RANK}``: the moment this rank is past the barrier.
"""

import os
import sys
import time

import torch.distributed as dist


def main() -> None:
    """Join the group, pass the barrier, write this rank's stamp."""
    dist.init_process_group("gloo")
    dist.barrier()
    stamp = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    path = os.path.join(sys.argv[1], "start" + os.environ["LOCAL_RANK"])
    with open(path, "w") as f:
        f.write(str(stamp))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
