"""The watchdog process itself: run as a script, ``python -I -S _watchdog_process.py``.

It imports only the interpreter's built-in modules (``_socket``, ``_signal``, ``_thread``,
``select``, ``marshal``, ``struct``, ``ctypes`` for ``prctl``) and never this package: no
``socket``, ``signal`` or ``threading`` wrappers (their ``enum``s), no
``ctypes.util.find_library`` (which imports ``subprocess`` and runs ``ldconfig``), so
the interpreter stays small. See :mod:`aioelastic._core.start._watchdog` for what it is for;
this file is the other end of its socket.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (message boundaries, fds by SCM_RIGHTS):

* ``+<pgid>`` / ``-<pgid>``: kill / stop killing that process group if the supervisor dies.
* ``B`` + a marshalled ``(base_env, [(argv, env_overrides, has_stdin), ...])`` + fds:
  the cwd (``O_PATH``) and the batch's answer socket once, then 2 per entry [stdout,
  stderr] and stdin as a 3rd when ``has_stdin`` (else /dev/null) (``M`` + the
  same with the body in a memfd, the last fd, when it is too large for one message):
  start binary workers with
  ``posix_spawn`` (a vfork: its cost does not grow with the size of any process), each in
  a new process group with default signal dispositions and an empty signal mask, with the
  environment ``{**base_env, **env_overrides}`` (a group's workers share all but a few
  variables: the common part travels once per message). Each entry is answered on the
  batch's answer socket, as soon as it is done, by a marshalled ``("P", pid)`` or
  ``("E", errno, message)``, in order. Each group is watched before the parent-death
  signal can be handled, so a supervisor SIGKILLed at any point of the start leaves no
  orphan. When a worker exits, ``("X", pid, returncode)`` follows on the same socket
  (after its ``P``, among the other answers); the socket is closed once every entry
  was answered and every worker started reported or released (an end-of-file before
  that: the watchdog died). An answer socket per batch, not this socket: the
  supervisor's event loop reads it without a thread, and batches of different loops
  never share a stream; one socket for a batch's exits, not a pipe per worker, saves
  the supervisor a pipe, a reader and a wake-up per worker. The worker stays unreaped
  (its pid, hence its group id, cannot be reused) until
* ``R<pid> <pid>...``: reap those workers and stop watching their groups.
* end-of-file: the supervisor is gone; kill every watched group and exit.

The parent-death signal (set with ``prctl``) does the same when the supervisor is
SIGKILLed. It is ``SIGRTMIN``, a real-time signal that no scheduler, service manager or
user sends a job. It was SIGUSR1, the usual choice for SLURM's ``--signal``, which SLURM
sends to every process of the job: a checkpoint request took every worker down. It is
still only a hint, which anyone may send with ``kill``: the handler kills only once the
supervisor is really gone, that is once we were re-parented (the kernel re-parents a
child before it sends the parent-death signal). The job's signals (SIGTERM, SIGUSR1...,
``JOB_SIGNALS`` of ``_platform``, given on the command line) are held blocked: a
scheduler sends them to us with the supervisor and the workers, and the teardown is the
supervisor's to do (a worker starts with an empty mask).
"""

from __future__ import annotations

import _socket
import _thread
import ctypes
import errno
import marshal
import os
import select
import struct
import sys

#: Not ``typing.TYPE_CHECKING``: importing ``typing`` would cost this small process more
#: than everything else it imports.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: ``signal``'s C module, without the enums ``signal`` builds over it (typeshed has no
#: stub for it: typed as Any).
_signal: Any = __import__("_signal")

_MAX_MSG = 1 << 20
_DEATH_SIGNAL = _signal.SIGRTMIN
#: Every signal a worker gets back at its default disposition (an inherited ignored
#: SIGPIPE or SIGXFSZ would change what a write failure does).
_DEFAULT_SIGNALS = sorted(_signal.valid_signals() - {_signal.SIGKILL, _signal.SIGSTOP})
_FD = struct.Struct("i")

groups: set[int] = set()
#: The supervisor's pid (from the command line).
parent = 0


def kill_all(*_: object) -> None:
    """Kill every watched process group and exit (the supervisor is gone)."""
    for pgid in groups:
        try:
            os.killpg(pgid, _signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)


def _parent_died(*_: object) -> None:
    """The parent-death signal: kill every group if the supervisor is really gone.

    Re-parented means gone (a parent *thread* that exits while its process lives hands
    us to a sibling thread: same pid, nothing to do). Anything else is a ``kill`` of the
    signal by someone, which is no reason to kill the workers.
    """
    if os.getppid() != parent:
        kill_all()


