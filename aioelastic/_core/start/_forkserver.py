"""A warm fork server: import the heavy modules once, then start each worker with a fork.

``multiprocessing``'s fork server is one per process with a global preload list and reaps
its children immediately; ours is one per preload list, kept warm across contexts (so an
agent's restart costs a fork, not a fresh ``import torch``), and it holds each exited
worker unreaped until the supervisor has swept its process group — the same pid-reuse
guarantee as for our own children.

The server's side and its protocol: :mod:`~aioelastic._core.child._forkserver_process`.

A server that died (killed, crashed) is noticed by the next start — its pid is gone, or the
socket reports a broken pipe, a reset or end-of-file — and replaced by a fresh one; the
start is retried once on it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import os
import pickle
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from ..child import _forkserver_process
from ..child._forkserver_process import _MAX_MSG, INLINE_CALL_MAX, WITH_STDIN, WITHOUT_STDIN
from ..process import _platform
from ..process._runtime import forget_in_child, runtime
from ..process._subreaper import lineage_env
from ._exit_watch import StatusPipeWatch
from ._helper_messages import HelperMessages
from ._launchers import Launched, on_launcher_thread, preparation_data, start_python

logger = logging.getLogger("aioelastic.forkserver")


class ForkServerError(RuntimeError):
    """A fork server could not start a worker: it failed to start, died, or could not fork."""


class _ServerGone(Exception):
    """The server's socket or process is gone (the text says how it was noticed)."""


@dataclass
class _Request:
    """A start request sent to the server: where its answer comes, and our ends of its pipes."""

    answers: socket.socket
    status_r: int
    payload_w: int | None

    def close(self) -> None:
        """Close our ends (the request failed: no worker will use them)."""
        os.close(self.status_r)
        if self.payload_w is not None:
            os.close(self.payload_w)


@dataclass
class _Starting:
    """One start of a server, as seen by the tasks waiting for it."""

    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    """Why it failed (the preload did not import); None if it worked or was cancelled."""


