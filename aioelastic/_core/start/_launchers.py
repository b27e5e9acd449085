"""Creating one worker process: a binary, a spawned interpreter, or a fork.

These calls block (fork, exec, the exec-error handshake), so the supervisor runs them on
*launcher threads*. That choice has a kernel consequence: ``PR_SET_PDEATHSIG`` fires when
the **thread** that forked a child exits, not the process. A worker forked from a pooled
thread that is later retired for being idle (anyio's pool retires threads after 10 s)
would be killed for no reason. So launcher threads belong to a dedicated executor whose
threads never retire: they end only when the interpreter ends, which is exactly when the
workers should die.

Why not ``anyio.to_thread.run_sync`` with a :class:`anyio.CapacityLimiter` of 8: the limit
would bound the number of threads, but anyio's worker threads belong to one event loop.
Besides retiring after 10 s idle, they are stopped when that loop's main task ends, so a
host that calls ``asyncio.run`` twice would see the first run's forked workers die with
the first loop. The executor lives on the process :mod:`~aioelastic._core.process._runtime` instead,
shared by every loop, and a forked child that supervises workers builds its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio

from ..child._bootstrap import FunctionCall, forked_worker
from ..process import _platform, _subreaper
from ..process._runtime import runtime
from ._exit_watch import ExitWatch, watch_child

T = TypeVar("T")

_LAUNCHER_THREADS = 8


def launcher_pool() -> ThreadPoolExecutor:
    with runtime.lock:
        if runtime.launcher_pool is None:
            _platform.load_prctl()
            # Each thread holds the job's signals blocked (the main thread takes them): a
            # helper it starts (the watchdog, a fork server) inherits the mask through
            # exec, and is never without it until it holds them itself; a worker it
            # starts empties its mask first thing, and a signal sent meanwhile then acts.
            runtime.launcher_pool = ThreadPoolExecutor(
                _LAUNCHER_THREADS,
                thread_name_prefix="aioelastic-launch",
                initializer=_platform.hold_job_signals,
            )
        return runtime.launcher_pool


async def on_launcher_thread(fn: Callable[..., T], *args: object) -> T:
    """Run the blocking start call ``fn(*args)`` on a launcher thread.

    Shielded from cancellation: once a process may have been created its handle must
    reach the caller, who records it so that teardown can stop it. A start call takes
    milliseconds, so the shield delays a cancellation by no more than that.
    """
    future = launcher_pool().submit(fn, *args)
    with anyio.CancelScope(shield=True):
        # anyio has no way to await a concurrent.futures.Future other than on a thread
        # of its own: asyncio's bridge resolves it from the executor's callback.
        result: T = await asyncio.wrap_future(future)
    return result


@dataclass
class Launched:
    """A process that now exists: its pid, how to learn its exit, and how to feed it."""

    pid: int
    watch: ExitWatch
    #: For spawned and fork-server workers: the pipe the parent writes the pickled call to.
    payload_fd: int | None = None


def kill_and_reap(launched: Launched) -> None:
    """SIGKILL a process that exists but could not be recorded, and reap it (blocks briefly)."""
    _platform.signal_group(launched.pid, signal.SIGKILL)
    try:
        os.waitid(os.P_PID, launched.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        pass  # a fork-server worker: not our child; its server reaps it
    launched.watch.reap()


def _watch_or_kill(pid: int) -> ExitWatch:
    """``watch_child(pid)``; if that fails (EMFILE on the pidfd), the child is not left behind."""
    with contextlib.ExitStack() as cleanup_on_fail:
        cleanup_on_fail.callback(_kill_and_wait, pid)
        watch = watch_child(pid)
        cleanup_on_fail.pop_all()
    return watch


def _kill_and_wait(pid: int) -> None:
    """SIGKILL our child ``pid`` (and its group) and reap it."""
    _platform.signal_group(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    runtime.own_children.discard(pid)


def _register(popen: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    runtime.own_children.add(popen.pid)
    return popen


def _disown(popen: subprocess.Popen[bytes]) -> None:
    # The exit is watched and the zombie reaped by our ExitWatch, after teardown. Left
    # with returncode None, subprocess would put a collected Popen on its _active list
    # and reap the pid behind our back, freeing the pid/pgid while we may still signal it.
    popen.returncode = 0


def python_command(code: str) -> list[str]:
    """The command line of a fresh interpreter, with this one's flags, running ``code``."""
    # The directory that holds the ``aioelastic`` package (this file is
    # aioelastic/_core/start/).
    package_parent = str(Path(__file__).resolve().parents[3])
    bootstrap = f"import sys; sys.path.append({package_parent!r}); {code}"
    import multiprocessing.spawn  # only a spawned interpreter needs it (see preparation_data)

    return [
        multiprocessing.spawn.get_executable(),
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        bootstrap,
    ]


