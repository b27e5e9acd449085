"""The warm fork server process itself: ``main`` is what its fresh interpreter runs.

It imports the standard library, the preload, and the few modules of ours a forked
worker needs, once, before any fork (not anyio, not the supervisor's side in
:mod:`~aioelastic._core.start._forkserver`): the server's own start is on the path of every
cold start. The supervisor's handle on it, and what it is for, is
:mod:`~aioelastic._core.start._forkserver`.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (message boundaries, fds by SCM_RIGHTS):

* client -> server ``C<stdin><pickled call>`` + fds [answer, stderr_w, result_w, status_w,
  stdout_w, stdin_r]: fork a worker. ``<stdin>`` is one byte: ``I`` when the worker's
  stdin (a terminal's pty) is passed as ``stdin_r``, ``-`` when it is not (the fd list
  then ends at ``stdout_w`` and the worker's stdin is ``/dev/null``). The server answers
  ``P<pid>`` on ``answer``, a socket of this request's own, and closes it. Requests are
  pipelined: the supervisor's event loop sends every worker's request at once and reads
  each answer from its socket (no thread, and the server forks back to back instead of
  waiting for a round trip per worker); an end-of-file on ``answer`` before an answer
  means the server died. The call travels in the message, so the worker finds it in the
  memory it shares with the server at the fork and unpickles it at once: no pipe, and no
  wait for the supervisor's event loop to write one. The server keeps ``status_w`` and
  writes the exit status there when the worker exits (so the supervisor waits on a pipe
  only it and the server hold).
* client -> server ``S<stdin>`` + fds [answer, stderr_w, result_w, status_w, stdout_w,
  stdin_r, payload_r]: the same for a call too large for one message; the worker reads
  it from ``payload_r``, which the supervisor feeds.
* client -> server ``R<pid>``: reap that worker now (no answer).
* client -> server ``W<count>``: keep ``count`` spare workers (at most ``MAX_SPARES``):
  forked ahead while the server is idle, each waits on a socket of its own and becomes
  the worker of the next start request, which then costs no fork. ``Q`` + fds [answer]:
  make the spares now and answer their number.
* end-of-file on the socket: the supervisor is gone; the server lets its spares go and
  reaps them, then exits, and its workers follow through their parent-death signal.
* server -> client ``E<text>`` (on the request's answer socket, or on this one at
  setup): a fork or the setup failed (the server carries on after a failed fork);
  ``U<text>``: the preload left it unsafe to fork (threads, CUDA). The server keeps one
  fd spare, closed only while it receives a request, so that even at its open-file limit
  the answer socket (the first fd) arrives and the error can be told.
"""

from __future__ import annotations

import errno
import gc
import multiprocessing.spawn
import os
import pickle
import resource
import selectors
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from ..process import _platform

# Imported here, once, not in each worker after its fork: the import cost every worker
# ~4 ms of CPU and ~750 pages copied from the memory it shares with us.
from ._bootstrap import forked_worker, reset_inherited_signal_state
from ._huge_pages import fold_into_huge_pages
from ._preload import UnforkablePreloadError, import_preload
from ._status_record import encode_status

_MAX_MSG = 1 << 16
#: The largest pickled call sent inside a start request (the rest of ``_MAX_MSG`` is the
#: request's kind and stdin byte); a larger one goes through a pipe.
INLINE_CALL_MAX = _MAX_MSG - 2
#: The stdin byte of a start request: the worker's stdin is passed, or it is /dev/null.
WITH_STDIN, WITHOUT_STDIN = b"I", b"-"

_PYTHON_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)
"""Signals a fresh interpreter ignores (CPython's startup); all others start at default."""


def _reset_signal_state() -> None:
    """Default dispositions, whatever the supervisor had; only the job's signals blocked.

    A supervisor started with SIGCHLD ignored (a shell or a service can do that) passes
    it on through exec; with SIGCHLD ignored the kernel reaps our workers itself, and
    waitid fails with ECHILD instead of reporting their exit status. Workers inherit
    this state through fork, so they start as a fresh interpreter would (each empties
    the mask). The job's signals are held (see main): set in one call, so that none
    comes unblocked in between (the launcher thread that started us held them too).
    """
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if sig in _PYTHON_IGNORES else signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # real-time signals the C library reserves
    signal.pthread_sigmask(signal.SIG_SETMASK, _platform.JOB_SIGNALS)


