"""A warm fork server: import the heavy modules once, then start each worker with a fork.

``multiprocessing``'s fork server is one per process with a global preload list and reaps
its children immediately; ours is one per preload list, kept warm across contexts (so an
agent's restart costs a fork, not a fresh ``import torch``), and it holds each exited
worker unreaped until the supervisor has swept its process group — the same pid-reuse
guarantee as for our own children.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (message boundaries, fds by SCM_RIGHTS):

* client -> server ``S`` + fds [payload_r, stderr_w, result_w, status_w, stdout_w?]:
  fork a worker; the server answers ``P<pid>``. The worker reads its pickled call from
  ``payload_r``; the server keeps ``status_w`` and writes the exit status there when the
  worker exits (so the supervisor waits on a pipe only it and the server hold).
* client -> server ``R<pid>``: reap that worker now (no answer).
* end-of-file on the socket: the supervisor is gone; the server exits, and its workers
  follow through their parent-death signal.
"""

from __future__ import annotations

import atexit
import multiprocessing.spawn
import os
import pickle
import selectors
import signal
import socket
import subprocess
import threading
import traceback
from dataclasses import dataclass

from . import _platform
from ._exit_watch import StatusPipeWatch, encode_status
from ._launchers import Launched, preparation_data, start_python

_MAX_MSG = 1 << 16


def _reply_error(sock: socket.socket, text: str) -> None:
    sock.sendmsg([b"E" + text.encode(errors="replace")[: _MAX_MSG - 1]])


def main(control_fd: int, parent_pid: int) -> None:
    """Entry point of the fork-server process."""
    _platform.die_with_parent(parent_pid)
    # Ctrl-C at a terminal reaches the supervisor's process group; we are in our own and
    # must leave the decision to the supervisor.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=control_fd)
    setup_msg, _, _, _ = sock.recvmsg(_MAX_MSG)
    prep_data, preload = pickle.loads(setup_msg)
    try:
        multiprocessing.spawn.prepare(prep_data)
        for module in preload:
            __import__(module)
    except BaseException:
        _reply_error(sock, traceback.format_exc())
        return
    sock.sendmsg([b"K"])
    _Server(sock).serve()


@dataclass
class _Child:
    status_fd: int
    pidfd: int | None