def start_python(
    code: str,
    env: dict[str, str],
    stdout_fd: int | None,
    stderr_fd: int | None,
    pass_fds: Sequence[int],
    stdin_fd: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start a fresh interpreter running ``code``, in its own process group.

    No ``preexec_fn`` here (so the fast vfork path stays available): the bootstrap code
    sets the parent-death signal itself and checks that its parent is still alive.
    """
    with _subreaper.creation_guard():
        return _register(
            subprocess.Popen(
                python_command(code),
                env=env,
                stdin=subprocess.DEVNULL if stdin_fd is None else stdin_fd,
                stdout=stdout_fd,
                stderr=stderr_fd,
                pass_fds=tuple(pass_fds),
                close_fds=True,
                **_platform.new_group_popen_kwargs(),
            )
        )


def preparation_data(name: str) -> dict[str, object]:
    """What a fresh interpreter needs to unpickle our functions (``multiprocessing``'s).

    It makes the child re-import our ``__main__`` as ``__mp_main__`` and adopt our
    ``sys.path`` and working directory. The authentication key is dropped: it is only
    for ``multiprocessing`` connections, which our workers do not use, and it refuses to
    be pickled outside ``multiprocessing``'s own spawning.
    """
    # Imported here: a group of binaries never needs it, and its import would cost a
    # service's first start ~3 ms of its event loop.
    import multiprocessing.spawn

    data: dict[str, object] = multiprocessing.spawn.get_preparation_data(name)
    data.pop("authkey", None)
    return data


def start_spawn(
    env: dict[str, str],
    stdout_fd: int | None,
    stderr_fd: int,
    result_fd: int,
    stdin_fd: int | None = None,
) -> Launched:
    """Start a spawned function worker; the caller writes the call to ``payload_fd``."""
    with contextlib.ExitStack() as always_cleanup, contextlib.ExitStack() as cleanup_on_fail:
        payload_r, payload_w = os.pipe2(os.O_CLOEXEC)
        always_cleanup.callback(os.close, payload_r)  # the child's end
        cleanup_on_fail.callback(os.close, payload_w)
        popen = start_python(
            "from aioelastic._core.process._platform import default_signal_state; "
            "default_signal_state(python=True); "
            "from aioelastic._core.child._bootstrap import spawn_main; "
            f"spawn_main({payload_r}, {result_fd}, {os.getpid()})",
            env,
            stdout_fd,
            stderr_fd,
            pass_fds=(payload_r, result_fd),
            stdin_fd=stdin_fd,
        )
        # Reaped by us either way: subprocess must never poll this pid (see _disown).
        always_cleanup.callback(_disown, popen)
        watch = _watch_or_kill(popen.pid)
        cleanup_on_fail.pop_all()
    return Launched(popen.pid, watch, payload_fd=payload_w)


def flush_std_streams() -> None:
    """Flush our own stdio so a forked child does not inherit (and repeat) buffered text."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass


def start_fork(
    call: FunctionCall,
    stdout_fd: int | None,
    stderr_fd: int,
    result_fd: int,
    parent_side_fds: Sequence[int],
    stdin_fd: int | None = None,
) -> Launched:
    """Fork a function worker from this process (``multiprocessing``'s "fork" semantics)."""
    flush_std_streams()
    parent = os.getpid()
    with _subreaper.creation_guard():
        pid = os.fork()
        if pid != 0:
            runtime.own_children.add(pid)
    if pid == 0:
        try:
            forked_worker(
                parent_pid=parent,
                stdout_fd=stdout_fd,
                stderr_fd=stderr_fd,
                result_fd=result_fd,
                close_fds=parent_side_fds,
                call=call,
                stdin_fd=stdin_fd,
            )
        finally:
            # forked_worker never returns; this catches an exception raised before its
            # own try (a signal at its first line), which must not unwind into the pool.
            os._exit(1)
    # Both sides call setpgid: whichever runs first wins, so a signal to the group can
    # never arrive before the group exists.
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    return Launched(pid, _watch_or_kill(pid))
