"""Optional subreaper mode: adopt, stop and reap what workers left behind.

Teardown signals each worker's process group, so a descendant that left it (``setsid``,
``setpgid``: some daemons and launchers do) escapes the signals; once its parent dies the
kernel re-parents it to init. With ``PR_SET_CHILD_SUBREAPER`` it is re-parented to the
supervisor instead, and each teardown kills and reaps every such stray.

Which children are strays. The kernel re-parents *every* orphaned descendant to the
subreaper, and the supervisor has children that are not its workers': the processes it
was given before it started (``sidecar & exec aioelastic-run ...``: the shell's
background job is the launcher's child since the ``exec``), and in library use the host
program's own subprocesses and their orphans. None of them may be killed, nor reaped:
reaping takes the host's exit status away. So in subreaper mode every worker's
environment carries :data:`LINEAGE_ENV`, holding a random token of this process
(appended to the tokens already there, so that a supervisor nested in a worker and the
one above it both know the worker's descendants). Everything a worker starts inherits
it, across ``setsid`` and a daemon's double fork, and ``/proc/PID/environ`` shows the
environment a process was *executed* with, which it cannot rewrite with ``setenv``. A
sweep takes a child that aioelastic did not start itself only if its
``/proc/PID/environ`` carries this process's token, or if it is in the process group of
a worker just torn down (a member re-parented here when its worker died, then killed
with the group: a zombie by now, whose environment is gone with its memory, but which
keeps its group until reaped). Every other child is left alone, not signalled and not
reaped. Why not another mark: once a process is re-parented the
kernel keeps no trace of its ancestry; its process group and session are exactly what
an escaping process changes; a cgroup per supervisor needs a delegated hierarchy; and a
list of the children present when subreaper mode was turned on misses what a host
starts later.

What a sweep cannot recognise, and so leaves running (or unreaped):

* a process forked without exec by a ``fork``-started worker (or by such a process): its
  ``/proc/PID/environ`` is the supervisor's own, as executed, without the token, until
  it executes something. (Fork-server workers are fine: the server is executed with the
  token, and their forks show its environment.)
* a process executed with an environment that leaves the variable out (``env -i``, a
  program that builds its children's environment from scratch);
* a process whose environment cannot be read (executed set-uid, or made not dumpable);
* a stray outside the workers' groups that exited by itself before the sweep: a zombie
  has no environment left to read, so it stays a zombie until the supervisor exits;
* the descendants of workers started before subreaper mode was turned on (their
  environment has no mark), and of fork-server workers whose server was.

Off by default: the flag is process-wide and irreversible, and every orphan of the
process's descendants comes to it, a host's own too; those are left alone, so once they
exit they stay zombies unless the host reaps them (init would have). Turn it on in a
process that owns its supervision, before its workers start — the CLI does.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager, nullcontext

import anyio

from . import _platform
from ._runtime import runtime

logger = logging.getLogger("aioelastic")

#: The variable that marks a worker's environment, and so its descendants', as this
#: supervisor's: one token per supervising process, ``:``-separated when nested.
LINEAGE_ENV = "AIOELASTIC_LINEAGE"
STRAY_KILL_TIMEOUT = 5.0
#: Sweeps in a row at most. A stray's own children that left its group are re-parented
#: to us once it is killed, and the next sweep takes them; the bound keeps a process
#: that forks as fast as it is killed from holding teardown forever.
_MAX_SWEEPS = 8


def enable_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux); ``False`` if unsupported.

    Irreversible for the process's lifetime. From then on every teardown kills and reaps
    the descendants of this process's workers that were re-parented here (those that
    left their worker's process group included); other children of the process (the
    host program's own subprocesses, or whatever its parent gave it) are left alone.
    Call it before starting workers: only workers started in subreaper mode are marked.
    See the module documentation for the limits.
    """
    # PR_SET_CHILD_SUBREAPER is not inherited by fork(): the runtime resets the flag in a
    # forked child, which must set it again for its own descendants.
    if not runtime.subreaper_enabled:
        runtime.subreaper_enabled = _platform.set_child_subreaper()
    return runtime.subreaper_enabled


def subreaper_enabled() -> bool:
    """Whether :func:`enable_subreaper` succeeded in this process."""
    return runtime.subreaper_enabled


