"""A supervisor that forks with all of its process-wide state in use.

For tests/core/process/test_runtime.py.

Run as ``python -m tests.children.runtime``. It starts everything the runtime holds (the
launcher threads, the watchdog, a warm fork server, the console writer, the exit-waiter
limiter, subreaper mode, the stdin and log-root flags), has another thread hold the locks,
then calls ``os.fork()``. The forked child checks that it inherited none of it and that
the launcher threads and the console work for it (each within a deadline), and reports
each check through a pipe; its exit code is 0 only if every check passed. The supervisor
prints the report as one JSON line and exits with the child's exit code.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import anyio

from aioelastic._core.output._console import console
from aioelastic._core.process._runtime import Runtime, runtime
from aioelastic._core.process._subreaper import enable_subreaper, subreaper_enabled
from aioelastic._core.start import _forkserver
from aioelastic._core.start._launchers import launcher_pool, on_launcher_thread
from aioelastic._core.start._watchdog import watchdog

#: How long the child gives the launcher threads and the console to answer.
CHILD_TIMEOUT = 20.0


def _fd_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


async def _use_everything() -> None:
    await on_launcher_thread(watchdog.ensure_started)
    await _forkserver.fork_server(()).warm_up()
    console("stdout").put(b"parent console line\n")
    await console("stdout").flush()


async def _print_in_child() -> None:
    with anyio.fail_after(CHILD_TIMEOUT):
        console("stdout").put(b"child console line\n")
        await console("stdout").flush()


def _child_checks(
    parent_fds: dict[str, int], old_server: _forkserver.ForkServer
) -> dict[str, bool]:
    fresh = Runtime()
    # Taken without blocking: a lock the parent's other thread held must be a new one.
    checks: dict[str, bool] = {
        "lock is free": runtime.lock.acquire(blocking=False),
        "own_children_lock is free": runtime.own_children_lock.acquire(blocking=False),
        "watchdog lock is free": watchdog._lock.acquire(blocking=False),
    }
    runtime.lock.release()
    runtime.own_children_lock.release()
    watchdog._lock.release()
    for name, value in vars(fresh).items():
        if name.startswith("_") or isinstance(value, type(threading.Lock())):
            continue
        checks[f"{name} is as in a fresh process"] = getattr(runtime, name) == value
    checks.update(
        {
            "no launcher pool": runtime.launcher_pool is None,
            "no fork server": _forkserver.running_server_pids() == [],
            "no fork-server fd": _forkserver.open_server_fds() == [],
            "parent's fork-server socket closed": _fd_closed(parent_fds["server"]),
            "old fork-server object detached": old_server.pid is None and old_server._sock is None,
            "no watchdog": watchdog.pid is None and watchdog.fileno() is None,
            "parent's watchdog socket closed": _fd_closed(parent_fds["watchdog"]),
            "no console": runtime.consoles == {} and runtime.console_locks == {},
            "not a subreaper": not subreaper_enabled(),
            "no children of its own": runtime.own_children == set(),
            "stdin not forwarded": not runtime.stdin_forwarded,
            "log roots not swept": not runtime.stale_log_roots_swept,
        }
    )
    # on_launcher_thread is shielded from cancellation: wait on the pool's future
    # directly, with a deadline, so that an inherited pool (no threads) fails the check.
    try:
        ran_on = launcher_pool().submit(os.getpid).result(timeout=CHILD_TIMEOUT)
    except TimeoutError:
        ran_on = None
    checks["launcher threads work"] = ran_on == os.getpid()
    try:
        anyio.run(_print_in_child)
    except TimeoutError:
        checks["console works"] = False
    else:
        checks["console works"] = True
    return checks


def _run_child(
    report_w: int, parent_fds: dict[str, int], old_server: _forkserver.ForkServer
) -> None:
    code = 1
    try:
        checks = _child_checks(parent_fds, old_server)
        os.write(report_w, json.dumps(checks).encode())
        code = 0 if all(checks.values()) else 1
    finally:
        os._exit(code)


def _holding_locks(forked: threading.Event) -> tuple[threading.Thread, threading.Event]:
    held = threading.Event()

    def hold() -> None:
        with runtime.lock, runtime.own_children_lock, watchdog._lock:
            held.set()
            forked.wait()

    thread = threading.Thread(target=hold, name="holds the runtime's locks")
    thread.start()
    return thread, held


def main() -> int:
    """Fork with everything in use; print the child's report and return its exit code."""
    assert enable_subreaper(), "subreaper mode unavailable here"
    anyio.run(_use_everything)
    runtime.stdin_forwarded = True
    runtime.stale_log_roots_swept = True
    server = _forkserver.fork_server(())
    [server_fd] = _forkserver.open_server_fds()
    watchdog_fd = watchdog.fileno()
    assert server.pid is not None
    assert watchdog_fd is not None
    assert {server.pid, watchdog.pid} <= runtime.own_children
    parent_fds = {"server": server_fd, "watchdog": watchdog_fd}

    report_r, report_w = os.pipe()
    forked = threading.Event()
    holder, held = _holding_locks(forked)
    held.wait()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        _run_child(report_w, parent_fds, server)
    forked.set()
    holder.join()
    os.close(report_w)
    with os.fdopen(report_r, "rb") as report:
        text = report.read().decode()
    _, status = os.waitpid(pid, 0)
    print(text or "{}", flush=True)
    code: int = os.waitstatus_to_exitcode(status)
    return code


if __name__ == "__main__":
    sys.exit(main())
