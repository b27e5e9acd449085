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
:class:`SpawnedWatch`) and the rest of the batch is reported as not started.

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

from . import _platform, _subreaper
from ._exit_watch import ExitOutcome, LoopWatch
from ._runtime import forget_in_child, runtime

_SCRIPT = str(Path(__file__).with_name("_watchdog_process.py"))
_MAX_MSG = 1 << 16
#: Starts per message; the watchdog's own limit (fds per SCM_RIGHTS message).
MAX_BATCH = 62
#: Start requests up to this size travel in the message itself, larger ones in a memfd.
_INLINE_MAX = 1 << 16


@dataclass(frozen=True)
class BinaryStart:
    """One binary worker for :meth:`Watchdog.send_batch`: its command line, environment, stdio."""

    argv: Sequence[str]
    #: What the worker's environment adds to (or replaces in) the group's base environment.
    env: Mapping[str, str]
    stdout_fd: int
    stderr_fd: int
    #: The worker's own stdin; ``None``: ``/dev/null``.
    stdin_fd: int | None = None


#: What a :class:`StartBatch` gives per start: the pid and its exit watch, or the error.
Spawned = tuple[int, "SpawnedWatch"] | BaseException
#: Called with each new lot of outcomes, in start order; ``last`` is True once, with the
#: outcomes that complete the batch.
OnAnswers = Callable[[list[Spawned], bool], None]


def decode_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as the str mapping a start message carries (bytes keys/values decoded)."""
    return {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class SpawnedWatch(LoopWatch):
    """Exit of a binary worker the watchdog started, reported on its batch's socket.

    The supervisor also holds a pidfd, opened while the watchdog still held the worker
    (so it names that process, never a reused pid): if the watchdog dies before
    reporting, its workers are orphans nobody would stop, and this kills them before
    reporting them killed.
    """

    def __init__(
        self,
        pid: int,
        batch: StartBatch,
        pidfd: int | None,
        release: Callable[[int], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(pid)
        self._batch: StartBatch | None = batch
        self._pidfd = pidfd
        self._release: Callable[[int], None] | None = release
        # The batch's loop, which reads this watch's report (and a pidfd, if it must).
        self._loop = loop
        #: The exit reported before :meth:`on_exit` was called.
        self._early: ExitOutcome | None = None

    def _begin(self) -> None:
        if self._early is not None:
            assert self._loop is not None
            # Not from inside on_exit: its caller finishes recording the worker first.
            self._loop.call_soon(self._deliver, self._early)

    def reported(self, outcome: ExitOutcome) -> None:
        """The batch read this worker's exit (or learnt how it ended); deliver it."""
        self._batch = None
        if self._watching:
            self._deliver(outcome)
        else:
            self._early = outcome

    def reporter_died(self) -> None:
        """The watchdog died before reporting this exit: make sure the worker is gone."""
        self._batch = None
        returncode = -signal.SIGKILL
        pidfd = self._pidfd
        if pidfd is not None and not _readable(pidfd):
            # Reported killed but still running: the watchdog died, not the worker. While
            # the leader lives, its group id cannot have been reused.
            _platform.signal_group(self.pid, signal.SIGKILL)
            # The reader's step reports (and delivers) itself, so it returns nothing.
            self._read_when_ready(pidfd, lambda: self.reported(returncode))
            return
        if pidfd is None:
            # The same without a pidfd: whether the worker still runs cannot be told, so
            # the report is made true. Teardown counts on an exit reported being real: it
            # signals nobody when every worker exited and their groups look empty.
            _platform.signal_group(self.pid, signal.SIGKILL)
        self.reported(returncode)

    def reap(self) -> None:
        """See :meth:`ExitWatch.reap`."""
        self._stop_reading()
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.forget(self.pid)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        release, self._release = self._release, None
        if release is not None:
            release(self.pid)


