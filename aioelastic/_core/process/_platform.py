"""Linux process primitives, each with the fallback used where the kernel lacks it.

Everything that differs between "a modern Linux kernel" and "something else" sits here:
pidfd support, ``prctl`` (parent-death signal, child subreaper), finding the live
members of a process group, and reading what ``/proc`` tells about a process. The rest
of the package asks these functions and never checks the platform itself.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno
import functools
import os
import signal
import socket
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

#: Set to ``1`` to make aioelastic behave as if the kernel had no pidfd support
#: (exit waits fall back to a ``waitid`` thread). Used by the tests of the fallback.
NO_PIDFD_ENV = "AIOELASTIC_NO_PIDFD"


@functools.cache
def pidfd_supported() -> bool:
    """Whether ``pidfd_open`` works here (Linux >= 5.3 and not disabled by the env)."""
    if os.environ.get(NO_PIDFD_ENV) == "1" or not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


@functools.cache
def _libc_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def load_prctl() -> None:
    """Resolve ``prctl`` now, so that a child between fork and exec only calls it.

    Loading a shared library after ``fork()`` in a multi-threaded parent could deadlock
    on the dynamic loader's lock, so every launch path calls this first.
    """
    _libc_prctl()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent *thread* exits.

    Returns ``False`` where ``prctl`` is not available (the caller then relies on the
    supervisor's explicit teardown only).
    """
    prctl = _libc_prctl()
    if prctl is None:
        return False
    return bool(prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)


def set_child_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (``PR_SET_CHILD_SUBREAPER``)."""
    prctl = _libc_prctl()
    if prctl is None:
        return False
    return bool(prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def process_name() -> str:
    """This process's name as ``ps`` shows it (``/proc/self/comm``); ``""`` if unknown."""
    try:
        with open("/proc/self/comm") as f:
            return f.read().rstrip("\n")
    except OSError:
        return ""


def set_process_name(name: str) -> None:
    """Set the name ``ps`` shows for this process (best effort; Linux only)."""
    if not name:
        return
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


def die_with_parent(expected_parent: int) -> None:
    """In a fresh child: die with the supervisor, closing the race where it already died.

    ``PR_SET_PDEATHSIG`` only covers a parent that dies *after* the call; a parent that
    died between our fork and this call has already re-parented us, which ``getppid``
    shows.
    """
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != expected_parent:
        os._exit(1)


