"""A tiny process that SIGKILLs every worker's process group if the supervisor dies.

``PR_SET_PDEATHSIG`` takes the workers down with a SIGKILLed supervisor, but not their
children (data-loader processes, a shell's pipeline): those would be re-parented and run
on. The watchdog closes that gap. It is one small interpreter per supervising process,
started on first use, that learns each worker's process group as it starts and forgets it
once teardown reaped the worker. When the supervisor dies — however, SIGKILL included —
the kernel sends the watchdog its parent-death signal and it kills every group it still
knows, then exits. A normal exit of the supervisor closes the pipe, which has the same
effect for groups nobody closed.

It runs with ``-S`` (no site import) and reads one line per change: ``+<pgid>`` or
``-<pgid>``. It ignores SIGINT and sits in its own process group so that Ctrl-C at a
terminal, which reaches the supervisor's group, does not remove the safety net first.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading

from . import _platform, _subreaper

_SOURCE = r"""
import ctypes, ctypes.util, os, signal, sys
parent, deathsig = int(sys.argv[1]), signal.SIGUSR1
groups = set()
def kill_all(*_):
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
signal.signal(deathsig, kill_all)
signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    libc.prctl(1, int(deathsig), 0, 0, 0)
except OSError:
    pass
if os.getppid() != parent:
    kill_all()
sys.stdout.write("ready\n")
sys.stdout.flush()
for line in sys.stdin.buffer:
    pgid = int(line[1:])
    if line[:1] == b"+":
        groups.add(pgid)
    else:
        groups.discard(pgid)
kill_all()
"""


class Watchdog:
    """The supervisor's handle on its watchdog process."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The watchdog's pid once started."""
        return self._popen.pid if self._popen is not None else None

    def ensure_started(self) -> None:
        """Blocking; call on a launcher thread (the parent-death signal follows it)."""
        with self._lock:
            if self._popen is not None and self._popen.poll() is None:
                return
            with _subreaper.creation_guard():
                popen = subprocess.Popen(
                    [sys.executable, "-S", "-c", _SOURCE, str(os.getpid())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    close_fds=True,
                    **_platform.new_group_popen_kwargs(),
                )
                _subreaper.own_children.add(popen.pid)
            assert popen.stdout is not None
            # Wait for its prctl: only then does it outlive us long enough to act.
            popen.stdout.readline()
            popen.stdout.close()
            self._popen = popen

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the supervisor dies before :meth:`forget`."""
        self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        """Stop watching ``pgid`` (its leader was reaped)."""
        self._send(b"-%d\n" % pgid)

    def _send(self, line: bytes) -> None:
        popen = self._popen
        if popen is None or popen.stdin is None:
            return
        try:
            popen.stdin.write(line)
            popen.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the watchdog is gone; workers still have their parent-death signal

    def fileno(self) -> int | None:
        """The fd of the pipe to the watchdog (a forked worker must close it)."""
        popen = self._popen
        if popen is None or popen.stdin is None or popen.stdin.closed:
            return None
        return popen.stdin.fileno()

    def stop(self) -> None:
        """Close the pipe and reap the watchdog (it exits on end-of-file)."""
        with self._lock:
            popen, self._popen = self._popen, None
        if popen is None:
            return
        if popen.stdin is not None:
            popen.stdin.close()
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            popen.send_signal(signal.SIGKILL)
            popen.wait()
        _subreaper.own_children.discard(popen.pid)


watchdog = Watchdog()
atexit.register(watchdog.stop)


def _forget_in_child() -> None:
    # The parent's watchdog guards the parent's workers; a forked child that supervises
    # workers of its own starts its own watchdog (and closes the inherited pipe).
    watchdog._popen = None
    watchdog._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