def lineage_env(env: Mapping[str, str]) -> dict[str, str]:
    """What to lay over the environment ``env`` of a process we start, to mark it as ours.

    Empty outside subreaper mode, where no sweep reads it. ``env`` is what the process
    gets without the mark: a token from a supervisor above is kept, this process's is
    appended.
    """
    if not runtime.subreaper_enabled:
        return {}
    with runtime.lock:
        if runtime.lineage_token is None:
            # What secrets.token_hex reads, without importing secrets: hashlib and
            # hmac load OpenSSL, a cost paid inside a service's first start.
            runtime.lineage_token = os.urandom(8).hex()
        token = runtime.lineage_token
    inherited = env.get(LINEAGE_ENV, "")
    if token in inherited.split(":"):
        return {LINEAGE_ENV: inherited}
    return {LINEAGE_ENV: f"{inherited}:{token}" if inherited else token}


async def sweep_strays(groups: Collection[int] = ()) -> list[int]:
    """Kill and reap this process's children that descend from its workers.

    Args:
        groups: The process groups of the workers just torn down. A child in one of them
            was a member of a worker's group, re-parented here when its worker died and
            killed with the group: a zombie by now, which no environment identifies.

    Returns the pids swept. Those that were still running are named, with their command
    lines, in one warning. A no-op unless subreaper mode is enabled and a worker was
    marked.
    """
    token = runtime.lineage_token
    if not runtime.subreaper_enabled or token is None:
        return []
    groups = set(groups)
    killed: dict[int, str] = {}
    swept: list[int] = []
    try:
        for _ in range(_MAX_SWEEPS):
            running, exited = _strays(token, groups)
            if not running and not exited:
                break
            killed.update(running)
            swept += [*running, *exited]
            groups.update(await _kill_and_reap([*running, *exited]))
    finally:
        if killed:
            logger.warning(
                "aioelastic: killed %d process%s left behind by workers (re-parented to "
                "this subreaper): %s",
                len(killed),
                "" if len(killed) == 1 else "es",
                ", ".join(f"{pid} ({command})" for pid, command in sorted(killed.items())),
            )
    return sorted(swept)


def _strays(token: str, groups: Collection[int]) -> tuple[dict[int, str], list[int]]:
    """Our children that descend from workers: the running ones (with commands), the zombies.

    A child is one if its environment carries ``token``, or if it is in one of
    ``groups``, the groups of workers (a member, even a zombie, keeps the group id
    taken, so it cannot name another group meanwhile). Under the lock: a worker we
    started (marked too) is only seen once it is registered as ours.
    """
    running: dict[int, str] = {}
    exited: list[int] = []
    with runtime.own_children_lock:
        for pid, (state, pgrp) in _platform.children_and_groups(os.getpid()).items():
            if pid in runtime.own_children:
                continue
            if state in ("Z", "X"):
                # Its environment is gone with its memory: only its group tells.
                if pgrp in groups:
                    exited.append(pid)
                continue
            if pgrp not in groups:
                lineage = _platform.exec_environ_value(pid, LINEAGE_ENV)
                if lineage is None or token not in lineage.split(":"):
                    continue
            # Read now: once killed, it has no command line left.
            running[pid] = _platform.command_line(pid)
    return running, exited


async def _kill_and_reap(pids: Collection[int]) -> set[int]:
    """SIGKILL each of ``pids`` (our children) and its group if it leads one; reap them.

    Returns the groups killed: their other members, children of the ones killed, are
    re-parented here as they die.
    """
    pidfds = []
    groups = set()
    for pid in pids:
        try:
            # An escaped process may lead a group of its own: take that down too.
            if os.getpgid(pid) == pid:
                groups.add(pid)
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
    for pid in pids:
        try:
            os.waitpid(pid, 0)  # SIGKILLed above: this returns at once
        except ChildProcessError:
            pass
    return groups


def creation_guard() -> AbstractContextManager[object]:
    """Hold while creating a child and adding it to ``runtime.own_children``.

    Only needed (and only taken) in subreaper mode, where a sweep must never see a child
    that was forked but not yet registered.
    """
    return runtime.own_children_lock if runtime.subreaper_enabled else nullcontext()