def _read_all(fd: int) -> bytes:
    chunks = []
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _answer(fd: int, answer: tuple[str | int, ...]) -> None:
    # One datagram per answer. It cannot block for long: a batch's socket carries at
    # most two small messages per start (its answer and its exit), far below the
    # socket's send buffer.
    try:
        os.write(fd, marshal.dumps(answer))
    except OSError:
        pass  # the supervisor is gone: the rest of the batch is started, then killed


class _Batch:
    """A batch's answer socket, open until every start is answered and reported."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        #: Workers started by this batch whose exit was neither reported nor released.
        self.running: set[int] = set()
        self.spawning = True

    def close_if_done(self) -> None:
        if not self.spawning and not self.running and self.fd >= 0:
            os.close(self.fd)  # the end-of-file: nothing more will come on this socket
            self.fd = -1


def _returncode(info: os.waitid_result) -> int:
    if info.si_code == os.CLD_EXITED:
        return int(info.si_status)
    return -int(info.si_status)


def _executable(argv0: str, env: dict[str, str]) -> str:
    # Like subprocess: a bare name is searched on the *worker's* PATH, not ours.
    if os.sep in argv0:
        return argv0
    for directory in os.get_exec_path(env):
        candidate = os.path.join(directory, argv0)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return argv0


class _Server:
    def __init__(self, sock: _socket.socket, max_batch: int) -> None:
        #: Starts per message (the supervisor's ``MAX_BATCH``, see main).
        self._max_batch = max_batch
        self._sock = sock
        self._epoll = select.epoll()
        #: What each registered fd stands for: None for the socket, else a worker's pid.
        self._watched: dict[int, int | None] = {}
        #: Each started worker's batch, until its exit is reported or it is released.
        self._batch_of: dict[int, _Batch] = {}
        self._pidfds: dict[int, int] = {}
        self._lock = _thread.allocate_lock()  # exit reports from fallback waiter threads
        self._use_pidfd = os.environ.get("AIOELASTIC_NO_PIDFD") != "1" and hasattr(os, "pidfd_open")
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def serve(self) -> None:
        self._register(self._sock.fileno(), None)
        while True:
            for fd, _ in self._epoll.poll():
                pid = self._watched.get(fd, -1)
                if pid is None:
                    if not self._handle_request():
                        return
                elif pid >= 0:
                    self._report_exit(pid)

    def _register(self, fd: int, pid: int | None) -> None:
        self._watched[fd] = pid
        self._epoll.register(fd, select.EPOLLIN)

    def _unregister(self, fd: int) -> None:
        if self._watched.pop(fd, -1) != -1:
            self._epoll.unregister(fd)

    def _handle_request(self) -> bool:
        # Not socket.recv_fds: before Python 3.13 it drops its flags argument, and every
        # fd received here must be close-on-exec or the next worker inherits it.
        try:
            msg, ancdata, _, _ = self._sock.recvmsg(
                _MAX_MSG,
                _socket.CMSG_LEN((3 * self._max_batch + 3) * _FD.size),
                _socket.MSG_CMSG_CLOEXEC,
            )
        except ConnectionResetError:
            return False
        fds: list[int] = []
        for level, cmsg_type, data in ancdata:
            if level == _socket.SOL_SOCKET and cmsg_type == _socket.SCM_RIGHTS:
                whole = data[: len(data) - (len(data) % _FD.size)]
                fds += (fd for (fd,) in _FD.iter_unpack(whole))
        if not msg:
            return False
        kind = msg[:1]
        if kind == b"B":
            self._spawn_batch(msg[1:], fds)
        elif kind == b"M":
            *request_fds, memfd = fds
            self._spawn_batch(_read_all(memfd), request_fds)
        elif kind == b"+":
            groups.add(int(msg[1:]))
        elif kind == b"-":
            groups.discard(int(msg[1:]))
        elif kind == b"R":
            for pid in msg[1:].split():
                self._reap(int(pid))
        return True

    def _spawn_batch(self, body: bytes, fds: list[int]) -> None:
        base_env, requests = marshal.loads(body)
        cwd_fd, answer_fd, *fds = fds
        # A SIGKILLed supervisor must find every new group in `groups`: hold the
        # parent-death signal from before the first process exists until the last is
        # recorded. Fallback waiter threads are created meanwhile and inherit the block:
        # a signal delivered to any thread runs its Python handler in the main thread at
        # once, also inside a later spawn's window, so no other thread may take it.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {_DEATH_SIGNAL})
        batch = _Batch(answer_fd)
        try:
            try:
                os.fchdir(cwd_fd)
            finally:
                os.close(cwd_fd)
            taken = 0
            for argv, overrides, has_stdin in requests:
                stdout_fd, stderr_fd = fds[taken : taken + 2]
                stdin_fd = fds[taken + 2] if has_stdin else None
                taken += 3 if has_stdin else 2
                env = {**base_env, **overrides} if overrides else base_env
                try:
                    pid = self._spawn(argv, env, stdout_fd, stderr_fd, stdin_fd)
                except OSError as exc:
                    _answer(answer_fd, ("E", exc.errno or errno.EIO, str(exc)))
                    continue
                finally:
                    for fd in (stdout_fd, stderr_fd, stdin_fd):
                        if fd is not None:
                            os.close(fd)
                # Answered before its exit can be reported (a waiter thread may report it
                # at once): the supervisor reads an exit only for a pid it was given.
                _answer(answer_fd, ("P", pid))
                self._watch_exit(pid, batch)
        finally:
            with self._lock:
                batch.spawning = False
                batch.close_if_done()
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_DEATH_SIGNAL})

    def _spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout_fd: int,
        stderr_fd: int,
        stdin_fd: int | None,
    ) -> int:
        pid = os.posix_spawn(
            _executable(argv[0], env),
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, self._devnull if stdin_fd is None else stdin_fd, 0),
                (os.POSIX_SPAWN_DUP2, stdout_fd, 1),
                (os.POSIX_SPAWN_DUP2, stderr_fd, 2),
            ],
            setpgroup=0,
            setsigmask=(),
            setsigdef=_DEFAULT_SIGNALS,
        )
        groups.add(pid)
        return pid

    def _watch_exit(self, pid: int, batch: _Batch) -> None:
        with self._lock:
            batch.running.add(pid)
            self._batch_of[pid] = batch
        pidfd = os.pidfd_open(pid) if self._use_pidfd else None
        if pidfd is not None:
            self._pidfds[pid] = pidfd
            self._register(pidfd, pid)
        else:
            _thread.start_new_thread(self._wait_in_thread, (pid,))

    def _wait_in_thread(self, pid: int) -> None:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        assert info is not None
        self._report(pid, _returncode(info))

    def _report_exit(self, pid: int) -> None:
        pidfd = self._pidfds[pid]
        self._unregister(pidfd)
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT)
        assert info is not None
        self._report(pid, _returncode(info))

    def _report(self, pid: int, returncode: int) -> None:
        with self._lock:
            batch = self._batch_of.pop(pid, None)
            if batch is None:
                return  # released first: nobody waits for this report any more
            _answer(batch.fd, ("X", pid, returncode))
            batch.running.discard(pid)
            batch.close_if_done()

    def _reap(self, pid: int) -> None:
        # Released only after the supervisor saw the exit and swept the group: the
        # group id may be reused from now on, so it is no longer ours to kill.
        groups.discard(pid)
        try:
            # WNOHANG: a supervisor that gave up on an exit (a worker in uninterruptible
            # sleep past its SIGKILL bound) releases a process that may still run; waiting
            # for it would stop every other start. It is left to whoever reaps us.
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        with self._lock:
            batch = self._batch_of.pop(pid, None)
            if batch is not None:
                batch.running.discard(pid)
                batch.close_if_done()
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None:
            self._unregister(pidfd)
            os.close(pidfd)


def main() -> None:
    """``_watchdog_process.py PARENT_PID SOCKET_FD MAX_BATCH JOB_SIGNALS``.

    ``MAX_BATCH``: the most starts one message carries, as the supervisor sends them
    (``aioelastic._core.start._binary_start.MAX_BATCH``, the one place it is set).
    ``JOB_SIGNALS``: the signal numbers to hold blocked, comma-separated (``_platform``'s,
    the one place they are listed).
    """
    global parent
    parent, sock_fd, max_batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    # Ctrl-C at a terminal reaches the supervisor's group, a scheduler's SIGTERM every
    # process of the job: the safety net must stay until the supervisor says or dies.
    # Blocked before any thread exists (fallback waiters inherit the mask).
    _signal.pthread_sigmask(_signal.SIG_BLOCK, {int(s) for s in sys.argv[4].split(",")})
    _signal.signal(_DEATH_SIGNAL, _parent_died)
    try:
        # The process's own namespace: libc is linked into every CPython on Linux.
        ctypes.CDLL(None).prctl(1, int(_DEATH_SIGNAL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        kill_all()
    os.set_inheritable(sock_fd, False)  # passed to us inheritable; no worker may hold it
    sock = _socket.socket(fileno=sock_fd)
    sock.sendmsg([b"K"])
    try:
        _Server(sock, max_batch).serve()
    finally:
        kill_all()  # also when serving failed: no group may outlive its supervisor's link


if __name__ == "__main__":
    main()