class ForkServer:
    """The supervisor's handle on one fork server (started on first use, replaced if dead)."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.preload = preload
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        # Guards the fields; held briefly, also from the event loop.
        self._lock = threading.Lock()
        # While one task starts the server, the others wait for it here.
        self._starting: _Starting | None = None
        # Releases and spare counts, sent without ever waiting (see HelperMessages).
        self._messages = HelperMessages(lambda: self._sock)

    def __repr__(self) -> str:
        state = "running" if self._sock is not None else "not running"
        return f"<ForkServer preload={list(self.preload)} pid={self._pid} {state}>"

    @property
    def pid(self) -> int | None:
        """The server's pid, once started."""
        return self._pid

    async def start_worker(
        self,
        stdout_fd: int | None,
        stderr_fd: int,
        result_fd: int,
        call: bytes,
        stdin_fd: int | None = None,
    ) -> Launched:
        """Have the server fork a worker wired to these fds, starting the server if needed.

        ``call`` is the pickled :class:`~..child._bootstrap.FunctionCall`. Up to
        :data:`INLINE_CALL_MAX` bytes it travels with the request; a larger one is left
        to the caller, who writes it to the returned ``payload_fd``.

        A server found dead (killed, crashed: its pid gone, or a broken pipe, a reset or
        end-of-file on its socket) is replaced, and the start retried once on the fresh
        one. Cancelling while the server starts (its preload import can take seconds)
        returns at once and kills the half-started server.

        Raises:
            ForkServerError: the server could not import its preload, could not fork the
                worker (the text names the limit), or died twice in a row.
        """
        for attempt in (1, 2):
            sock = await self._running()
            try:
                return await self._request_worker(
                    sock, stdout_fd, stderr_fd, result_fd, call, stdin_fd
                )
            except _ServerGone as gone:
                pid = self._discard(sock)
                if attempt == 2:
                    raise ForkServerError(
                        f"the fork server (pid {pid}) for forkserver_preload="
                        f"{list(self.preload)} died while starting a worker ({gone}), "
                        "right after replacing one that had died; see its stderr"
                    ) from gone
                logger.warning(
                    "the fork server (pid %s) is gone (%s); starting a fresh one", pid, gone
                )
        raise AssertionError("unreachable")

    async def warm_up(self) -> None:
        """Start the server (its preload import) now, unless it is running or starting.

        Raises:
            ForkServerError: the server could not import its preload.
        """
        await self._running()

    async def _running(self) -> socket.socket:
        """The socket of a live server; starts one (only one task does) if there is none."""
        while True:
            with self._lock:
                if self._sock is not None and self._popen is not None:
                    if self._popen.poll() is None:
                        return self._sock
                    self._discard_locked()
                starting = self._starting
                owner = starting is None
                if starting is None:
                    starting = self._starting = _Starting()
            if not owner:
                # Another task (maybe on another event loop) is starting it.
                await anyio.to_thread.run_sync(starting.done.wait, abandon_on_cancel=True)
                if starting.error is not None:
                    # Its preload failed: a second import would fail the same way.
                    raise ForkServerError(starting.error)
                continue
            try:
                sock, popen = await self._start_server()
                with self._lock:
                    self._sock, self._popen, self._pid = sock, popen, popen.pid
                return sock
            except ForkServerError as e:
                starting.error = str(e)
                raise
            finally:
                with self._lock:
                    self._starting = None
                starting.done.set()

    async def _start_server(self) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        with contextlib.ExitStack() as cleanup_on_fail:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            cleanup_on_fail.callback(ours.close)
            # Ours closed once the server holds its copy: left open, it would keep the
            # end-of-file of a server that dies at start from us.
            with theirs:
                # On a launcher thread: the server's parent-death signal is bound to the
                # thread that creates it, and launcher threads live as long as we do.
                popen = await on_launcher_thread(
                    start_python,
                    f"from {_forkserver_process.__name__} import main; "
                    f"main({theirs.fileno()}, {os.getpid()})",
                    # Marked too: a worker's fork without exec shows the server's environment.
                    {**os.environ, **lineage_env(os.environ)},
                    None,
                    None,
                    (theirs.fileno(),),
                )
            cleanup_on_fail.callback(_kill_and_reap, popen)
            try:
                prep = preparation_data("aioelastic-forkserver")
                ours.sendmsg([pickle.dumps((prep, self.preload))])
                # Not on a thread: the preload import may take many seconds, and a
                # cancelled start must return at once (then the half-started server is
                # killed).
                await anyio.wait_readable(ours)
                answer = ours.recv(_MAX_MSG)
            except (BrokenPipeError, ConnectionResetError):
                answer = b""  # it died before reading its setup: reported below
            if answer != b"K":
                detail = answer[1:].decode(errors="replace") if answer else "it exited at start"
                if answer[:1] == b"U":
                    raise ForkServerError(f"the fork server cannot fork workers safely: {detail}")
                raise ForkServerError(
                    f"the fork server could not import forkserver_preload={list(self.preload)}: "
                    f"{detail.strip()}"
                )
            cleanup_on_fail.pop_all()
        return ours, popen

    async def _request_worker(
        self,
        sock: socket.socket,
        stdout_fd: int | None,
        stderr_fd: int,
        result_fd: int,
        call: bytes,
        stdin_fd: int | None,
    ) -> Launched:
        """One start request, sent from the event loop, and its answer."""
        args = (sock, stdout_fd, stderr_fd, result_fd, call, stdin_fd)
        try:
            request = self._send_request(*args, block=False)
        except BlockingIOError:
            # The server's socket is full (many large requests queued): wait on a thread.
            request = await on_launcher_thread(
                functools.partial(self._send_request, block=True), *args
            )
        # Shielded: once the request is sent, a worker may exist; it must reach the caller.
        with anyio.CancelScope(shield=True):
            try:
                await anyio.wait_readable(request.answers)
                answer = request.answers.recv(_MAX_MSG)
            except OSError:
                answer = b""
            finally:
                request.answers.close()
        if not answer.startswith(b"P"):
            request.close()
            if not answer:
                raise _ServerGone("end-of-file on its socket")
            raise ForkServerError(answer[1:].decode(errors="replace"))
        pid = int(answer[1:])
        watch = StatusPipeWatch(pid, request.status_r, self._release)
        return Launched(pid, watch, payload_fd=request.payload_w)

    def _send_request(
        self,
        sock: socket.socket,
        stdout_fd: int | None,
        stderr_fd: int,
        result_fd: int,
        call: bytes,
        stdin_fd: int | None,
        *,
        block: bool,
    ) -> _Request:
        """Send one start request; with ``block=False`` raise BlockingIOError if it would wait."""
        # The server's ends are closed once sent (it holds copies), ours only if not sent.
        with contextlib.ExitStack() as always_cleanup, contextlib.ExitStack() as cleanup_on_fail:
            answers, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            cleanup_on_fail.callback(answers.close)
            always_cleanup.callback(theirs.close)
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            cleanup_on_fail.callback(os.close, status_r)
            always_cleanup.callback(os.close, status_w)
            # With no stdout_fd: *our* current stdout, not the one the server started with.
            out = 1 if stdout_fd is None else stdout_fd
            fds = [theirs.fileno(), stderr_fd, result_fd, status_w, out]
            stdin = WITHOUT_STDIN if stdin_fd is None else WITH_STDIN
            if stdin_fd is not None:
                fds.append(stdin_fd)
            message = b"C" + stdin + call
            payload_w = None
            if len(call) > INLINE_CALL_MAX:
                payload_r, payload_w = os.pipe2(os.O_CLOEXEC)
                always_cleanup.callback(os.close, payload_r)
                cleanup_on_fail.callback(os.close, payload_w)
                fds.append(payload_r)
                message = b"S" + stdin
            if sock is not self._sock:
                raise _ServerGone("it was replaced")
            try:
                _platform.send_fds(sock, [message], fds, 0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                raise
            except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as e:
                raise _ServerGone(f"{type(e).__name__} on its socket") from e
            except OSError as e:
                if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN):
                    raise _ServerGone(f"{type(e).__name__} on its socket") from e
                raise
            cleanup_on_fail.pop_all()
        return _Request(answers, status_r, payload_w)

    def _discard(self, sock: socket.socket) -> int | None:
        """Forget the dead server behind ``sock`` (kill and reap it); returns its pid."""
        with self._lock:
            pid = self._pid
            if sock is self._sock:
                self._discard_locked()
            return pid

    def _discard_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._popen is not None:
            _kill_and_reap(self._popen)
            self._popen = None

    def _release(self, pid: int) -> None:
        self._messages.send(b"R%d" % pid)

    def keep_spares(self, count: int) -> None:
        """Have the server keep ``count`` workers forked ahead (at most :data:`MAX_SPARES`).

        A spare is forked while the server is idle and waits for a start request, which
        then costs no fork: the next start of a group this size (an agent's restart, the
        next job) finds its workers already made.
        """
        self._messages.send(b"W%d" % max(0, count))

    async def spares_ready(self) -> int:
        """Have the server make its spares now; the number it holds (0: not running)."""
        sock = self._sock
        if sock is None:
            return 0
        answers, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                socket.send_fds(sock, [b"Q"], [theirs.fileno()])
            except OSError:
                return 0
            finally:
                theirs.close()
            await anyio.wait_readable(answers)
            answer = answers.recv(_MAX_MSG)
        finally:
            answers.close()
        return int(answer) if answer else 0

    def close(self) -> None:
        """Stop the server: it sees end-of-file and exits (reaped at interpreter exit)."""
        popen = self._detach()
        if popen is not None:
            runtime.closed_fork_servers.append(popen)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server and reap it, killed if it has not exited within ``timeout``."""
        popen = self._detach()
        if popen is None:
            return
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _kill_and_reap(popen)

    def _detach(self) -> subprocess.Popen[bytes] | None:
        with self._lock:
            popen, self._popen = self._popen, None
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        return popen


def _kill_and_reap(popen: subprocess.Popen[bytes]) -> None:
    """Kill a server (with anything its preload started in its group) and reap it."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            popen.kill()
        popen.wait()
    runtime.own_children.discard(popen.pid)


