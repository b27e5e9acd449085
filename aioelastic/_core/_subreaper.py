"""Optional subreaper mode: adopt, stop and reap descendants that escaped their group.

Teardown signals each worker's process group, so a descendant that left it (``setsid``,
``setpgid``: some daemons and launchers do) escapes the signals; once its parent dies the
kernel re-parents it to init. With ``PR_SET_CHILD_SUBREAPER`` it is re-parented to the
supervisor instead, and each teardown kills and reaps every such stray.

Off by default: inside a host program (a service, a notebook) the host's own
subprocesses are children too, and a library must not kill or reap processes it did not
start. Turn it on in a process that owns its supervision — the CLI and the agent do.
Then *every* child of the process that aioelastic did not start (workers, fork servers,
the watchdog) is treated as a stray at teardown.
"""

from __future__ import annotations

import os
import signal
from contextlib import AbstractContextManager, nullcontext

import anyio

from . import _platform
from ._runtime import runtime

STRAY_KILL_TIMEOUT = 5.0


def enable_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux); ``False`` if unsupported.

    Irreversible for the process's lifetime. See the module documentation for when to
    use it.
    """
    # PR_SET_CHILD_SUBREAPER is not inherited by fork(): the runtime resets the flag in a
    # forked child, which must set it again for its own descendants.
    if not runtime.subreaper_enabled:
        runtime.subreaper_enabled = _platform.set_child_subreaper()
    return runtime.subreaper_enabled


def subreaper_enabled() -> bool:
    """Whether :func:`enable_subreaper` succeeded in this process."""
    return runtime.subreaper_enabled


async def sweep_strays() -> list[int]:
    """Kill and reap every child this process has that aioelastic did not start.

    Returns the pids swept. A no-op unless subreaper mode is enabled.
    """
    if not runtime.subreaper_enabled:
        return []
    with runtime.own_children_lock:
        strays = {
            pid: state
            for pid, state in _platform.children_of(os.getpid()).items()
            if pid not in runtime.own_children
        }
    pidfds = []
    for pid, state in strays.items():
        if state == "Z":
            continue
        try:
            # An escaped process may lead a group of its own: take that down too.
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        fd = _platform.pidfd_open(pid)
        if fd is not None:
            pidfds.append(fd)
    try:
        with anyio.move_on_after(STRAY_KILL_TIMEOUT):
            for fd in pidfds:
                await anyio.wait_readable(fd)
    finally:
        for fd in pidfds:
            os.close(fd)
    for pid in strays:
        try:
            os.waitpid(pid, 0)  # SIGKILLed above: this returns at once
        except ChildProcessError:
            pass
    return sorted(strays)


def creation_guard() -> AbstractContextManager[object]:
    """Hold while creating a child and adding it to ``runtime.own_children``.

    Only needed (and only taken) in subreaper mode, where a sweep must never see a child
    that was forked but not yet registered.
    """
    return runtime.own_children_lock if runtime.subreaper_enabled else nullcontext()