def _fork_error_text(error: OSError) -> str:
    """What a failed fork inside the server means, and what to do about it."""
    text = f"the fork server could not fork a worker: {error}"
    if error.errno == errno.EAGAIN:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        return (
            f"{text}; the limit on processes was reached: the per-user limit "
            f"(`ulimit -u`, RLIMIT_NPROC, {limit} here) or the cgroup's pids.max; "
            "raise it or start fewer workers"
        )
    if error.errno == errno.ENOMEM:
        return f"{text}; out of memory: free memory or start fewer workers"
    return text


def _reply_error(sock: socket.socket, text: str) -> None:
    sock.sendmsg([b"E" + text.encode(errors="replace")[: _MAX_MSG - 1]])


def _failure_of(run: Callable[..., object], *args: object) -> BaseException | None:
    """``run(*args)``, the supervisor's code (the preload, its main module): what it raised.

    Anything it raised: a module may call ``sys.exit()`` at import or raise a
    BaseException of its own, and the server must still answer the supervisor (and keep
    serving the calls that do not need that module) instead of ending without a word.
    """
    try:
        run(*args)
    except BaseException as exc:
        # Its traceback from the code it ran on, as when it was caught there.
        frames = exc.__traceback__
        return exc.with_traceback(frames.tb_next if frames is not None else None)
    return None


