"""The training script of the SLURM measure, run by ``torchrun`` / ``aioelastic-run`` per node.

Run as a script, so it imports nothing from the project::

    python benchmarks/programs/_slurm_job.py DIR MODE

A worker is known by ``HOST.LOCAL_RANK`` (its node's hostname, ``n1``..``n3`` on the test
cluster): unique on both sides whatever global ranks the launchers gave. Every worker:

1. in a later attempt (``TORCHELASTIC_RESTART_COUNT`` > 0: a new round after a lost
   node), first writes the clock (``CLOCK_MONOTONIC``, the benchmark's) to
   ``DIR/back.ID`` and one byte to the FIFO ``DIR/back``: back in user code;
2. writes its pid to ``DIR/pid.ID.ATTEMPT``;
3. joins the job's gloo group and all-reduces a one: the sum is the world the job really
   formed; writes ``RANK SUM`` to ``DIR/world.ID.ATTEMPT``;
4. installs handlers for SIGTERM, SIGUSR1 and SIGUSR2 (``train``), and writes one byte
   to the FIFO ``DIR/ready``;
5. ``sum``: exits 0. ``train``: waits for signals, as a job that checkpoints on
   preemption: each one is appended to ``DIR/signals`` as ``ID SIG`` (one ``write`` to a
   file opened for appending, so every node's lines arrive whole) and one byte goes to
   the FIFO ``DIR/noted``; USR1 and USR2 are noted and training goes on, TERM ends it
   with exit 0 at once (``os._exit``: no interpreter shutdown).

The benchmark holds every FIFO's read end open while the job runs; a write after it let
go (a straggler of a job being torn down) fails quietly.
"""

import os
import signal
import socket
import sys
import time
import warnings
from datetime import timedelta


def _fifo_byte(path: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no reader any more
    try:
        os.write(fd, b"x")
    except OSError:
        pass
    finally:
        os.close(fd)


def _write(path: str, text: str, flags: int = os.O_TRUNC) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _train(directory: str, me: str) -> int:
    stopped = []

    def on_signal(signum: int, _frame: object) -> None:
        _write(
            os.path.join(directory, "signals"),
            f"{me} {signal.Signals(signum).name[3:]}\n",
            os.O_APPEND,
        )
        _fifo_byte(os.path.join(directory, "noted"))
        if signum == signal.SIGTERM:
            stopped.append(signum)

    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, on_signal)
    _fifo_byte(os.path.join(directory, "ready"))
    while not stopped:
        signal.pause()  # returns once a handler ran
    # Checkpointed: gone at once. An interpreter with torch loaded takes about 1 s of CPU to
    # finalise, six of them on two cores longer than SLURM's KillWait here: that, the same
    # on both sides, would be what the scancel case timed, not the launchers.
    os._exit(0)


def main() -> int:
    """The steps above."""
    directory, mode = sys.argv[1], sys.argv[2]
    me = f"{socket.gethostname()}.{os.environ['LOCAL_RANK']}"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt > 0:
        _write(
            os.path.join(directory, f"back.{me}"), str(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        )
        _fifo_byte(os.path.join(directory, "back"))
    _write(os.path.join(directory, f"pid.{me}.{attempt}"), str(os.getpid()))
    # torch's CPU wheel warns at import on a machine without numpy, once per rank.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    value = torch.ones(1)
    dist.all_reduce(value)
    _write(
        os.path.join(directory, f"world.{me}.{attempt}"), f"{dist.get_rank()} {int(value.item())}"
    )
    if mode == "train":
        return _train(directory, me)
    _fifo_byte(os.path.join(directory, "ready"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
