"""Failures for the tests of error files and reports: real tracebacks, records, child runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from aioelastic._core.reports._failures import ProcessFailure
from tests.support.paths import REPO

#: The child program that writes, reads and sabotages error files.
ERRORS_CHILD = [sys.executable, "-m", "tests.children.errors"]


def run_errors_child(
    *args: str, error_file: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run a child program to completion; return it and the time its exit was seen."""
    env = dict(os.environ)
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    proc = subprocess.run(
        [*ERRORS_CHILD, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    return proc, time.time()


def _raise(exc: BaseException) -> NoReturn:
    # Tests look for this frame ("in _raise") in the tracebacks they record.
    raise exc


def caught(exc: BaseException) -> BaseException:
    """``exc`` with a real traceback, as an except block would see it."""
    try:
        _raise(exc)
    except BaseException as e:
        return e


def make_failure(rank: int, timestamp: float, **kw: Any) -> ProcessFailure:
    """A ProcessFailure of ``rank`` built by hand (no error file is read)."""
    fields: dict[str, Any] = {
        "local_rank": rank,
        "pid": 1000 + rank,
        "exitcode": 1,
        "error_file": f"/logs/{rank}/error.json",
        "message": f"ValueError: rank {rank}",
        "timestamp": timestamp,
    }
    fields.update(kw)
    return ProcessFailure(**fields)