def _traceback_of(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _prepare_and_preload(prep_data: dict[str, object], preload: tuple[str, ...]) -> None:
    """Adopt the supervisor's ``sys.path`` and directory, then import the preload."""
    multiprocessing.spawn.prepare(prep_data)
    import_preload(preload)


def _answer(fd: int, answer: bytes) -> None:
    """Answer a request on its own socket, then close it (the supervisor may be gone)."""
    try:
        os.write(fd, answer[:_MAX_MSG])
    except OSError:
        pass
    finally:
        os.close(fd)


def _answer_error(fd: int, text: str) -> None:
    _answer(fd, b"E" + text.encode(errors="replace"))


def main(control_fd: int, parent_pid: int) -> None:
    """Entry point of the fork-server process."""
    _platform.die_with_parent(parent_pid)
    # A stop or a user signal is the supervisor's to decide on, not ours: Ctrl-C at a
    # terminal reaches the supervisor's process group, and a scheduler's SIGTERM (or
    # --signal USR1) every process of the job, us included; our dying of it would take
    # down our workers through their parent-death signal before their own handlers ran.
    # Held before the preload, whose threads inherit the mask; each worker empties it.
    _reset_signal_state()
    sock = socket.socket(fileno=control_fd)
    # Opened before the preload, which may use every other fd up to the limit.
    reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    setup_msg, _, _, _ = sock.recvmsg(_MAX_MSG)
    prep_data, preload = pickle.loads(setup_msg)
    # The supervisor's main module is imported when a call first refers to it, not now:
    # most calls come from modules of their own, and importing a script's __main__ (or
    # the module run with -m) would lengthen every cold start (see _Server._main_ready).
    main_prep = {key: prep_data.pop(key) for key in _MAIN_KEYS if key in prep_data}
    # Automatic collections are off while the preload imports: torch's import makes a
    # quarter of a million objects that all live on, and the collections their number
    # triggered (each walking the growing heap) were a tenth of a cold start. Whatever
    # garbage the import leaves is frozen with the rest below, as it would be anyway.
    thresholds = gc.get_threshold()
    gc.set_threshold(0)
    failure = _failure_of(_prepare_and_preload, prep_data, preload)
    if isinstance(failure, UnforkablePreloadError):
        sock.sendmsg([b"U" + str(failure).encode(errors="replace")[: _MAX_MSG - 1]])
        return
    if failure is not None:
        _reply_error(sock, _traceback_of(failure))
        return
    # Every object the preload made is moved out of the collector's reach: a worker's
    # first collections would otherwise walk (and so copy, page by page, from the
    # memory it shares with us) every object of torch's import. No collection first:
    # over torch's objects it would cost a cold start tens of milliseconds.
    gc.freeze()
    if gc.get_threshold()[0] == 0:  # unless the preload chose thresholds of its own
        gc.set_threshold(*thresholds)
    # Before the first fork: the kernel folds no page a child shares with us, and every
    # fork and exit from now on costs a third of what it would (see _huge_pages).
    fold_into_huge_pages()
    sock.sendmsg([b"K"])
    _Server(sock, reserve, main_prep).serve()
    # Finalising an interpreter that imported torch takes a few hundred ms of CPU, spent
    # while the supervisor waits for us (stop(), its own exit) or starts a fresh server
    # beside us. Nothing here needs flushing or releasing: the kernel closes the rest.
    os._exit(0)


#: The preparation data that imports the supervisor's main module (``multiprocessing``'s).
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
#: The most spare workers a server keeps forked ahead.
MAX_SPARES = 64
#: A spare is forked only once no request came for this long (seconds).
_SPARE_QUIET = 0.005
#: What a spare answers once it has its start request; how long the server waits for it.
_SPARE_ACK = b"A"
_SPARE_ACK_TIMEOUT = 5.0
#: The name a waiting spare shows in ``ps`` (``/proc/PID/comm``, 15 characters at most).
SPARE_NAME = "aioelastic-spare"[:15]


@dataclass
class _Spare:
    """A worker forked ahead of its request, waiting on ``sock`` for its call and stdio."""

    pid: int
    sock: socket.socket


@dataclass
class _Handoff:
    """A start request given to a spare, held until the spare acknowledges it."""

    spare: _Spare
    #: The request's fds, as received: [answer, stderr_w, result_w, status_w, stdout_w, ...].
    fds: list[int]
    call: bytes | None
    has_stdin: bool
    #: When an unacknowledged hand-off is given up (the spare is killed).
    deadline: float


def _spare_main(sock: socket.socket, private: list[int], server_pid: int, name: str) -> None:
    """Body of a spare: wait for a start request, then become that worker (never returns)."""
    for fd in private:
        try:
            os.close(fd)
        except OSError:
            pass
    _platform.die_with_parent(server_pid)
    # Done while idle, not once the call came: a quarter of a worker's way to its function.
    # A helper until a call comes, which a job's signals must not end (see main): they
    # stay blocked, as in the server, with no moment unblocked between.
    reset_inherited_signal_state(held=_platform.JOB_SIGNALS)
    try:
        msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 5)
    except OSError:
        os._exit(0)
    if not msg:
        os._exit(0)  # the server let us go (or died): no worker to become
    try:
        sock.send(_SPARE_ACK)
    except OSError:
        os._exit(0)  # the server gave up on us
    _platform.set_process_name(name)
    # A worker now: a signal held while it was a spare acts from here on.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    stderr_w, result_w, stdout_w, *rest = fds
    stdin_r = rest.pop(0) if msg[1:2] == WITH_STDIN else None
    forked_worker(
        parent_pid=server_pid,
        stdout_fd=stdout_w,
        stderr_fd=stderr_w,
        result_fd=result_w,
        close_fds=[sock.fileno()],
        payload=msg[2:] if msg[:1] == b"C" else None,
        payload_fd=rest[0] if rest else None,
        signals_reset=True,
        stdin_fd=stdin_r,
    )


@dataclass
class _Child:
    status_fd: int
    pidfd: int | None


