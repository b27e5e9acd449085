"""Session-wide checks: no test may leave a process, a zombie or a file descriptor behind.

Every test runs with a unique marker in the environment (``AIOELASTIC_TEST_MARK``).
Workers, their children and even descendants that escaped into their own session inherit
it, so after the test any live process carrying the marker is a leak, wherever it was
re-parented. Zombies are attributed by parent: a zombie child of the test process is a
worker the supervisor did not reap. (Orphans re-parented to PID 1 are PID 1's to reap;
on this project's CI machines PID 1 does not reap at all, so those are not counted.)
"""

from __future__ import annotations

import importlib.util
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioelastic._platform import children_of
from tests.waits import process_state


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``torch`` where torch is not installed (CI's Python 3.10 run)."""
    if importlib.util.find_spec("torch") is not None:
        return
    skip = pytest.mark.skip(reason="needs torch (pip install -c constraints.txt '.[torch]')")
    for item in items:
        if "torch" in item.keywords:
            item.add_marker(skip)


MARK_VAR = "AIOELASTIC_TEST_MARK"


def _processes_with_mark(mark: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``mark``."""
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ.split(b"\0") and process_state(int(entry)) not in ("Z", "X", None):
            found.append(int(entry))
    return found


def _live_children(parent: int) -> list[int]:
    """Running children of ``parent``. Fork-method and fork-server workers never exec, so
    their /proc environ is their parent's original one, without the test's mark."""
    return [pid for pid, state in children_of(parent).items() if state not in ("Z", "X")]


def _zombie_children() -> list[int]:
    return [pid for pid, state in children_of(os.getpid()).items() if state == "Z"]


def _open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return fds


def _long_lived_helper_pids() -> set[int]:
    """Processes aioelastic keeps on purpose between runs (warm fork servers, watchdog)."""
    from aioelastic import _forkserver
    from aioelastic._watchdog import watchdog

    pids = set(_forkserver.running_server_pids())
    if watchdog.pid is not None:
        pids.add(watchdog.pid)
    return pids


def _forkserver_pids() -> list[int]:
    from aioelastic import _forkserver

    return list(_forkserver.running_server_pids())


def _long_lived_helper_fds() -> set[int]:
    from aioelastic import _forkserver
    from aioelastic._watchdog import watchdog

    fds = set(_forkserver.open_server_fds())
    if watchdog.fileno() is not None:
        fds.add(watchdog.fileno())  # type: ignore[arg-type]
    return fds


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail the test that leaves a live process, an unreaped child or an open fd behind."""
    mark = uuid.uuid4().hex
    os.environ[MARK_VAR] = mark
    fds_before = _open_fds()
    zombies_before = set(_zombie_children())
    try:
        yield
    finally:
        del os.environ[MARK_VAR]
    problems = []
    helpers = _long_lived_helper_pids()
    leaked = [pid for pid in _processes_with_mark(mark) if pid not in helpers]
    # Workers that never exec'd (fork, fork server) do not show the mark: look for them as
    # children of this process and of the warm fork servers.
    for parent in [os.getpid(), *_forkserver_pids()]:
        leaked += [p for p in _live_children(parent) if p not in helpers and p not in leaked]
    if leaked:
        problems.append(f"live processes left behind: {leaked}")
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    zombies = [pid for pid in _zombie_children() if pid not in zombies_before]
    if zombies:
        problems.append(f"unreaped children (zombies): {zombies}")
        for pid in zombies:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    helper_fds = _long_lived_helper_fds()
    fds_after = _open_fds()
    new_fds = {
        fd: target
        for fd, target in fds_after.items()
        if fd not in helper_fds and fds_before.get(fd) != target
    }
    if new_fds:
        problems.append(f"file descriptors left open: {new_fds}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def tmp_log_dir(tmp_path: Path) -> Path:
    """A log directory that does not exist yet (start_processes creates it)."""
    return tmp_path / "logs"
