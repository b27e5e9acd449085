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
MAX_BATCH = 32
#: Start requests up to this size travel in the message itself, larger ones in a memfd.
_INLINE_MAX = 1 << 16


@dataclass
class _Start:
    """One binary start waiting for the watchdog's answer."""

    argv: list[str]
    env: dict[str, str]
    #: stdout, stderr, cwd (O_PATH), status pipe write end, then stdin if the worker has
    #: one of its own (else ``/dev/null``): sent, then closed by the caller (but stdin).
    fds: tuple[int, ...]
    answer: tuple[Any, ...] | BaseException | None = None


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
        self._queue: list[_Start] = []
        self._queue_ready = threading.Condition()
        self._sending = False
        #: Binary workers the watchdog started and watches already, until released.
        self._spawned: set[int] = set()

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
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout_fd: int,
        stderr_fd: int,
        stdin_fd: int | None = None,
    ) -> tuple[int, SpawnedWatch]:
        """Blocking: have the watchdog start a binary worker (see ``_watchdog_process``).

        Concurrent calls (one per launcher thread) share round trips: whichever thread
        finds no exchange in flight sends every start queued so far in one message.

        Raises:
            OSError: the binary could not be executed (the errno of ``posix_spawn``).
            RuntimeError: the watchdog died while starting it.
        """
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        cwd = os.open(".", os.O_PATH | os.O_CLOEXEC)
        fds: tuple[int, ...] = (stdout_fd, stderr_fd, cwd, status_w)
        if stdin_fd is not None:
            fds += (stdin_fd,)
        request = _Start([os.fsdecode(a) for a in argv], dict(env), fds)
        try:
            answer = self._submit(request)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
            os.close(cwd)
        if answer[0] == "P":
            pid = int(answer[1])
            self._spawned.add(pid)
            return pid, SpawnedWatch(pid, status_r, _platform.pidfd_open(pid), self._release)
        os.close(status_r)
        raise OSError(int(answer[1]), f"{answer[2]} (starting {request.argv[0]!r})")

    def _submit(self, request: _Start) -> tuple[Any, ...]:
        with self._queue_ready:
            self._queue.append(request)
            while request.answer is None:
                if self._sending:
                    self._queue_ready.wait()
                    continue
                batch = self._queue[:MAX_BATCH]
                del self._queue[:MAX_BATCH]
                self._sending = True
                self._queue_ready.release()
                answers: list[tuple[Any, ...] | BaseException]
                try:
                    answers = list(self._exchange(batch))
                except BaseException as exc:
                    answers = [exc] * len(batch)
                finally:
                    self._queue_ready.acquire()
                    self._sending = False
                    self._queue_ready.notify_all()
                for start, answer in zip(batch, answers, strict=True):
                    start.answer = answer
        if isinstance(request.answer, BaseException):
            raise request.answer
        return request.answer

    def _exchange(self, batch: list[_Start]) -> list[tuple[Any, ...]]:
        body = marshal.dumps([(start.argv, start.env, len(start.fds) > 4) for start in batch])
        fds = [fd for start in batch for fd in start.fds]
        with self._lock:
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
            reply = sock.recv(_MAX_MSG)
        if not reply:
            raise RuntimeError(f"the watchdog died while starting {batch[0].argv[0]!r}")
        answers: list[tuple[Any, ...]] = marshal.loads(reply)
        return answers

    def _release(self, pid: int) -> None:
        self._spawned.discard(pid)
        self._send(b"R%d" % pid)

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the supervisor dies before :meth:`forget`."""
        if pgid in self._spawned:
            return  # the watchdog recorded the group itself when it started the worker
        self._send(b"+%d" % pgid)

    def forget(self, pgid: int) -> None:
        """Stop watching ``pgid`` (its leader was reaped)."""
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
        self._queue = []
        self._queue_ready = threading.Condition()
        self._sending = False
        self._spawned = set()


#: The watchdog of this process (started on first use).
watchdog = Watchdog()
atexit.register(watchdog.stop)
forget_in_child(watchdog._forget_in_child)