class _Server:
    """The fork server's loop: fork on request, report exits, reap on release."""

    def __init__(self, sock: socket.socket, reserve: int, main_prep: dict[str, object]) -> None:
        self._sock = sock
        #: How to import the supervisor's main module, until a call needed it.
        self._main_prep: dict[str, object] | None = main_prep or None
        #: Why importing it failed (every call that needs it then fails with this).
        self._main_error: str | None = None
        #: An fd kept free, closed only while a request is received (see the protocol).
        self._reserve: int | None = reserve
        self._selector = selectors.DefaultSelector()
        self._children: dict[int, _Child] = {}
        self._lock = threading.Lock()  # guards status writes from fallback threads
        #: Workers forked ahead, each waiting on its socket for a call (see _Spare).
        self._spares: list[_Spare] = []
        #: Requests handed to a spare that has not acknowledged them yet, by its pid.
        self._handoffs: dict[int, _Handoff] = {}
        #: How many spares to keep (the supervisor's last ``W``), and whether making one
        #: failed (then none is made until the next request).
        self._spare_target = 0
        self._spares_failed = False
        self._last_request = 0.0

    def serve(self) -> None:
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        while True:
            # A spare is forked only while nothing else is asked of us (timeout 0), and
            # not within _SPARE_QUIET of a request: a group's requests arrive a few at a
            # time, and each must find the server free, not in the middle of a fork.
            short = len(self._spares) < self._spare_target and not self._spares_failed
            now = time.monotonic()
            timeouts = [self._last_request + _SPARE_QUIET - now] if short else []
            timeouts += (handoff.deadline - now for handoff in self._handoffs.values())
            events = self._selector.select(max(min(timeouts), 0) if timeouts else None)
            if not events and short and not self._handoffs:
                self._fork_spare()
            for key, _ in events:
                if key.data is None:
                    if not self._handle_request():
                        # Our exit is the caller's sign that we are gone: the spares too,
                        # not orphans left for their parent-death signal to end.
                        self._drop_spares(0)
                        return
                elif isinstance(key.data, _Handoff):
                    self._handoff_answered(key.data)
                elif isinstance(key.data, _Spare):
                    self._idle_spare_died(key.data)
                else:
                    self._report_exit(key.data)
            now = time.monotonic()
            for handoff in [h for h in self._handoffs.values() if h.deadline <= now]:
                self._handoff_answered(handoff)  # never acknowledged: stopped, or stuck

    def _handle_request(self) -> bool:
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        try:
            msg, fds, flags, _ = socket.recv_fds(self._sock, _MAX_MSG, 8)
        except ConnectionResetError:
            return False
        if not msg:
            return False
        kind = msg[:1]
        if kind in (b"C", b"S"):
            self._start_request(kind, msg, fds, flags)
        elif kind == b"R":
            self._reap(int(msg[1:]))
        elif kind == b"W":
            self._spare_target = min(int(msg[1:]), MAX_SPARES)
            self._spares_failed = False
            self._drop_spares(self._spare_target)
            # Sent once a group's starts are all made: its spares are forked from now,
            # not after a quiet spell. A group that fails as soon as it started restarts
            # within tens of milliseconds, and a spare not forked by then is a fork on
            # the restart's path.
            self._last_request = 0.0
        elif kind == b"Q" and fds:
            # Make the spares now, not when idle, and say how many there are.
            while len(self._spares) < self._spare_target and not self._spares_failed:
                self._fork_spare()
            for extra in fds[1:]:
                os.close(extra)
            _answer(fds[0], b"%d" % len(self._spares))
        try:
            self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # at the limit with workers' fds: the next request frees one first
        return True

    def _start_request(self, kind: bytes, msg: bytes, fds: list[int], flags: int) -> None:
        # Only starts defer idle work: a teardown's releases (R) are when the spares of
        # the restart that follows must be forked.
        self._last_request = time.monotonic()
        has_stdin = msg[1:2] == WITH_STDIN
        expected = (5 if kind == b"C" else 6) + has_stdin
        problem = None
        if len(fds) < expected:
            # The kernel drops passed fds it cannot install here (MSG_CTRUNC).
            problem = (
                f"the fork server received {max(len(fds) - 1, 0)} of the {expected - 1} "
                "pipes of a worker: its open-file limit (`ulimit -n`, RLIMIT_NOFILE) may "
                "be reached"
            )
        elif flags & socket.MSG_TRUNC:
            problem = f"a start request exceeded the fork server's {_MAX_MSG} bytes"
        if problem is None:
            self._fork_worker(fds, msg[2:] if kind == b"C" else None, has_stdin)
            return
        answer_fd, *rest = fds or [-1]
        for received in rest:
            os.close(received)
        if answer_fd >= 0:
            _answer_error(answer_fd, problem)

    def _private_fds(self) -> list[int]:
        """The server's own fds, which a forked worker or spare must not keep."""
        private = [self._sock.fileno(), self._selector.fileno()]
        for child in self._children.values():
            private.append(child.status_fd)
            if child.pidfd is not None:
                private.append(child.pidfd)
        private += (spare.sock.fileno() for spare in self._spares)
        for handoff in self._handoffs.values():
            private += (handoff.spare.sock.fileno(), *handoff.fds)
        if self._reserve is not None:
            private.append(self._reserve)
        return private

    def _main_ready(self, call: bytes | None) -> str | None:
        """Import the main module before the first call that may refer to it.

        A function or class of the supervisor's script is pickled by the name of its
        module, ``__main__`` (``__mp_main__`` in a spawned process); a call too large to
        travel in the request is not seen here, so it gets the main module in any case.
        Returns why the import failed, if it did.
        """
        if call is not None and b"__main__" not in call:
            return None
        if self._main_prep is not None:
            prep, self._main_prep = self._main_prep, None
            self._drop_spares(0)  # forked without it
            failure = _failure_of(multiprocessing.spawn.prepare, prep)
            if failure is not None:
                self._main_error = (
                    "the fork server could not import the supervisor's main module, "
                    f"which the call refers to: {_traceback_of(failure).strip()}"
                )
        return self._main_error

    def _fork_worker(self, fds: list[int], call: bytes | None, has_stdin: bool) -> None:
        self._spares_failed = False
        answer_fd, stderr_w, result_w, status_w, stdout_w, *rest = fds
        stdin_r = rest.pop(0) if has_stdin else None
        payload_r = rest[0] if rest else None
        problem = self._main_ready(call)
        if problem is not None:
            for received in fds[1:]:
                os.close(received)
            _answer_error(answer_fd, problem)
            return
        if self._hand_to_spare(fds, call, has_stdin):
            return
        private = [*self._private_fds(), *fds]
        server_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError as e:
            # EAGAIN (RLIMIT_NPROC, pids.max) or ENOMEM: this start fails, the server lives.
            for received in fds[1:]:
                os.close(received)
            _answer_error(answer_fd, _fork_error_text(e))
            return
        if pid == 0:
            try:
                forked_worker(
                    parent_pid=server_pid,
                    stdout_fd=stdout_w,
                    stderr_fd=stderr_w,
                    result_fd=result_w,
                    close_fds=private,
                    payload=call,
                    payload_fd=payload_r,
                    stdin_fd=stdin_r,
                )
            finally:
                # Never carry on as a second copy of the server loop, on its socket.
                os._exit(1)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        for fd in (payload_r, stderr_w, result_w, stdout_w, stdin_r):
            if fd is not None:
                os.close(fd)
        self._watch_worker(pid, answer_fd, status_w)

    def _watch_worker(self, pid: int, answer_fd: int, status_w: int) -> None:
        try:
            self._watch(pid, status_w)
        except Exception as e:
            # Nobody could report this worker's exit: it must not run at all.
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            watched = self._children.pop(pid) if pid in self._children else None
            if watched is not None and watched.pidfd is not None:
                os.close(watched.pidfd)
            os.close(status_w)
            _answer_error(
                answer_fd,
                f"the fork server could not watch the worker it forked: {type(e).__name__}: {e}",
            )
            return
        _answer(answer_fd, b"P%d" % pid)

    def _fork_spare(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        private = [*self._private_fds(), ours.fileno()]
        server_pid = os.getpid()
        # Named before the fork, so that the spare is never seen under the server's name.
        name = _platform.process_name()
        _platform.set_process_name(SPARE_NAME)
        try:
            pid = os.fork()
        except OSError:
            # The process limit, memory: no spares until the next request (which forks).
            ours.close()
            theirs.close()
            self._spares_failed = True
            return
        finally:
            if os.getpid() == server_pid:
                _platform.set_process_name(name)
        if pid == 0:
            try:
                _spare_main(theirs, private, server_pid, name)
            finally:
                os._exit(1)
        theirs.close()
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        spare = _Spare(pid, ours)
        self._spares.append(spare)
        # An idle spare writes nothing: its socket turns readable only at its death (the
        # OOM killer, a stray SIGKILL), which is then reaped at once, not left a zombie
        # until a request happens to try it.
        self._selector.register(ours, selectors.EVENT_READ, spare)

    def _idle_spare_died(self, spare: _Spare) -> None:
        self._spares.remove(spare)
        self._selector.unregister(spare.sock)
        self._discard_spare(spare)

    def _hand_to_spare(self, fds: list[int], call: bytes | None, has_stdin: bool) -> bool:
        """Give a start request to a spare; whether one took it (its answer comes later).

        The request counts once the spare acknowledges it (:meth:`_handoff_answered`):
        a spare killed just before (the OOM killer, a stray SIGKILL) may still take the
        message while it dies, and its death must not be reported as the worker's. The
        acknowledgement is read by this loop, not waited for here, so that a group's
        requests go to its spares back to back.
        """
        _, stderr_w, result_w, _, stdout_w, *rest = fds
        while self._spares:
            spare = self._spares.pop()
            self._selector.unregister(spare.sock)
            stdin = WITH_STDIN if has_stdin else WITHOUT_STDIN
            message = b"S" + stdin if call is None else b"C" + stdin + call
            try:
                socket.send_fds(spare.sock, [message], [stderr_w, result_w, stdout_w, *rest])
            except OSError:
                self._discard_spare(spare)  # died idle: try the next
                continue
            deadline = time.monotonic() + _SPARE_ACK_TIMEOUT
            handoff = _Handoff(spare, fds, call, has_stdin, deadline)
            self._handoffs[spare.pid] = handoff
            self._selector.register(spare.sock, selectors.EVENT_READ, handoff)
            return True
        return False

    def _handoff_answered(self, handoff: _Handoff) -> None:
        """The spare acknowledged its request (it is the worker now), or died first."""
        spare = handoff.spare
        del self._handoffs[spare.pid]
        self._selector.unregister(spare.sock)
        try:
            ack = spare.sock.recv(1, socket.MSG_DONTWAIT)
        except OSError:
            ack = b""
        if ack != _SPARE_ACK:
            # Dead (or stopped past the timeout): the request goes to the next spare or
            # to a fork, with the fds we still hold.
            self._discard_spare(spare)
            self._fork_worker(handoff.fds, handoff.call, handoff.has_stdin)
            return
        spare.sock.close()
        answer_fd, stderr_w, result_w, status_w, stdout_w, *rest = handoff.fds
        for fd in (stderr_w, result_w, stdout_w, *rest):
            os.close(fd)
        self._watch_worker(spare.pid, answer_fd, status_w)

    def _discard_spare(self, spare: _Spare) -> None:
        spare.sock.close()
        try:
            os.kill(spare.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(spare.pid, 0)

    def _drop_spares(self, keep: int) -> None:
        while len(self._spares) > keep:
            spare = self._spares.pop()
            self._selector.unregister(spare.sock)
            spare.sock.close()  # it reads end-of-file and exits
            os.waitpid(spare.pid, 0)

    def _watch(self, pid: int, status_w: int) -> None:
        try:
            pidfd = _platform.pidfd_open(pid)
        except OSError:
            pidfd = None  # EMFILE, ENFILE: a thread watches without an fd
        self._children[pid] = _Child(status_w, pidfd)
        if pidfd is not None:
            self._selector.register(pidfd, selectors.EVENT_READ, pid)
        else:
            threading.Thread(target=self._wait_in_thread, args=(pid,), daemon=True).start()

    def _wait_in_thread(self, pid: int) -> None:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        assert info is not None
        self._write_status(pid, _platform.returncode_from_siginfo(info))

    def _report_exit(self, pid: int) -> None:
        child = self._children.get(pid)
        if child is None:
            # Reaped by a release read in the same batch of events (a supervisor that gave
            # up on the exit, say while we were stopped): its pidfd is closed already.
            return
        assert child.pidfd is not None
        self._selector.unregister(child.pidfd)
        info = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED | os.WNOWAIT)
        assert info is not None
        self._write_status(pid, _platform.returncode_from_siginfo(info))

    def _write_status(self, pid: int, returncode: int) -> None:
        with self._lock:
            child = self._children.get(pid)
            if child is None or child.status_fd < 0:
                return
            try:
                os.write(child.status_fd, encode_status(returncode))
            except BrokenPipeError:
                pass
            os.close(child.status_fd)
            child.status_fd = -1

    def _reap(self, pid: int) -> None:
        child = self._children.pop(pid, None)
        if child is None:
            return
        # WNOHANG: a supervisor that gave up on an exit (a worker in uninterruptible sleep
        # past its SIGKILL bound) releases a process that may still run; waiting for it
        # would stop every other start. It is left to whoever reaps us.
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        with self._lock:
            if child.status_fd >= 0:
                os.close(child.status_fd)
                child.status_fd = -1
        if child.pidfd is not None:
            try:
                self._selector.unregister(child.pidfd)
            except KeyError:
                pass
            os.close(child.pidfd)
