"""The clock every process of a benchmark reads, and the stamps workers write with it.

Every process (driver, worker, grandchild) reads the same clock, ``CLOCK_MONOTONIC``,
which on Linux is system-wide, so a worker's stamp and its supervisor's stamp can be
subtracted. Workers write their own stamps into files; nothing polls for them: the driver
reads the files after the repetition is over.

This module must stay importable without torch and without aioelastic: workers import it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Longest a benchmark worker that waits "forever" lives, so that no bug in a supervisor
#: under test can leave a worker running for long after the suite.
WORKER_TTL_S = 300.0


def now_ns() -> int:
    """The shared clock, in nanoseconds."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def seconds(ns: int) -> float:
    """Nanoseconds to float seconds."""
    return ns / 1e9


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