def _pids() -> list[int]:
    """Every pid of this pid namespace, from ``/proc``.

    Raises:
        OSError: ``/proc`` cannot be listed (EMFILE: no fd left). Never an empty answer
            then — "no process" would let teardown believe a group is empty.
    """
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def proc_stat(pid: int | str, maxsplit: int = -1) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` from the state on; ``None`` once ``pid`` is gone.

    The command name may contain spaces and parentheses, so the fields are those after
    its last ``)``: ``[state, ppid, pgrp, session, ...]`` (``utime`` and ``stime`` at 11
    and 12), that is proc(5)'s field ``n`` at index ``n - 3``. ``maxsplit`` as for
    :meth:`bytes.split`: the fields past it are left as one.
    """
    # Raw os.open/os.read: a Python file object costs more than the read itself, and a
    # scan reads one file per process of the machine.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat:
        return None
    return stat[stat.rindex(b")") + 2 :].split(None, maxsplit)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state letter, ppid, pgrp)`` of ``pid``, ``None`` once it is gone."""
    fields = proc_stat(pid, 3)
    if fields is None:
        return None
    state, ppid, pgrp, _ = fields
    return state.decode(), int(ppid), int(pgrp)


def _processes() -> Iterator[tuple[int, str, int, int]]:
    """``(pid, state letter, ppid, pgrp)`` of every process, in one pass over ``/proc``.

    A process that exits while being read is skipped.

    Raises:
        OSError: ``/proc`` cannot be listed (see :func:`_pids`).
    """
    for pid in _pids():
        info = _stat(pid)
        if info is not None:
            yield pid, *info


def live_group_members(
    pgids: set[int], *, leaders_exited: bool = False, not_members: Collection[int] = ()
) -> dict[int, list[int]]:
    """The running (non-zombie) processes of each process group in ``pgids``.

    A group with no live member is absent from the result. Used only during teardown,
    to wait for and kill the children of workers. ``leaders_exited``: the caller knows
    every group's leader (pid = pgid) has exited, so the leaders are skipped unread —
    in a group of hundreds of exited workers, reading their stat files was most of the
    scan. ``not_members``: pids known to be in none of ``pgids`` (the leaders of other
    groups), skipped unread as well.

    Raises:
        OSError: ``/proc`` cannot be listed (see :func:`_pids`).
    """
    members: dict[int, list[int]] = {}
    if not pgids:
        return members
    getpgid = os.getpgid
    for pid in _pids():
        if (leaders_exited and pid in pgids) or pid in not_members:
            continue
        # One getpgid() per process, not a read of its stat file: a tenth of the cost
        # (no file to open, no text to format), and teardown scans every process of the
        # machine. Only the few members found have their stat read, for their state.
        try:
            pgrp = getpgid(pid)
        except ProcessLookupError:
            continue
        except OSError:
            # A security module may refuse getpgid (EPERM); the stat file may still tell.
            info = _stat(pid)
            if info is None:
                continue
            pgrp = info[2]
        if pgrp not in pgids:
            continue
        info = _stat(pid)
        if info is not None and info[0] not in ("Z", "X"):
            members.setdefault(pgrp, []).append(pid)
    return members


def children_of(parent: int) -> dict[int, str]:
    """The children of ``parent`` (pid -> /proc state letter), zombies included."""
    return {pid: state for pid, state, ppid, _ in _processes() if ppid == parent}


def children_and_groups(parent: int) -> dict[int, tuple[str, int]]:
    """The children of ``parent``: pid -> (/proc state letter, process group), zombies included.

    A zombie keeps its process group (and so the group id stays taken) until reaped.
    """
    return {pid: (state, pgrp) for pid, state, ppid, pgrp in _processes() if ppid == parent}


def exec_environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` was executed with.

    Read from ``/proc/PID/environ``: the block ``execve`` gave the process. What it
    changed since (``setenv``, ``os.environ[...] = ...``) does not show there, and a
    child forked without exec shows its parent's block. ``None`` when the variable is
    absent or the block cannot be read: the process is gone, a zombie (its memory, and
    the block with it, is freed), or not ours to read (another user's, not dumpable).
    """
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            block = f.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in block.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def command_line(pid: int, limit: int = 200) -> str:
    """``pid``'s command line as a shell would quote it, cut at ``limit`` characters.

    From ``/proc/PID/cmdline``; a process without one (a zombie, a kernel thread) is
    shown as ``ps`` shows it, by its name in brackets. ``""`` when ``pid`` is gone.
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        raw = b""
    args = [arg.decode(errors="replace") for arg in raw.split(b"\0")]
    if args and args[-1] == "":
        args.pop()
    if args:
        import shlex  # here: spawned workers import this module and never need it

        text = shlex.join(args)
    else:
        try:
            with open(f"/proc/{pid}/comm") as f:
                text = f"[{f.read().rstrip()}]"
        except OSError:
            return ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; ``False`` if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # A member changed credentials (setuid exec); the rest still got the signal.
        return True
    return True


def signal_process(pid: int, sig: int) -> bool:
    """Send ``sig`` to process ``pid`` alone; ``False`` if it no longer exists.

    For a worker that is not reaped yet (so ``pid`` cannot name another process).
    """
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid``, or ``None`` without pidfd support or when it already exited."""
    if not pidfd_supported():
        return None
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno in (errno.ESRCH, errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return None
        raise


def send_fds(sock: socket.socket, buffers: list[bytes], fds: list[int], flags: int = 0) -> int:
    """``socket.send_fds`` that honours ``flags``.

    The standard library's drops its ``flags`` (CPython gh-107898, every version up to
    3.13): a ``MSG_DONTWAIT`` send blocked until the peer read, freezing the event loop
    behind a helper process busy with a burst of starts.
    """
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    return sock.sendmsg(buffers, rights, flags)


def new_group_popen_kwargs(preexec: Callable[[], None] | None = None) -> dict[str, Any]:
    """``subprocess.Popen`` arguments that start the child in its own process group.

    Python 3.11 sets the group between fork and exec without a ``preexec_fn`` (keeping
    the fast vfork path); on 3.10 the group is set by a ``preexec_fn``.
    """
    if sys.version_info < (3, 11):

        def group_then_preexec() -> None:
            os.setpgid(0, 0)
            if preexec is not None:
                preexec()

        return {"preexec_fn": group_then_preexec}
    return {"process_group": 0, "preexec_fn": preexec}


def returncode_from_siginfo(info: os.waitid_result) -> int:
    """``waitid`` result to a ``subprocess``-style return code (negative = signal)."""
    if info.si_code == os.CLD_EXITED:
        return int(info.si_status)
    return -int(info.si_status)


#: Signals whose disposition a new worker gets reset (all but SIGKILL and SIGSTOP).
RESETTABLE_SIGNALS = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}

_JOB_SIGNAL_NAMES = "HUP INT QUIT TERM USR1 USR2 ALRM VTALRM PROF XCPU PWR"
JOB_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, f"SIG{name}")
    for name in _JOB_SIGNAL_NAMES.split()
    if hasattr(signal, f"SIG{name}")
)
"""The signals sent to tell a job's processes something: stop, or checkpoint, reload...