class _Server:
    """The fork server's loop: fork on request, report exits, reap on release."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._selector = selectors.DefaultSelector()
        self._children: dict[int, _Child] = {}
        self._lock = threading.Lock()  # guards status writes from fallback threads

    def serve(self) -> None:
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    if not self._handle_request():
                        return
                else:
                    self._report_exit(key.data)

    def _handle_request(self) -> bool:
        try:
            msg, fds, _, _ = socket.recv_fds(self._sock, _MAX_MSG, 8)
        except ConnectionResetError:
            return False
        if not msg:
            return False
        if msg[:1] == b"S":
            self._fork_worker(fds)
        elif msg[:1] == b"R":
            self._reap(int(msg[1:]))
        return True

    def _fork_worker(self, fds: list[int]) -> None:
        payload_r, stderr_w, result_w, status_w, *rest = fds
        stdout_w = rest[0] if rest else None
        private = [self._sock.fileno(), self._selector.fileno()]
        for child in self._children.values():
            private.append(child.status_fd)
            if child.pidfd is not None:
                private.append(child.pidfd)
        private.append(status_w)
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                from ._bootstrap import forked_worker

                forked_worker(
                    parent_pid=server_pid,
                    stdout_fd=stdout_w,
                    stderr_fd=stderr_w,
                    result_fd=result_w,
                    close_fds=private,
                    payload_fd=payload_r,
                )
            finally:
                # Never carry on as a second copy of the server loop, on its socket.
                os._exit(1)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        for fd in (payload_r, stderr_w, result_w, stdout_w):
            if fd is not None:
                os.close(fd)
        pidfd = _platform.pidfd_open(pid)
        self._children[pid] = _Child(status_w, pidfd)
        if pidfd is not None:
            self._selector.register(pidfd, selectors.EVENT_READ, pid)
        else:
            threading.Thread(target=self._wait_in_thread, args=(pid,), daemon=True).start()
        self._sock.sendmsg([b"P%d" % pid])

    def _wait_in_thread(self, pid: int) -> None:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        assert info is not None
        self._write_status(pid, _platform.returncode_from_siginfo(info))

    def _report_exit(self, pid: int) -> None:
        child = self._children[pid]
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
        # Released only after the supervisor's teardown saw the exit, so this never blocks.
        try:
            os.waitpid(pid, 0)
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


class ForkServer:
    """The supervisor's handle on one fork server (started on first use)."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.preload = preload
        self._sock: socket.socket | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The server's pid, once started."""
        return self._pid

    def _ensure_started(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            popen = start_python(
                f"from aioelastic._forkserver import main; main({theirs.fileno()}, {os.getpid()})",
                dict(os.environ),
                stdout_fd=None,
                stderr_fd=None,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        prep = preparation_data("aioelastic-forkserver")
        ours.sendmsg([pickle.dumps((prep, self.preload))])
        answer = ours.recv(_MAX_MSG)
        if answer != b"K":
            ours.close()
            popen.wait()
            detail = answer[1:].decode(errors="replace") if answer else "it exited at start"
            raise RuntimeError(
                f"the fork server could not import forkserver_preload={list(self.preload)}: "
                f"{detail.strip()}"
            )
        # The server is reaped by the kernel's re-parenting only after we exit; keep the
        # Popen (and so its pid) for the process lifetime.
        _keep_alive.append(popen)
        self._sock, self._pid = ours, popen.pid
        return ours

    def start_worker(self, stdout_fd: int | None, stderr_fd: int, result_fd: int) -> Launched:
        """Blocking: have the server fork a worker wired to these fds."""
        payload_r, payload_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        fds = [payload_r, stderr_fd, result_fd, status_w]
        if stdout_fd is None:
            # Inherit *our* current stdout, not the one the server had when it started.
            fds.append(1)
        else:
            fds.append(stdout_fd)
        try:
            with self._lock:
                sock = self._ensure_started()
                socket.send_fds(sock, [b"S"], fds)
                answer = sock.recv(_MAX_MSG)
        except BaseException:
            os.close(payload_w)
            os.close(status_r)
            raise
        finally:
            os.close(payload_r)
            os.close(status_w)
        if not answer.startswith(b"P"):
            os.close(payload_w)
            os.close(status_r)
            raise RuntimeError("the fork server died while starting a worker")
        pid = int(answer[1:])
        return Launched(pid, StatusPipeWatch(pid, status_r, self._release), payload_fd=payload_w)

    def _release(self, pid: int) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.sendmsg([b"R%d" % pid])
        except OSError:
            pass  # the server is gone, and its children with it

    def close(self) -> None:
        """Stop the server: it sees end-of-file and exits."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


_servers: dict[tuple[str, ...], ForkServer] = {}
_servers_lock = threading.Lock()
_keep_alive: list[subprocess.Popen[bytes]] = []


def fork_server(preload: tuple[str, ...]) -> ForkServer:
    """The shared fork server for this preload list (created, not started)."""
    with _servers_lock:
        server = _servers.get(preload)
        if server is None:
            server = _servers[preload] = ForkServer(preload)
        return server


def running_server_pids() -> list[int]:
    """Pids of the fork servers this process keeps warm."""
    return [s.pid for s in _servers.values() if s.pid is not None and s._sock is not None]


def open_server_fds() -> list[int]:
    """Fds this process holds for its warm fork servers."""
    return [s._sock.fileno() for s in _servers.values() if s._sock is not None]


def _forget_servers_in_child() -> None:
    # The sockets belong to the parent's conversations with its fork servers.
    global _servers_lock
    _servers.clear()
    _keep_alive.clear()
    _servers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_servers_in_child)


@atexit.register
def _shutdown_servers() -> None:
    for server in list(_servers.values()):
        server.close()
    for popen in _keep_alive:
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
