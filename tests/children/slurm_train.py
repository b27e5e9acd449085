"""The training script of the SLURM tests, run by ``aioelastic-run`` on every node.

    python tests/children/slurm_train.py MODE OUT_DIR

Every worker first prints ``started rank=R restart=K`` (back in user code), then joins
a gloo group and all-reduces a one: the sum is the world size the job really formed.
Then it prints ``ready rank=R world=W sum=S host=H restart=K requeue=Q``
(``Q``: ``SLURM_RESTART_COUNT``, ``-`` when unset) and:

* ``sum``: exits 0;
* ``train``: trains until told to stop, as a job that checkpoints on preemption: each
  signal of ``TERM``, ``USR1``, ``USR2`` it receives is appended to ``OUT_DIR/signals``
  as ``rank=R SIG`` (one ``write`` of a short line to a file opened for appending: the
  lines of every rank on every node arrive whole); ``USR1``/``USR2`` are noted and
  training goes on, ``TERM`` ends it with exit 0 (the checkpoint written);
* ``fail``: in attempt 0 the rank ``TEST_FAIL_RANK`` exits 7 and the others wait in a
  second all-reduce that gloo fails once it is gone; later attempts are ``sum``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import warnings
from datetime import timedelta


def note(out_dir: str, line: str) -> None:
    """Append ``line`` to ``OUT_DIR/signals`` in one write."""
    fd = os.open(os.path.join(out_dir, "signals"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def train(rank: int, out_dir: str) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        note(out_dir, f"rank={rank} {signal.Signals(signum).name[3:]}")
        if signum == signal.SIGTERM:
            stop.set()

    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, on_signal)
    print(f"training rank={rank}", flush=True)
    while not stop.is_set():
        stop.wait(1.0)  # a signal's handler runs between waits, in this thread
    print(f"checkpointed rank={rank}", flush=True)
    return 0


def main(mode: str, out_dir: str) -> int:
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"started rank={rank} restart={restart}", flush=True)
    # torch's CPU wheel warns at import on a machine without numpy, once per rank.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    print(
        f"ready rank={rank} world={dist.get_world_size()} sum={int(value.item())} "
        f"host={socket.gethostname()} restart={restart} "
        f"requeue={os.environ.get('SLURM_RESTART_COUNT', '-')}",
        flush=True,
    )
    if mode == "train":
        code = train(rank, out_dir)
        dist.destroy_process_group()
        print(f"exiting rank={rank}", flush=True)
        return code
    if mode == "fail" and restart == 0:
        if rank == int(os.environ["TEST_FAIL_RANK"]):
            return 7
        dist.all_reduce(value)
        return 3  # not reached: gloo fails the all-reduce once the failed rank is gone
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