def servers() -> dict[tuple[str, ...], ForkServer]:
    """This process's warm fork servers by preload list (kept by the runtime)."""
    return runtime.fork_servers


def fork_server(preload: tuple[str, ...]) -> ForkServer:
    """The shared fork server for this preload list (created, not started)."""
    with runtime.lock:
        server = servers().get(preload)
        if server is None:
            server = servers()[preload] = ForkServer(preload)
        return server


def running_server_pids() -> list[int]:
    """Pids of the fork servers this process keeps warm."""
    return [s._pid for s in servers().values() if s._pid is not None and s._sock is not None]


def open_server_fds() -> list[int]:
    """Fds this process holds for its warm fork servers."""
    return [s._sock.fileno() for s in servers().values() if s._sock is not None]


@forget_in_child
def _forget_servers_in_child() -> None:
    # The sockets belong to the parent's conversations with its fork servers. Closed
    # here, a server object the child still refers to finds no server and starts its
    # own, instead of asking the parent's server to fork (and reap) for it. No lock:
    # another thread may have held it at the fork.
    for server in servers().values():
        sock, server._sock, server._popen, server._pid = server._sock, None, None, None
        if sock is not None:
            sock.close()


@atexit.register
def _shutdown_servers() -> None:
    for server in list(servers().values()):
        server.close()
    for popen in runtime.closed_fork_servers:
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
