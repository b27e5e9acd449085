"""Whether a process is waiting to read a given terminal, from what ``/proc`` shows.

The kernel sends no event when a process starts to read its terminal: the master side of
a pseudo-terminal learns nothing of reads on the slave side (packet mode reports flow
control and flushes, not reads). What it does show, for a task that is blocked in a
system call, is the call's number and arguments in ``/proc/PID/task/TID/syscall``. A
worker that asks for input sleeps in one of these, on its stdin or on a descriptor
reopened from it (``torch.distributed.breakpoint`` reads ``open("/dev/stdin")``):

* ``read`` and its kin (``input()`` without readline, ``sys.stdin.readline()``, a shell's
  ``read``): the descriptor is the first argument;
* ``poll``/``ppoll``: the array of ``pollfd`` is read from ``/proc/PID/mem``;
* ``select``/``pselect6`` (GNU readline, so ``pdb`` and ``input()`` once readline is
  imported): the read set, likewise;
* ``epoll_wait`` and kin (an event loop that reads stdin): its interest list is in
  ``/proc/PID/fdinfo/EPFD``.

A descriptor counts when ``/proc/PID/fd/N`` is the terminal's device, compared by
``st_rdev``. Every thread of the worker and of its descendants is looked at (a shell
script's ``python`` child may be the one reading). Reading another process's ``syscall``
and ``mem`` needs ptrace access: our own descendants, same user, are ours to read unless
a security module forbids it, and then the answer is "cannot tell" (``None``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct

__all__ = ["reads_terminal", "terminal_device"]

_READ, _POLL, _SELECT, _EPOLL = range(4)

#: System calls a task asking for input sleeps in, by machine (``os.uname().machine``).
_CALLS: dict[str, dict[int, int]] = {
    "x86_64": {
        0: _READ,  # read
        17: _READ,  # pread64
        19: _READ,  # readv
        295: _READ,  # preadv
        7: _POLL,  # poll
        271: _POLL,  # ppoll
        23: _SELECT,  # select
        270: _SELECT,  # pselect6
        232: _EPOLL,  # epoll_wait
        281: _EPOLL,  # epoll_pwait
        441: _EPOLL,  # epoll_pwait2
    },
    "aarch64": {
        63: _READ,  # read
        65: _READ,  # readv
        67: _READ,  # pread64
        69: _READ,  # preadv
        73: _POLL,  # ppoll
        72: _SELECT,  # pselect6
        22: _EPOLL,  # epoll_pwait
        441: _EPOLL,  # epoll_pwait2
    },
}
_POLL_READ = 0x001 | 0x002 | 0x040  # POLLIN | POLLPRI | POLLRDNORM
_EPOLL_READ = 0x001 | 0x002 | 0x040
#: Bounds on what is read of a process: the pollfd entries, select's set, descendants.
_MAX_POLL_FDS = 4096
_MAX_SELECT_FDS = 65536
_MAX_PROCESSES = 64


class _CannotTell(Exception):
    """``/proc`` refused to say (no ptrace access)."""


def terminal_device(fd: int) -> int:
    """The device number (``st_rdev``) of the terminal open on ``fd``."""
    return os.fstat(fd).st_rdev


def reads_terminal(pid: int, device: int) -> bool | None:
    """Whether a thread of ``pid`` or of a descendant is blocked reading terminal ``device``.

    Args:
        pid: The worker.
        device: The terminal's ``st_rdev`` (:func:`terminal_device`).

    Returns:
        ``True`` or ``False``; ``None`` when ``/proc`` cannot tell here (an unknown
        machine, or no ptrace access to the worker). A process that is gone reads nothing.
    """
    calls = _CALLS.get(os.uname().machine)
    if calls is None:
        return None
    try:
        return any(
            _task_reads(member, tid, calls, device)
            for member in _family(pid)
            for tid in _tasks(member)
        )
    except _CannotTell:
        return None


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants (at most :data:`_MAX_PROCESSES`), parents first."""
    found = [pid]
    for parent in found:
        for tid in _tasks(parent):
            try:
                with open(f"/proc/{parent}/task/{tid}/children", "rb") as f:
                    children = f.read().split()
            except OSError:
                continue  # gone, or a kernel without CONFIG_PROC_CHILDREN: the worker only
            found += (int(child) for child in children)
            if len(found) >= _MAX_PROCESSES:
                return found[:_MAX_PROCESSES]
    return found


def _tasks(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []  # gone


def _task_reads(pid: int, tid: int, calls: dict[int, int], device: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
            fields = f.read().split()
    except PermissionError as exc:
        raise _CannotTell from exc
    except OSError:
        return False  # gone
    # "running", or "-1 SP PC" when blocked outside a system call (a page fault).
    if len(fields) < 7 or fields[0] in (b"running", b"-1"):
        return False
    kind = calls.get(int(fields[0]))
    if kind is None:
        return False
    args = [int(arg, 16) for arg in fields[1:7]]
    if kind == _READ:
        return _is_device(pid, args[0], device)
    if kind == _POLL:
        count = min(args[1], _MAX_POLL_FDS)
        entries = _memory(pid, args[0], 8 * count)
        return any(
            events & _POLL_READ and _is_device(pid, fd, device)
            for fd, events, _ in struct.iter_unpack("ihh", entries[: 8 * count])
        )
    if kind == _SELECT:
        nfds = min(args[0], _MAX_SELECT_FDS)
        if not args[1] or not nfds:
            return False
        bits = int.from_bytes(_memory(pid, args[1], (nfds + 7) // 8), "little")
        return any(bits >> fd & 1 and _is_device(pid, fd, device) for fd in range(nfds))
    return _epoll_reads(pid, args[0], device)


def _memory(pid: int, address: int, size: int) -> bytes:
    """``size`` bytes of ``pid``'s memory at ``address`` (fewer if it is gone)."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError as exc:
        raise _CannotTell from exc
    except OSError:
        return b""
    try:
        return os.pread(fd, size, address)
    except OSError as exc:
        if exc.errno == errno.EPERM:
            raise _CannotTell from exc
        return b""  # gone, or a pointer the call would have refused (EFAULT: EIO here)
    finally:
        os.close(fd)


def _epoll_reads(pid: int, epfd: int, device: int) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{epfd}", "rb") as f:
            info = f.read()
    except OSError:
        return False
    for line in info.splitlines():
        # "tfd:        0 events:       19 data: ..." (events in hex)
        fields = line.split()
        if len(fields) >= 4 and fields[0] == b"tfd:" and fields[2] == b"events:":
            with contextlib.suppress(ValueError):
                if int(fields[3], 16) & _EPOLL_READ and _is_device(pid, int(fields[1]), device):
                    return True
    return False


def _is_device(pid: int, fd: int, device: int) -> bool:
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == device
