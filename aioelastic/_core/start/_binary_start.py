"""Starting binary workers through the watchdog: the protocol and its launcher.

The watchdog (:mod:`._watchdog`, its process :mod:`..child._watchdog_process`) starts binaries
with ``posix_spawn`` and is their parent. The supervisor sends it one message per batch
of starts (:func:`send_batch`): the command lines and environments, and the stdio of each
worker as fds. Each batch gets a socket of its own (:class:`StartBatch`) on which the
watchdog answers every start as it is made and then reports each worker's exit
(:class:`SpawnedWatch`). :class:`BinaryLauncher` sends a group's starts in batches from
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import select
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio

from ..process import _platform
from ._exit_watch import ExitOutcome, LoopWatch
from ._launchers import Launched, launcher_pool
from ._watchdog import MAX_BATCH, watchdog

__all__ = [
    "MAX_BATCH",
    "BinaryLauncher",
    "BinaryStart",
    "SpawnedWatch",
    "StartBatch",
    "decode_env",
    "send_batch",
]

_MAX_MSG = 1 << 16


@dataclass(frozen=True)
class BinaryStart:
    """One binary worker for :func:`send_batch`: its command line, environment, stdio."""

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
        self, answers: socket.socket | None, argv0s: list[str], failure: Exception
    ) -> None:
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
        watchdog.adopt(pid)
        try:
            # Opened while the watchdog still holds the worker unreaped: the pidfd names it.
            pidfd = _platform.pidfd_open(pid)
        except OSError as exc:
            # EMFILE: nothing could stop it later, so it is stopped now.
            _platform.signal_group(pid, signal.SIGKILL)
            watchdog.release(pid)
            watchdog.disown(pid)
            return exc
        assert self._loop is not None
        watch = SpawnedWatch(pid, self, pidfd, watchdog.release, self._loop)
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


def send_batch(
    base_env: dict[str, str], batch: Sequence[BinaryStart], *, block: bool
) -> StartBatch:
    """Send one start message (at most :data:`MAX_BATCH` starts); its answers follow.

    ``base_env`` is the environment every start's ``env`` is laid over. With
    ``block=False`` nothing waits (see :meth:`~._watchdog.Watchdog.send_start`).

    Raises:
        BlockingIOError: only with ``block=False``: nothing was sent.
    """
    # Two stacks, as after a failed start: ``ours`` always closes (the fds sent are the
    # watchdog's copies), ``on_failure`` closes our answer socket unless the batch went.
    with contextlib.ExitStack() as ours, contextlib.ExitStack() as on_failure:
        try:
            answers, their_answers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            on_failure.callback(answers.close)
            ours.callback(their_answers.close)
            cwd = os.open(".", os.O_PATH | os.O_CLOEXEC)
            ours.callback(os.close, cwd)
            fds = [cwd, their_answers.fileno()]
            entries = []
            for start in batch:
                fds += (start.stdout_fd, start.stderr_fd)
                if start.stdin_fd is not None:
                    fds.append(start.stdin_fd)
                argv = [os.fsdecode(a) for a in start.argv]
                entries.append((argv, dict(start.env), start.stdin_fd is not None))
        except Exception as exc:
            return StartBatch(None, [str(s.argv[0]) for s in batch], exc)
        argv0s = [argv[0] for argv, _, _ in entries]
        try:
            watchdog.send_start(marshal.dumps((base_env, entries)), fds, block=block)
        except Exception as exc:
            if isinstance(exc, BlockingIOError) and not block:
                raise
            return StartBatch(None, argv0s, exc)
        on_failure.pop_all()
    failure = RuntimeError(f"the watchdog died while starting {argv0s[0]!r}")
    return StartBatch(answers, argv0s, failure)


class BinaryLauncher:
    """Starts the binary workers of one group in batches, from the event loop itself.

    The group's set-up hands each start over with :meth:`submit` and later awaits its
    process. The first start is sent to the watchdog at once; the starts handed over
    while a batch is in flight wait for its answers and then go together, in as few
    messages as the watchdog takes (group commit). The watchdog answers each worker as
    it is made, on the batch's own socket, which the event loop reads like any other
    file: the loop sets up the next workers and puts the made ones to use while the
    watchdog spawns on, and no thread is involved. (A thread would be: each of its
    hand-offs waits for the GIL while the loop is busy setting up workers, up to a
    switch interval of 5 ms each time, which made a group's first start take 20 ms.)
    Only when the message cannot be sent without waiting (the watchdog not running,
    its socket full) is it sent from a launcher thread.

    The watchdog starts each binary (no shell) in a new process group that dies with us:
    no ``fork()`` of this possibly large process, and the parent-death guarantee without
    a ``preexec_fn``. A start's ``stdout_fd`` of ``1`` means our *current* stdout, not
    the one the watchdog had when it started.
    """

    def __init__(self, base_env: Mapping[str, str]) -> None:
        #: The environment every worker starts from (each start's ``env`` is laid over it).
        self._base_env = decode_env(base_env)
        self._pending: list[tuple[BinaryStart, asyncio.Future[Launched]]] = []
        #: Batches sent whose answers are still coming.
        self._in_flight = 0

    def submit(self, start: BinaryStart) -> asyncio.Future[Launched]:
        """Hand ``start`` over; the future gets its process once its batch was started.

        The future always completes: the batch in flight answers (or fails), and then
        this one goes. Its exception: :class:`OSError`, the binary could not be executed
        (the errno of ``posix_spawn``); :class:`RuntimeError`, the watchdog died while
        starting it.
        """
        future: asyncio.Future[Launched] = asyncio.get_running_loop().create_future()
        self._pending.append((start, future))
        if not self._in_flight:
            self._flush()
        return future

    def send_pending(self) -> None:
        """Send the starts handed over so far now, without waiting for the batch in flight.

        For the group's last starts: nothing more will join them, and waiting for the
        batch in flight to be answered would leave the watchdog idle for a round trip
        (its answers read, then this batch sent and received) between the two.
        """
        if self._pending:
            self._flush()

    async def start(self, start: BinaryStart) -> Launched:
        """The process of ``start`` (see :meth:`submit`)."""
        future = self.submit(start)
        # Shielded: a process that may exist must reach the caller, who records it.
        with anyio.CancelScope(shield=True):
            launched = await future
        return launched

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        loop = asyncio.get_running_loop()
        for first in range(0, len(pending), MAX_BATCH):
            self._in_flight += 1
            self._send(loop, pending[first : first + MAX_BATCH])

    def _send(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[BinaryStart, asyncio.Future[Launched]]],
    ) -> None:
        starts = [start for start, _ in batch]
        try:
            sent = send_batch(self._base_env, starts, block=False)
        except BlockingIOError:
            pass
        else:
            self._listen(loop, sent, batch)
            return

        def on_thread_done(done: Future[StartBatch]) -> None:
            loop.call_soon_threadsafe(self._listen_or_fail, loop, done, batch)

        try:
            launcher_pool().submit(
                send_batch, self._base_env, starts, block=True
            ).add_done_callback(on_thread_done)
        except BaseException as exc:
            # Whatever stopped the hand-off is the batch's outcome: each start's future
            # must be settled, or the task awaiting it (shielded) would wait forever.
            self._answered(batch, exc)

    def _listen_or_fail(
        self,
        loop: asyncio.AbstractEventLoop,
        done: Future[StartBatch],
        batch: list[tuple[BinaryStart, asyncio.Future[Launched]]],
    ) -> None:
        error = done.exception()
        if error is not None:
            self._answered(batch, error)
        else:
            self._listen(loop, done.result(), batch)

    def _listen(
        self,
        loop: asyncio.AbstractEventLoop,
        sent: StartBatch,
        batch: list[tuple[BinaryStart, asyncio.Future[Launched]]],
    ) -> None:
        unanswered = iter(batch)

        def on_answers(outcomes: list[Spawned], last: bool) -> None:
            for outcome in outcomes:
                _, future = next(unanswered)
                _settle(future, _launched(outcome))
            if last:
                self._answered(list(unanswered), None)

        sent.listen(loop, on_answers)

    def _answered(
        self,
        batch: list[tuple[BinaryStart, asyncio.Future[Launched]]],
        error: BaseException | None,
    ) -> None:
        for _, future in batch:
            _settle(future, error or RuntimeError("binary start was not answered"))
        self._in_flight -= 1
        if not self._in_flight:
            self._flush()


def _settle(future: asyncio.Future[Launched], result: Launched | BaseException) -> None:
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _launched(outcome: Spawned) -> Launched | BaseException:
    """A watchdog start's outcome as a :class:`Launched` (or the error, as it is)."""
    return outcome if isinstance(outcome, BaseException) else Launched(*outcome)
