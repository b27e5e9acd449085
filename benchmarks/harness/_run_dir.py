"""Where a benchmark run makes its files: every system's log directories and TMPDIR.

Light on purpose: ``benchmarks.cpu_split`` imports it into the process it measures.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: Where the run directory goes by default (see :func:`run_parent`).
SHM = Path("/dev/shm")


def filesystem_of(path: Path) -> str:
    """The type of the file system ``path`` is on (``tmpfs``, ``ext4``...), from /proc/mounts."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def run_parent(requested: Path | None) -> Path:
    """Where the run directory is made: ``--run-dir``, else tmpfs, else the temp directory.

    Every system writes its per-rank log directories there (torch makes one per rank as
    we do). On a disk those cost whatever the file system's state makes them: on this
    project's ext4 test machine a ``mkdir`` in ``/tmp`` took 20 us or 1 ms of kernel
    time depending on the directory's block group, which is noise about the file
    system, not about supervisors. tmpfs keeps it out of every side alike.
    """
    if requested is not None:
        if not requested.is_dir() or not os.access(requested, os.W_OK | os.X_OK):
            raise SystemExit(f"--run-dir {requested}: not a writable directory; create it first")
        return requested
    if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK) and filesystem_of(SHM) == "tmpfs":
        return SHM
    return Path(tempfile.gettempdir())
