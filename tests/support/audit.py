"""What a test or a round left behind: live processes, unreaped children, open descriptors.

The session fixture in ``conftest.py`` fails any test that leaves one of these; the soak
and the cancellation tests audit each of their many rounds with the same functions and
collect the problems in an :class:`Audit` instead of failing at the first one.

Processes aioelastic keeps on purpose between runs (warm fork servers, the watchdog) and
their descriptors are never counted.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio

from aioelastic._core.process._platform import children_of, proc_stat
from tests.support.waits import is_running, process_state

#: The environment variable :func:`tests.conftest.no_leaks` marks each test's processes with
#: (a value of its own per test): every descendant inherits it.
MARK_VAR = "AIOELASTIC_TEST_MARK"


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what each points at."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the fd listdir itself used, closed by now
    return fds


def fds_opened_since(before: dict[int, str]) -> dict[int, str]:
    """Descriptors open now that were not open (to the same target) in ``before``.

    The descriptors of the long-lived helpers are left out: a warm fork server or the
    watchdog started during the test stays for the next one.
    """
    kept = long_lived_fds()
    return {
        fd: target
        for fd, target in open_fds().items()
        if fd not in kept and before.get(fd) != target
    }


def zombie_children() -> list[int]:
    """Children of this process that exited and were not reaped."""
    return [pid for pid, state in children_of(os.getpid()).items() if state == "Z"]


def new_zombies(before: set[int]) -> list[int]:
    """:func:`zombie_children` that were not zombies already in ``before``."""
    return [pid for pid in zombie_children() if pid not in before]


def live_children(parent: int) -> list[int]:
    """Running children of ``parent``.

    Fork-method and fork-server workers never exec, so their /proc environ is their
    parent's original one, without a test's mark: they are found by parent instead.
    """
    return [pid for pid, state in children_of(parent).items() if state not in ("Z", "X")]


def process_tree(root: int) -> list[int]:
    """``root`` and every descendant of it (by parent), as ``/proc`` lists them now.

    What a scheduler signals when it ends a job: every process of its cgroup.
    """
    tree, i = [root], 0
    while i < len(tree):
        pid, i = tree[i], i + 1
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    tree += [int(child) for child in f.read().split() if int(child) not in tree]
        except OSError:
            pass  # gone meanwhile: so are the children it had
    return tree


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes (zombies excluded, this one too) whose environment has ``name=value``.

    A mark in the environment is inherited by every descendant, even one that escaped into
    its own session or was re-parented, so it finds what a parent-child walk cannot.
    """
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # gone, or not ours to read
        if needle in environ.split(b"\0") and is_running(int(entry)):
            found.append(int(entry))
    return found


def fork_server_pids() -> list[int]:
    """The warm fork servers of this process."""
    from aioelastic._core.start import _forkserver

    return list(_forkserver.running_server_pids())


def is_spare(pid: int) -> bool:
    """Whether ``pid`` is a spare worker a warm fork server keeps forked ahead (waiting).

    Checked per process when a leak is suspected: a server forks its spares while idle,
    so a list of spares taken a moment earlier may already be short of a new one.
    """
    from aioelastic._core.child._forkserver_process import SPARE_NAME

    try:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().rstrip("\n") != SPARE_NAME:
                return False
        fields = proc_stat(pid, 2)
        if fields is None:
            return False
        parent = int(fields[1])
    except (OSError, ValueError, IndexError):
        return False
    return parent in fork_server_pids()


def spare_pids(server_pid: int | None = None) -> list[int]:
    """The spare workers the warm fork servers (or one) keep forked ahead, waiting."""
    from aioelastic._core.child._forkserver_process import SPARE_NAME

    spares = []
    for server in fork_server_pids() if server_pid is None else [server_pid]:
        for pid in live_children(server):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().rstrip("\n") == SPARE_NAME:
                        spares.append(pid)
            except OSError:
                pass
    return spares


def long_lived_pids() -> set[int]:
    """Processes aioelastic keeps on purpose between runs (warm fork servers, watchdog)."""
    from aioelastic._core.start._watchdog import watchdog
    from tests.support.slurm_cluster import daemon_pids

    pids = set(fork_server_pids())
    pids.update(spare_pids())
    pids.update(daemon_pids())
    if watchdog.pid is not None:
        pids.add(watchdog.pid)
    return pids


def long_lived_fds() -> set[int]:
    """This process's descriptors to the processes of :func:`long_lived_pids`."""
    from aioelastic._core.start import _forkserver
    from aioelastic._core.start._watchdog import watchdog

    fds = set(_forkserver.open_server_fds())
    if watchdog.fileno() is not None:
        fds.add(watchdog.fileno())  # type: ignore[arg-type]
    return fds


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited on its own meanwhile


async def reaped(pid: int, timeout: float) -> str | None:
    """The state of worker ``pid`` once reaped (``None``), or its state when ``timeout`` passed.

    A fork server reaps its workers when the supervisor releases them, a message it
    handles on its own time; no event tells us when it did, so this checks the process
    table at short intervals, bounded.
    """
    deadline = time.monotonic() + timeout
    while (state := process_state(pid)) is not None and time.monotonic() < deadline:
        await anyio.sleep(0.005)
    return state


@dataclass
class Audit:
    """What one round lost, and why (the round's description leads every problem)."""

    lost: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    #: Leftovers of a known bug awaiting its fix, shown apart (see test_soak's
    #: KNOWN_BUGS_PENDING).
    known: Counter[str] = field(default_factory=Counter)

    def fail(self, category: str | None, text: str, count: int = 1) -> None:
        """Record a problem, counted under ``category`` (``None``: not a lost resource)."""
        if category is not None:
            self.lost[category] += count
        self.problems.append(text)


def audit_fds(before: dict[int, str], audit: Audit) -> None:
    """No descriptor opened since ``before`` is still open (warm helpers aside)."""
    leaked = fds_opened_since(before)
    if leaked:
        audit.fail("fds", f"file descriptors left open: {leaked}", len(leaked))
