"""Clock, worker timestamps and the ready barrier shared by drivers and workers.

Every process (driver, worker, grandchild) reads the same clock, ``CLOCK_MONOTONIC``,
which on Linux is system-wide, so a worker's stamp and its supervisor's stamp can be
subtracted. Workers write their own stamps into files; nothing polls for them: the driver
reads the files after the repetition is over.

This module must stay importable without torch and without aioelastic.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

#: Longest a benchmark worker that waits "forever" lives, so that no bug in a supervisor
#: under test can leave a worker running for long after the suite.
WORKER_TTL_S = 300.0


def now_ns() -> int:
    """The shared clock, in nanoseconds."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def write_stamp(path: str | os.PathLike[str], stamp: int | None = None) -> None:
    """Write ``stamp`` (default: now) to ``path`` in one ``write``."""
    value = now_ns() if stamp is None else stamp
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def read_stamp(path: str | os.PathLike[str]) -> int:
    """Read a stamp written by :func:`write_stamp`."""
    return int(Path(path).read_text())


def read_stamps(directory: Path, prefix: str, n: int, first: int = 0) -> list[int]:
    """The stamps ``{prefix}{rank}`` for ranks ``first..n-1``.

    Raises:
        RuntimeError: a rank wrote no stamp (its worker never reached that point); the
            message names the missing ranks.
    """
    ranks = range(first, n)
    missing = [r for r in ranks if not (directory / f"{prefix}{r}").exists()]
    if missing:
        raise RuntimeError(f"workers {missing} wrote no {prefix!r} stamp in {directory}")
    return [read_stamp(directory / f"{prefix}{r}") for r in ranks]


def seconds(ns: int) -> float:
    """Nanoseconds to float seconds."""
    return ns / 1e9


def make_fifo(path: Path) -> Path:
    """Create the ready FIFO that workers write one byte to once they are running."""
    os.mkfifo(path)
    return path


def wait_ready(path: str | os.PathLike[str], count: int) -> None:
    """Block until ``count`` bytes (one per ready worker) arrived on the FIFO at ``path``.

    The FIFO is opened read-write: a reader that is also a writer never sees EOF between
    two workers' writes, so the read blocks instead of spinning (and workers' write-only
    opens never block).
    """
    if count <= 0:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        got = 0
        while got < count:
            got += len(os.read(fd, count - got))
    finally:
        os.close(fd)


def signal_ready(path: str) -> None:
    """Tell the reader of the FIFO at ``path`` that this worker is running."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"r")
    finally:
        os.close(fd)


def free_port() -> int:
    """A TCP port that was free a moment ago (for launchers' ``--master-port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def thread_count() -> int:
    """Threads of this process right now (from ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads: line in /proc/self/status")


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads, not its children).

    ``CLOCK_PROCESS_CPUTIME_ID`` has nanosecond resolution; ``os.times()`` counts in
    clock ticks (10 ms), too coarse for an idle supervisor.
    """
    return time.process_time()
