"""A watchdog that kills the workers' process groups when the launcher dies by SIGKILL.

Workers die with the launcher (``PR_SET_PDEATHSIG``), but the processes *they* started do
not: a data loader worker, a ``subprocess`` the script spawned, a shell pipeline. Those are
orphaned to init and run on, holding ports, GPUs and files. torchrun leaves even the
workers behind. A dying process can run no code of its own after SIGKILL, so the cleanup
has to live in another process.

`Watchdog.start` forks a tiny helper before the launcher starts any thread or event loop.
The launcher tells it, over a pipe, which process groups hold workers (each worker leads
its own group, so its pid is the group id) and which have been torn down. When the pipe
reaches end-of-file without a clean ``exit`` message, the launcher is gone, and the helper
SIGKILLs every group still registered, then exits. On a normal exit the launcher sends
``exit``, closes the pipe and reaps the helper.

Limits: a descendant that left its worker's process group (``setsid``/``setpgid``) is not
in any registered group, and a group started in the few milliseconds between a worker's
start and its registration is not covered yet. The helper leaves the launcher's process
group and ignores the usual stop signals, so that a Ctrl-C or a ``kill -9 -PGID`` aimed at
the launcher's group cannot take it down before it has done its job.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
from collections.abc import Iterable

__all__ = ["Watchdog"]

_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE)


class Watchdog:
    """The launcher's side of the helper: register and release worker process groups.

    Made by `start`; every method is a no-op once `close` ran, and never raises: a helper
    that died is reported by the missing cleanup, not by failing the job.
    """

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd: int | None = fd

    @classmethod
    def start(cls) -> Watchdog:
        """Fork the helper. Call it while the process has a single thread.

        Returns:
            The launcher's handle on it.

        Raises:
            OSError: the pipe or the fork failed.
        """
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the helper process
            os.close(write_fd)
            _serve(read_fd)
        os.close(read_fd)
        return cls(pid, write_fd)

    def guard(self, pgids: Iterable[int]) -> None:
        """Register process groups to SIGKILL if the launcher dies."""
        self._send("".join(f"+{int(p)}\n" for p in pgids))

    def release(self, pgids: Iterable[int]) -> None:
        """Forget process groups that have been torn down (their ids may be reused)."""
        self._send("".join(f"-{int(p)}\n" for p in pgids))

    def close(self) -> None:
        """Tell the helper the launcher exits cleanly, and reap it."""
        if self._fd is None:
            return
        self._send("exit\n")
        os.close(self._fd)
        self._fd = None
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)

    def _send(self, text: str) -> None:
        if self._fd is None or not text:
            return
        data = text.encode()
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:
            # The helper is gone (killed by hand?); the job itself is unaffected.
            pass


def _serve(fd: int) -> None:  # pragma: no cover - runs in the forked helper
    """The helper's whole life: read registrations until EOF, then kill what is left."""
    code = 0
    try:
        if fd <= 2:
            # stdin/stdout/stderr were closed when the pipe was made; move it out of the
            # way of the /dev/null descriptors below.
            fd = fcntl.fcntl(fd, fcntl.F_DUPFD, 3)
        os.setpgid(0, 0)
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_IGN)
        _detach_fds(fd)
        groups: set[int] = set()
        pending = b""
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line == b"exit":
                    os._exit(0)
                if line[:1] == b"+":
                    groups.add(int(line[1:]))
                elif line[:1] == b"-":
                    groups.discard(int(line[1:]))
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _detach_fds(keep: int) -> None:  # pragma: no cover - runs in the forked helper
    """Hold no descriptor of the launcher's but the pipe: its stdout/stderr pipes must reach
    end-of-file when the launcher exits, and sockets must close with their owner."""
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    if null > 2:
        os.close(null)
    os.closerange(3, keep)
    os.closerange(keep + 1, _max_fd())


def _max_fd() -> int:  # pragma: no cover - runs in the forked helper
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536
