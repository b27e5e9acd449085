"""Make sure the suite leaves no process behind, without polling for it.

The harness makes itself a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): every
process its drivers leave behind (a fork server still shutting down, a worker a system
under test failed to stop) is re-parented to the harness instead of to PID 1, and the
harness waits for each of them with a blocking ``waitpid``. Stragglers still alive after a
timeout are SIGKILLed by pid: they are all our descendants.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants; False where the kernel does not support it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return False
    return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


def _children() -> list[int]:
    from aioelastic._core.process._platform import proc_stat

    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = proc_stat(entry, 2)
        if fields is not None and int(fields[1]) == me:
            found.append(int(entry))
    return found


def reap_all(timeout: float = 15.0) -> list[int]:
    """Wait until this process has no child left; SIGKILL those alive after ``timeout``.

    Returns:
        The pids that had to be killed (a leak by some system, worth reporting).
    """
    killed: list[int] = []
    done = threading.Event()

    def kill_stragglers() -> None:
        if done.wait(timeout):
            return
        # Only reached when something refuses to go: keep killing whatever is (or has
        # newly been re-parented) here until the waiting loop below finishes.
        while not done.is_set():
            for pid in _children():
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            done.wait(1.0)

    killer = threading.Thread(target=kill_stragglers, name="bench-reaper", daemon=True)
    killer.start()
    try:
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return sorted(set(killed))
    finally:
        done.set()
        killer.join()
