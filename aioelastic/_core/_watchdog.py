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

It runs with ``-I -S`` (no site import, stdlib only; see ``_watchdog_process``). It
ignores SIGINT and sits in its own process group so that Ctrl-C at a terminal, which
reaches the supervisor's group, does not remove the safety net first.
"""

from __future__ import annotations

import asyncio
import atexit
import marshal
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from . import _platform, _subreaper
from ._exit_watch import StatusPipeWatch
from ._runtime import forget_in_child, runtime

_SCRIPT = str(Path(__file__).with_name("_watchdog_process.py"))
_MAX_MSG = 1 << 16
#: Starts per message; the watchdog's own limit (fds per SCM_RIGHTS message).
MAX_BATCH = 62
#: Start requests up to this size travel in the message itself, larger ones in a memfd.
_INLINE_MAX = 1 << 16


@dataclass(frozen=True)
class BinaryStart:
    """One binary worker for :meth:`Watchdog.spawn`: its command line, environment, stdio."""

    argv: Sequence[str]
    #: What the worker's environment adds to (or replaces in) the group's base environment.
    env: Mapping[str, str]
    stdout_fd: int
    stderr_fd: int
    #: The worker's own stdin; ``None``: ``/dev/null``.
    stdin_fd: int | None = None


#: What :meth:`Watchdog.spawn` gives per start: the pid and its exit watch, or the error.
Spawned = tuple[int, "SpawnedWatch"] | BaseException


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class SpawnedWatch(StatusPipeWatch):
    """Exit of a binary worker the watchdog started, reported through its status pipe.

    The supervisor also holds a pidfd, opened while the watchdog still held the worker
    (so it names that process, never a reused pid): if the watchdog dies before
    reporting, its workers are orphans nobody would stop, and this kills them before
    reporting them killed.
    """

    def __init__(
        self, pid: int, status_fd: int, pidfd: int | None, release: Callable[[int], None]
    ) -> None:
        super().__init__(pid, status_fd, release)
        self._pidfd = pidfd

    async def wait(self) -> int:
        """See :meth:`ExitWatch.wait`."""
        returncode = await super().wait()
        pidfd = self._pidfd
        if returncode == -signal.SIGKILL and pidfd is not None and not _readable(pidfd):
            # Reported killed but still running: the watchdog died, not the worker. While
            # the leader lives, its group id cannot have been reused.
            _platform.signal_group(self.pid, signal.SIGKILL)
            await anyio.wait_readable(pidfd)
        return returncode

    def reap(self) -> None:
        """See :meth:`ExitWatch.reap`."""
        super().reap()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


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
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with _subreaper.creation_guard():
                popen = subprocess.Popen(
                    [sys.executable, "-I", "-S", _SCRIPT, str(os.getpid()), str(theirs.fileno())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                    close_fds=True,
                    **_platform.new_group_popen_kwargs(),
                )
                runtime.own_children.add(popen.pid)
        finally:
            theirs.close()
        # Wait for its prctl: only then does it outlive us long enough to act.
        if ours.recv(_MAX_MSG) != b"K":
            ours.close()
            popen.wait()
            runtime.own_children.discard(popen.pid)
            raise RuntimeError(f"the watchdog process exited at start ({popen.returncode})")
        self._popen, self._sock = popen, ours
        return ours

    def spawn(
        self,
        base_env: Mapping[str, str],
        starts: Sequence[BinaryStart],
        on_spawned: Callable[[int, Spawned], None] | None = None,
    ) -> list[Spawned]:
        """Blocking: have the watchdog start binary workers (see ``_watchdog_process``).

        One message per :data:`MAX_BATCH` starts, not per worker; the watchdog answers
        each start as soon as it is made, so ``on_spawned`` can put the first workers to
        use while it still spawns the others. The stdio fds of each start are sent, not
        taken over (the caller still closes them).

        Args:
            base_env: The environment every worker starts from (sent once per message).
            starts: The workers; each one's ``env`` is laid over ``base_env``.
            on_spawned: Called (on this thread) with each start's index and outcome as
                soon as it is known.

        Returns:
            Per start, in order: ``(pid, watch)``, or the error that kept it from running:
            an :class:`OSError` with the errno of ``posix_spawn`` (the binary could not be
            executed), a :class:`RuntimeError` (the watchdog died while starting it).
        """
        base = {os.fsdecode(k): os.fsdecode(v) for k, v in base_env.items()}
        spawned: list[Spawned] = []

        def report(outcome: Spawned) -> None:
            if on_spawned is not None:
                on_spawned(len(spawned), outcome)
            spawned.append(outcome)

        for first in range(0, len(starts), MAX_BATCH):
            self._spawn_batch(base, starts[first : first + MAX_BATCH], report)
        return spawned

    def _spawn_batch(
        self,
        base_env: dict[str, str],
        batch: Sequence[BinaryStart],
        report: Callable[[Spawned], None],
    ) -> None:
        entries = []
        fds: list[int] = []
        status_rs: list[int] = []
        # Made here and closed below on every path: sent fds are the watchdog's copies.
        ours: list[int] = []
        try:
            ours.append(os.open(".", os.O_PATH | os.O_CLOEXEC))
            fds.append(ours[-1])
            for start in batch:
                status_r, status_w = os.pipe2(os.O_CLOEXEC)
                status_rs.append(status_r)
                ours.append(status_w)
                fds += (start.stdout_fd, start.stderr_fd, status_w)
                if start.stdin_fd is not None:
                    fds.append(start.stdin_fd)
                argv = [os.fsdecode(a) for a in start.argv]
                entries.append((argv, dict(start.env), start.stdin_fd is not None))
        except BaseException as exc:
            for fd in [*status_rs, *ours]:
                os.close(fd)
            if not isinstance(exc, Exception):
                raise
            for _ in batch:
                report(exc)
            return
        failure: Exception = RuntimeError(f"the watchdog died while starting {entries[0][0][0]!r}")
        with self._lock:
            sock: socket.socket | None
            try:
                sock = self._send_batch(marshal.dumps((base_env, entries)), fds)
            except Exception as exc:
                sock, failure = None, exc
            finally:
                for fd in ours:
                    os.close(fd)
            for status_r, (argv, _, _) in zip(status_rs, entries, strict=True):
                reply = sock.recv(_MAX_MSG) if sock is not None else b""
                if reply:
                    report(self._spawned_one(marshal.loads(reply), status_r, argv[0]))
                    continue
                sock = None  # the rest of the batch was not started either
                os.close(status_r)
                report(failure)

    def _send_batch(self, body: bytes, fds: list[int]) -> socket.socket:
        sock = self._ensure_started()
        if len(body) < _INLINE_MAX:
            socket.send_fds(sock, [b"B" + body], fds)
        else:
            # Larger than one datagram may be (the socket's send buffer): a memfd.
            memfd = os.memfd_create("aioelastic-spawn", os.MFD_CLOEXEC)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(memfd, view) :]
                socket.send_fds(sock, [b"M"], [*fds, memfd])
            finally:
                os.close(memfd)
        return sock

    def _spawned_one(self, answer: tuple[Any, ...], status_r: int, argv0: str) -> Spawned:
        if answer[0] != "P":
            os.close(status_r)
            return OSError(int(answer[1]), f"{answer[2]} (starting {argv0!r})")
        pid = int(answer[1])
        self._spawned.add(pid)
        try:
            # Opened while the watchdog still holds the worker unreaped: the pidfd names it.
            pidfd = _platform.pidfd_open(pid)
        except OSError as exc:
            # EMFILE: nothing could stop it later, so it is stopped now.
            _platform.signal_group(pid, signal.SIGKILL)
            os.close(status_r)
            self._release(pid)
            self._spawned.discard(pid)
            return exc
        return pid, SpawnedWatch(pid, status_r, pidfd, self._release)

    def _release(self, pid: int) -> None:
        # Its group stays in `_spawned` until forget(): R stops the watchdog watching it.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._send(b"R%d" % pid)  # on a launcher thread
            return
        # Teardown releases a group's workers one after the other in one turn of the
        # loop: one message for all of them, one wake-up of the watchdog. Holding a
        # zombie a moment longer is safe (its pid cannot be reused meanwhile).
        if not self._releases:
            loop.call_soon(self._send_releases)
        self._releases.append(pid)

    def _send_releases(self) -> None:
        pids, self._releases = self._releases, []
        self._send(b"R" + b" ".join(b"%d" % pid for pid in pids))

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the supervisor dies before :meth:`forget`."""
        if pgid in self._spawned:
            return  # the watchdog recorded the group itself when it started the worker
        self._send(b"+%d" % pgid)

    def forget(self, pgid: int) -> None:
        """Stop watching ``pgid`` (its leader was reaped)."""
        if pgid in self._spawned:
            self._spawned.discard(pgid)
            return  # the release (``R``) of a binary worker forgot its group already
        self._send(b"-%d" % pgid)

    def _send(self, message: bytes) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.sendmsg([message])
        except OSError:
            pass  # the watchdog is gone; workers still have their parent-death signal

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


#: The watchdog of this process (started on first use).
watchdog = Watchdog()
atexit.register(watchdog.stop)
forget_in_child(watchdog._forget_in_child)
