"""A tiny process that SIGKILLs every worker's process group if the supervisor dies.

``PR_SET_PDEATHSIG`` takes the workers down with a SIGKILLed supervisor, but not their
children (data-loader processes, a shell's pipeline): those would be re-parented and run
on. The watchdog closes that gap. It is one small interpreter per supervising process,
started on first use, that learns each worker's process group as it starts and forgets it
once teardown reaped the worker. When the supervisor dies — however, SIGKILL included —
the kernel sends the watchdog its parent-death signal and it kills every group it still
knows, then exits. A normal exit of the supervisor closes the socket, which has the same
effect for groups nobody closed.

It also *starts binary workers*. A parent-death signal for a binary we do not control has
to be set between fork and exec, and a ``preexec_fn`` for that forces a full ``fork()``
of the supervisor — tens of milliseconds once it has imported torch. The watchdog starts
them with ``posix_spawn`` instead (no copy of anything) and is their parent, so their
death with the supervisor is its job: it records each new group before it handles the
parent-death signal (which it holds blocked while spawning), so there is no window in
which a SIGKILLed supervisor leaves an orphan. What a binary worker inherits from its
parent that is not passed with each start (resource limits, umask, scheduling) is
therefore the supervisor's as of the watchdog's start; the current directory, the
environment and stdio are sent with every start.

One window is left: a worker whose ``posix_spawn`` is under way when the *watchdog*
itself is SIGKILLed (not the supervisor) exists before its pid could be answered, so
nobody knows to stop it; the workers answered before are stopped (see
:class:`~._binary_start.SpawnedWatch`) and the rest of the batch is reported as not
started. The start protocol itself (the messages, their answers, the batches) lives with
its launcher in :mod:`._binary_start`; this module is the handle on the process.

It runs with ``-I -S`` (no site import, stdlib only; see :mod:`..child._watchdog_process`). It
sits in its own process group and holds the job's signals blocked (SIGINT, SIGTERM,
SIGUSR1..., ``_platform.JOB_SIGNALS``): neither Ctrl-C at a terminal, which reaches the
supervisor's group, nor a scheduler's SIGTERM to every process of the job removes the
safety net first, or takes the workers down before the supervisor's teardown.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ..process import _platform, _subreaper
from ..process._runtime import forget_in_child, runtime
from ._helper_messages import HelperMessages

_SCRIPT = str(Path(__file__).parent.parent / "child" / "_watchdog_process.py")
_MAX_MSG = 1 << 16
#: Starts per message: up to 3 fds each and 3 more (cwd, answer socket, memfd), well
#: under the kernel's 253 fds per SCM_RIGHTS message. The watchdog process is told it
#: when it starts, so this is the one place it is set.
MAX_BATCH = 62
#: Start requests up to this size travel in the message itself, larger ones in a memfd.
_INLINE_MAX = 1 << 16


class Watchdog:
    """The supervisor's handle on its watchdog process."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        #: Binary workers the watchdog started and watches already, until forgotten.
        self._spawned: set[int] = set()
        #: Released binary workers whose ``R`` is sent at the end of this loop turn.
        self._releases: list[int] = []
        #: Watch, forget and release messages, sent without ever waiting.
        self._messages = HelperMessages(lambda: self._sock)

    def __repr__(self) -> str:
        state = "running" if self.running() else "not running"
        return f"<Watchdog pid={self.pid} {state} binaries={len(self._spawned)}>"

    @property
    def pid(self) -> int | None:
        """The watchdog's pid once started."""
        return self._popen.pid if self._popen is not None else None

    def ensure_started(self) -> None:
        """Blocking; call on a launcher thread (the parent-death signal follows it)."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> socket.socket:
        if self._sock is not None and self._popen is not None and self._popen.poll() is None:
            return self._sock
        self._close()
        with contextlib.ExitStack() as cleanup_on_fail:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            cleanup_on_fail.callback(ours.close)
            # Ours closed once the watchdog holds its copy: left open, it would keep the
            # end-of-file of a watchdog that dies at start from us.
            with theirs, _subreaper.creation_guard():
                popen = subprocess.Popen(
                    [
                        sys.executable,
                        "-I",
                        "-S",
                        _SCRIPT,
                        str(os.getpid()),
                        str(theirs.fileno()),
                        str(MAX_BATCH),
                        ",".join(str(int(sig)) for sig in _platform.JOB_SIGNALS),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                    close_fds=True,
                    **_platform.new_group_popen_kwargs(),
                )
                runtime.own_children.add(popen.pid)
            cleanup_on_fail.callback(_reap_failed_start, popen, ours)
            # Wait for its prctl: only then does it outlive us long enough to act.
            if ours.recv(_MAX_MSG) != b"K":
                cleanup_on_fail.close()  # reaped now, for its exit status
                raise RuntimeError(f"the watchdog process exited at start ({popen.returncode})")
            cleanup_on_fail.pop_all()
        self._popen, self._sock = popen, ours
        return ours

    def send_start(self, body: bytes, fds: list[int], *, block: bool) -> None:
        """Send one start message (its body and the fds it names) to the watchdog.

        With ``block=False`` (the event loop's call) nothing waits: if the watchdog is
        not running, another thread holds it, or its socket is full, this raises
        :class:`BlockingIOError` having sent nothing, and the caller sends from a
        launcher thread with ``block=True`` instead (which also starts the watchdog:
        its parent-death signal follows the thread that started it).

        Raises:
            BlockingIOError: only with ``block=False``, see above.
        """
        if block:
            with self._lock:
                self._send_start(body, fds, block)
            return
        # The event loop never waits for the lock: a launcher thread may hold it while
        # it starts the watchdog (tens of milliseconds).
        if not self._lock.acquire(blocking=False):
            raise BlockingIOError("the watchdog is being started")
        try:
            if not self.running():
                raise BlockingIOError("the watchdog is not running")
            try:
                self._send_start(body, fds, block)
            except BlockingIOError:
                raise BlockingIOError("the watchdog's socket is full") from None
        finally:
            self._lock.release()

    def running(self) -> bool:
        """Whether the watchdog process is up (no start needed); never blocks."""
        return self._sock is not None and self._popen is not None and self._popen.poll() is None

    def _send_start(self, body: bytes, fds: list[int], block: bool) -> None:
        sock = self._ensure_started() if block else self._sock
        assert sock is not None
        flags = 0 if block else socket.MSG_DONTWAIT
        if len(body) < _INLINE_MAX:
            _platform.send_fds(sock, [b"B" + body], fds, flags)
            return
        # Larger than one datagram may be (the socket's send buffer): a memfd.
        memfd = os.memfd_create("aioelastic-spawn", os.MFD_CLOEXEC)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(memfd, view) :]
            _platform.send_fds(sock, [b"M"], [*fds, memfd], flags)
        finally:
            os.close(memfd)

    def adopt(self, pid: int) -> None:
        """The watchdog started ``pid`` and watches its group already (see :meth:`watch`)."""
        self._spawned.add(pid)

    def disown(self, pid: int) -> None:
        """Forget ``pid``, adopted but never handed to :meth:`watch` (it was killed)."""
        self._spawned.discard(pid)

    def release(self, pid: int) -> None:
        """Let the watchdog reap its binary worker ``pid`` (teardown reaped it)."""
        # Its group stays in `_spawned` until forget(): R stops the watchdog watching it.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._messages.send(b"R%d" % pid)  # on a launcher thread
            return
        # Teardown releases a group's workers one after the other in one turn of the
        # loop: one message for all of them, one wake-up of the watchdog. Holding a
        # zombie a moment longer is safe (its pid cannot be reused meanwhile).
        if not self._releases:
            loop.call_soon(self._send_releases)
        self._releases.append(pid)

    def _send_releases(self) -> None:
        pids, self._releases = self._releases, []
        self._messages.send(b"R" + b" ".join(b"%d" % pid for pid in pids))

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the supervisor dies before :meth:`forget`."""
        if pgid in self._spawned:
            return  # the watchdog recorded the group itself when it started the worker
        self._messages.send(b"+%d" % pgid)

    def forget(self, pgid: int) -> None:
        """Stop watching ``pgid`` (its leader was reaped)."""
        if pgid in self._spawned:
            self._spawned.discard(pgid)
            return  # the release (``R``) of a binary worker forgot its group already
        self._messages.send(b"-%d" % pgid)

    def fileno(self) -> int | None:
        """The fd of the socket to the watchdog (a forked worker must close it)."""
        sock = self._sock
        if sock is None or sock.fileno() < 0:
            return None
        return sock.fileno()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def stop(self) -> None:
        """Close the socket and reap the watchdog (it kills what it still watches, and exits)."""
        self._messages.flush(timeout=5)
        with self._lock:
            popen, self._popen = self._popen, None
            self._close()
        if popen is None:
            return
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            popen.send_signal(signal.SIGKILL)
            popen.wait()
        runtime.own_children.discard(popen.pid)

    def _forget_in_child(self) -> None:
        # The parent's watchdog guards the parent's workers; a forked child that
        # supervises workers of its own starts its own watchdog. Closing the inherited
        # socket tells the watchdog nothing (the parent still holds it) but keeps it out
        # of grandchildren. The locks are made anew: another thread may have held one
        # at the fork.
        self._popen = None
        self._close()
        self._lock = threading.Lock()
        self._spawned = set()
        self._releases = []
        self._messages = HelperMessages(lambda: self._sock)


def _reap_failed_start(popen: subprocess.Popen[bytes], ours: socket.socket) -> None:
    """Reap a watchdog whose start failed, once our end is closed (it exits on that)."""
    ours.close()
    popen.wait()
    runtime.own_children.discard(popen.pid)


#: The watchdog of this process (started on first use).
watchdog = Watchdog()
atexit.register(watchdog.stop)
forget_in_child(watchdog._forget_in_child)