A scheduler sends them to *every* process of a job at once: SLURM on ``scancel``, at
the time limit and for ``--signal``; systemd's ``KillMode=control-group``; Kubernetes
to the processes of a terminating pod. So the supervisor's helper processes (the
watchdog, the fork server and its spares) get them as well as the supervisor and the
workers, and must not act on them: a helper that died of SIGTERM took the workers
down with it (SIGKILLed before their own SIGTERM handlers ran). Helpers hold them
blocked (`hold_job_signals`); they are the signals a group may forward to its workers.
Faults (SIGSEGV...), job control (SIGTSTP, SIGCONT...), SIGCHLD, SIGPIPE, SIGWINCH and
the real-time signals are not among them.
"""


def hold_job_signals() -> None:
    """Keep every one of `JOB_SIGNALS` blocked in this thread (see there).

    In a helper process, and in the launcher threads that start helpers and workers.

    Blocked, not ignored: a child forked from the helper inherits the mask, and a signal
    sent to it before it becomes a worker stays pending until the worker empties its
    mask (`default_signal_state`), then acts as it would have; an ignored one would be
    lost (a teardown's SIGTERM to a worker still starting). Done before the helper makes
    any thread, which inherits the mask.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)


def default_signal_state(python: bool, held: Collection[int] = ()) -> None:
    """In a new worker, before it runs user code: every disposition default, none blocked.

    What the supervisor inherited (``SIGHUP`` ignored under ``nohup``, ``SIGINT`` ignored
    in a background job, a blocked mask, handlers of the host program) must not reach
    its workers. ``python=True`` (function workers) leaves what a fresh interpreter
    itself sets: ``SIGINT`` raises KeyboardInterrupt, ``SIGPIPE`` and ``SIGXFSZ`` are
    ignored (so that writes fail with EPIPE/EFBIG instead of killing it).

    Every start method calls this: ``fork`` and the fork server in the forked child,
    ``spawn`` first thing in the new interpreter, binaries between fork and exec (exec
    resets handlers but keeps ignored signals and the mask; with ``os.posix_spawn`` the
    equivalent is ``setsigdef=RESETTABLE_SIGNALS, setsigmask=()``).

    ``held``: the mask to leave instead of an empty one (a fork server's spare, a helper
    until it becomes a worker, keeps `JOB_SIGNALS` blocked without a moment's gap).
    """
    ignored = {signal.SIGPIPE, signal.SIGXFSZ} if python else set()
    for sig in RESETTABLE_SIGNALS:
        if python and sig == signal.SIGINT:
            handler: Any = signal.default_int_handler
        else:
            handler = signal.SIG_IGN if sig in ignored else signal.SIG_DFL
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass  # a real-time signal reserved by the C library
    signal.pthread_sigmask(signal.SIG_SETMASK, held)


def ensure_default_sigchld() -> None:
    """Undo an inherited ``SIGCHLD`` = ``SIG_IGN`` before any worker starts.

    With ``SIGCHLD`` ignored the kernel reaps children itself, so their exit status is
    lost (``waitid`` fails with ECHILD). A shell or a service manager can hand that
    disposition down. The default disposition changes nothing else for an asyncio
    program, so it is restored (and logged); outside the main thread, where Python
    cannot change a disposition, this raises instead.

    Raises:
        RuntimeError: ``SIGCHLD`` is ignored and this is not the main thread.
    """
    # Imported here: spawned workers import this module and need neither.
    import logging
    import threading

    if signal.getsignal(signal.SIGCHLD) != signal.SIG_IGN:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "SIGCHLD is ignored (SIG_IGN) in this process, so the kernel would reap the "
            "workers before their exit status could be read; call "
            "signal.signal(signal.SIGCHLD, signal.SIG_DFL) in the main thread before "
            "starting workers"
        )
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    logging.getLogger("aioelastic").info(
        "aioelastic: SIGCHLD was ignored (SIG_IGN); restored the default disposition so "
        "that the workers' exit statuses can be read"
    )
