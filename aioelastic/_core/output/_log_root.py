"""Temporary log roots: made when a run has no ``log_dir``, removed when nothing is in them.

One rule for every entry point (``start_processes``, the elastic agent, ``aioelastic-run``):

* A run without a log directory gets a fresh one under the system's temporary directory,
  named ``aioelastic_{label}_p{owner pid}_{random}``.
* When the run ends, the root is removed if it holds no file, and kept otherwise: logs and
  error files are the user's, never deleted.
* Error files are written by the workers themselves, so a root must exist before they start
  and cannot be made lazily; a supervisor that is SIGKILLed cannot remove its own. So the
  first temporary root a process makes first removes the *stale* ones: empty roots whose
  owner pid is gone.
  Empty roots never accumulate; a root that holds anything is never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..process._runtime import runtime

logger = logging.getLogger("aioelastic")

_TEMPORARY_ROOT = re.compile(r"aioelastic_.*_p(\d+)_[^_]+")


def make_temporary(label: str) -> Path:
    """A fresh temporary log root for this process (stale empty ones are removed first)."""
    if not runtime.stale_log_roots_swept:
        # Once per process: kept roots (they hold logs) stay in the temporary directory,
        # and looking into every one of them at every start would grow without bound.
        runtime.stale_log_roots_swept = True
        remove_stale()
    return Path(tempfile.mkdtemp(prefix=f"aioelastic_{label}_p{os.getpid()}_"))


def remove_if_empty(root: Path, what: str) -> None:
    """End of a run: remove the temporary ``root`` unless it holds a file (then say where)."""
    try:
        if holds_files(root):
            logger.info("aioelastic: logs and error files of %s kept in %s", what, root)
            return
    except OSError as exc:
        # Cannot look (EMFILE): keep it; a later start removes it if it stayed empty.
        logger.warning("aioelastic: temporary log directory %s kept: %s", root, exc)
        return
    shutil.rmtree(root, ignore_errors=True)


def discard(root: Path) -> None:
    """A temporary root whose group never started: removed whole (it holds only our files)."""
    shutil.rmtree(root, ignore_errors=True)


def remove_stale() -> None:
    """Remove the empty temporary log roots of supervisors that died (SIGKILL, OOM)."""
    tmp = Path(tempfile.gettempdir())
    try:
        entries = list(tmp.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _TEMPORARY_ROOT.fullmatch(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink() and not holds_files(entry):
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def holds_files(root: Path) -> bool:
    """Whether anything but directories is under ``root``.

    Never follows a symbolic link (a worker may leave one to ``/``); a link is content
    to keep, like a file. Stops at the first one found.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        if filenames or any(os.path.islink(os.path.join(dirpath, d)) for d in dirnames):
            return True
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: alive, someone else's
    return True