class StartBatch:
    """One start message sent to the watchdog; its answers and exits come on a socket of its own.

    The watchdog answers each start, in order, as soon as it is made, then reports each
    started worker's exit on the same socket, and closes it after the last answer and
    report: an end-of-file before that means it died (the starts not answered did not
    happen; the workers not reported are seen to, see :meth:`SpawnedWatch.reporter_died`).
    :meth:`listen` reads it on the event loop until then; a batch whose workers were all
    reaped before their reports needs nothing more and closes it itself.
    """

    def __init__(
        self, owner: Watchdog, answers: socket.socket | None, argv0s: list[str], failure: Exception
    ) -> None:
        self._owner = owner
        self._answers = answers
        self._argv0s = argv0s
        #: What an unanswered start reports (why the batch could not be sent or finished).
        self._failure = failure
        self._next = 0
        #: Started workers whose exit was not read yet, until reaped.
        self._watches: dict[int, SpawnedWatch] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_answers: OnAnswers | None = None

    @property
    def done(self) -> bool:
        """Whether every start of the batch has its outcome."""
        return self._next >= len(self._argv0s)

    def fileno(self) -> int:
        """The answer socket (readable when an answer or the end arrived); -1 if none."""
        return -1 if self._answers is None else self._answers.fileno()

    def listen(self, loop: asyncio.AbstractEventLoop, on_answers: OnAnswers) -> None:
        """Read the batch on ``loop`` from now on; ``on_answers`` gets the starts' outcomes."""
        self._loop, self._on_answers = loop, on_answers
        if self._answers is None:
            self._read()  # not sent: every start fails at once
        else:
            loop.add_reader(self._answers.fileno(), self._read)

    def _read(self) -> None:
        was_done = self.done
        outcomes = self.receive()
        if self._on_answers is not None and (outcomes or self.done != was_done):
            self._on_answers(outcomes, self.done and not was_done)
        self._close_if_finished()

    def receive(self) -> list[Spawned]:
        """The outcomes that arrived: all there are now, without waiting (exits are delivered)."""
        if self._answers is None:
            return [] if self.done else self._fail_rest()  # never sent, or ended already
        outcomes: list[Spawned] = []
        while self._answers is not None:
            try:
                reply = self._answers.recv(_MAX_MSG, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                reply = b""  # as an end-of-file: the watchdog is gone
            try:
                if not reply:
                    outcomes += self._fail_rest()
                    break
                answer = marshal.loads(reply)
                if answer[0] == "X":
                    watch = self._watches.pop(int(answer[1]), None)
                    if watch is not None:
                        watch.reported(int(answer[2]))
                    continue
                index = self._next
                self._next += 1
                outcomes.append(self._spawned(answer, self._argv0s[index]))
            except Exception as exc:
                # A waiting set-up task must never wait forever: what is not answered is
                # not started, and what is not reported is seen to.
                self._failure = exc
                outcomes += self._fail_rest()
        return outcomes

    def _spawned(self, answer: tuple[Any, ...], argv0: str) -> Spawned:
        if answer[0] != "P":
            return OSError(int(answer[1]), f"{answer[2]} (starting {argv0!r})")
        pid = int(answer[1])
        owner = self._owner
        owner._spawned.add(pid)
        try:
            # Opened while the watchdog still holds the worker unreaped: the pidfd names it.
            pidfd = _platform.pidfd_open(pid)
        except OSError as exc:
            # EMFILE: nothing could stop it later, so it is stopped now.
            _platform.signal_group(pid, signal.SIGKILL)
            owner._release(pid)
            owner._spawned.discard(pid)
            return exc
        assert self._loop is not None
        watch = SpawnedWatch(pid, self, pidfd, owner._release, self._loop)
        self._watches[pid] = watch
        return pid, watch

    def _fail_rest(self) -> list[Spawned]:
        """The end of the socket: unanswered starts failed, unreported workers are seen to."""
        if self._answers is not None:
            self._close_socket()
        failed: list[Spawned] = [self._failure] * (len(self._argv0s) - self._next)
        self._next = len(self._argv0s)
        watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.reporter_died()
        return failed

    def forget(self, pid: int) -> None:
        """Worker ``pid`` was reaped: its report is awaited no more (any thread)."""
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop is not None and not on_loop:
            # A launcher thread killing a worker it could not record (kill_and_reap):
            # the reader belongs to the loop.
            loop.call_soon_threadsafe(self._forget, pid)
            return
        self._forget(pid)

    def _forget(self, pid: int) -> None:
        self._watches.pop(pid, None)
        self._close_if_finished()

    def _close_if_finished(self) -> None:
        if self.done and not self._watches and self._answers is not None:
            self._close_socket()

    def _close_socket(self) -> None:
        assert self._answers is not None
        if self._loop is not None:
            # Unregistered while the number still names this socket (see StreamPump).
            self._loop.remove_reader(self._answers.fileno())
        self._answers.close()
        self._answers = None

    def close(self) -> None:
        """Stop reading: unanswered starts fail, unreported workers are seen to (on the loop)."""
        self._fail_rest()


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

    def send_batch(
        self, base_env: dict[str, str], batch: Sequence[BinaryStart], *, block: bool
    ) -> StartBatch:
        """Send one start message (at most :data:`MAX_BATCH` starts); its answers follow.

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
                return self._send_batch_locked(base_env, batch, block)
        # The event loop never waits for the lock: a launcher thread may hold it while
        # it starts the watchdog (tens of milliseconds).
        if not self._lock.acquire(blocking=False):
            raise BlockingIOError("the watchdog is being started")
        try:
            if not self.running():
                raise BlockingIOError("the watchdog is not running")
            return self._send_batch_locked(base_env, batch, block)
        finally:
            self._lock.release()

    def _send_batch_locked(
        self, base_env: dict[str, str], batch: Sequence[BinaryStart], block: bool
    ) -> StartBatch:
        entries = []
        fds: list[int] = []
        answers: socket.socket | None = None
        # Made here and closed below on every path: sent fds are the watchdog's copies.
        ours: list[int] = []
        try:
            answers, their_answers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ours.append(their_answers.detach())
            ours.append(os.open(".", os.O_PATH | os.O_CLOEXEC))
            fds += (ours[-1], ours[-2])
            for start in batch:
                fds += (start.stdout_fd, start.stderr_fd)
                if start.stdin_fd is not None:
                    fds.append(start.stdin_fd)
                argv = [os.fsdecode(a) for a in start.argv]
                entries.append((argv, dict(start.env), start.stdin_fd is not None))
        except BaseException as exc:
            for fd in ours:
                os.close(fd)
            if answers is not None:
                answers.close()
            if not isinstance(exc, Exception):
                raise
            return StartBatch(self, None, [str(s.argv[0]) for s in batch], exc)
        argv0s = [argv[0] for argv, _, _ in entries]
        failure: Exception = RuntimeError(f"the watchdog died while starting {argv0s[0]!r}")
        sent: socket.socket | None = answers
        try:
            self._send_start(marshal.dumps((base_env, entries)), fds, block)
        except Exception as exc:
            answers.close()
            if isinstance(exc, BlockingIOError) and not block:
                raise BlockingIOError("the watchdog's socket is full") from None
            sent, failure = None, exc
        finally:
            for fd in ours:
                os.close(fd)
        return StartBatch(self, sent, argv0s, failure)

    def running(self) -> bool:
        """Whether the watchdog process is up (no start needed); never blocks."""
        return self._sock is not None and self._popen is not None and self._popen.poll() is None

    def _send_start(self, body: bytes, fds: list[int], block: bool) -> None:
        sock = self._ensure_started() if block else self._sock
        assert sock is not None
        flags = 0 if block else socket.MSG_DONTWAIT
        if len(body) < _INLINE_MAX:
            socket.send_fds(sock, [b"B" + body], fds, flags)
            return
        # Larger than one datagram may be (the socket's send buffer): a memfd.
        memfd = os.memfd_create("aioelastic-spawn", os.MFD_CLOEXEC)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(memfd, view) :]
            socket.send_fds(sock, [b"M"], [*fds, memfd], flags)
        finally:
            os.close(memfd)

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
