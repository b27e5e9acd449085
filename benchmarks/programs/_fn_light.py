"""Function workers whose module imports nothing heavy (no torch).

They measure the supervisor, not an import: a spawned worker pays only for a fresh
interpreter and this small module. The same functions serve aioelastic and
torch.distributed.elastic (called as ``fn(*args[rank])`` with ``args = (rank, dir, ...)``)
and torch.multiprocessing (called as ``fn(i, *args)``), hence the rank first.
"""

from __future__ import annotations

import os
import signal
import time

from benchmarks.programs._clock import WORKER_TTL_S, write_stamp
from benchmarks.programs._ready import signal_ready, wait_ready


def stamp(rank: int, directory: str) -> None:
    """Record that user code runs: ``{directory}/start{rank}``."""
    write_stamp(os.path.join(directory, f"start{rank}"))


def noop(rank: int, directory: str) -> None:
    """Do nothing (no-op job completion)."""


def fail_or_sleep(rank: int, directory: str, n: int, ignore_term: bool, delay: float) -> None:
    """Rank 0 fails ``delay`` seconds after every sibling runs; the siblings sleep.

    The delay puts the failure at a random phase of any polling period. Once its siblings
    run, rank 0 signals ``{directory}/armed`` (the caller's cue that the job is fully up)
    and stamps ``{directory}/fail0`` right before ``os._exit(1)``: the start of the
    failure-detection and teardown clocks. Siblings that ``ignore_term`` make the
    supervisor wait out its grace period and then SIGKILL them; the others stamp
    ``{directory}/term{rank}`` when SIGTERM reaches them (see :func:`stamp_on_term`).
    """
    fifo = os.path.join(directory, "ready")
    if rank == 0:
        wait_ready(fifo, n - 1)
        signal_ready(os.path.join(directory, "armed"))
        time.sleep(delay)
        write_stamp(os.path.join(directory, "fail0"))
        os._exit(1)
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        stamp_on_term(os.path.join(directory, f"term{rank}"))
    signal_ready(fifo)
    time.sleep(WORKER_TTL_S)


def stamp_on_term(path: str) -> None:
    """When SIGTERM arrives, write the clock to ``path``, then die of SIGTERM as before.

    The time a sibling of a failed worker is told to stop: the supervisor has seen the
    failure and acted on it.
    """

    def on_term(signum: int, frame: object) -> None:
        write_stamp(path)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)


def restart(directory: str) -> None:
    """An elastic job that fails once: attempt 0 fails when all run, attempt 1 succeeds.

    Attempt 0: local rank 0 waits until its siblings run, stamps ``fail`` and exits 1;
    the siblings sleep until the agent stops them. Attempt 1: every rank stamps
    ``start{rank}`` and returns.
    """
    rank = int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    n = int(os.environ["LOCAL_WORLD_SIZE"])
    if attempt > 0:
        write_stamp(os.path.join(directory, f"start{rank}"))
        return
    fifo = os.path.join(directory, "ready")
    if rank == 0:
        wait_ready(fifo, n - 1)
        write_stamp(os.path.join(directory, "fail"))
        os._exit(1)
    signal_ready(fifo)
    time.sleep(WORKER_TTL_S)
