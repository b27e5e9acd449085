"""Session-wide checks: no test may leave a process, a zombie or a file descriptor behind.

Every test runs with a unique marker in the environment (``AIOELASTIC_TEST_MARK``).
Workers, their children and even descendants that escaped into their own session inherit
it, so after the test any live process carrying the marker is a leak, wherever it was
re-parented. Zombies are attributed by parent: a zombie child of the test process is a
worker the supervisor did not reap. (Orphans re-parented to PID 1 are PID 1's to reap;
on this project's CI machines PID 1 does not reap at all, so those are not counted.)
The checks themselves live in ``tests/support/audit.py``, which the soak and the cancellation
tests use for each of their rounds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.audit import (
    MARK_VAR,
    fds_opened_since,
    fork_server_pids,
    is_spare,
    kill_all,
    live_children,
    long_lived_pids,
    new_zombies,
    open_fds,
    processes_with_env,
    zombie_children,
)

#: Fixtures that more than one folder's tests ask for by name.
pytest_plugins = ["tests.support.torch_fixtures", "tests.support.slurm_cluster"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``torch`` where torch is not installed (CI's Python 3.10 run)."""
    if importlib.util.find_spec("torch") is not None:
        return
    skip = pytest.mark.skip(reason="needs torch (pip install -c constraints.txt '.[torch]')")
    for item in items:
        if "torch" in item.keywords:
            item.add_marker(skip)


#: The session's own temporary directory (see :func:`pytest_configure`).
_SESSION_TMP = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Give the session a temporary directory of its own, removed after a passing run.

    Runs without a ``log_dir`` that are meant to fail keep their temporary log roots (a
    root holding files is the user's and never deleted), and torch's launcher leaves its
    ``torchelastic_*`` directories behind: without this, every run of the suite left
    about a thousand directories in the machine's ``/tmp``. Children inherit ``TMPDIR``.
    """
    # Started as a background job of a non-interactive shell (`cmd &` in a script), the
    # suite inherits SIGINT and SIGQUIT ignored, and so would every process it starts:
    # the tests of what Ctrl-C does would test that instead.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    path = tempfile.mkdtemp(prefix="aioelastic-tests-")
    config.stash[_SESSION_TMP] = path
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the session's temporary directory, unless a test failed (then say where)."""
    path = session.config.stash[_SESSION_TMP]
    if exitstatus == 0:
        shutil.rmtree(path, ignore_errors=True)
    else:
        print(f"\ntemporary files of this test run kept in {path}", file=sys.stderr)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail the test that leaves a live process, an unreaped child or an open fd behind."""
    mark = uuid.uuid4().hex
    os.environ[MARK_VAR] = mark
    fds_before = open_fds()
    zombies_before = set(zombie_children())
    try:
        yield
    finally:
        del os.environ[MARK_VAR]
    problems = []
    helpers = long_lived_pids()
    leaked = [pid for pid in processes_with_env(MARK_VAR, mark) if pid not in helpers]
    # Workers that never exec'd (fork, fork server) do not show the mark: look for them as
    # children of this process and of the warm fork servers.
    for parent in [os.getpid(), *fork_server_pids()]:
        leaked += [p for p in live_children(parent) if p not in helpers and p not in leaked]
    leaked = [pid for pid in leaked if not is_spare(pid)]
    if leaked:
        problems.append(f"live processes left behind: {leaked}")
        kill_all(leaked)
    zombies = new_zombies(zombies_before)
    if zombies:
        problems.append(f"unreaped children (zombies): {zombies}")
        for pid in zombies:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # reaped by the code under test meanwhile
    new_fds = fds_opened_since(fds_before)
    if new_fds:
        problems.append(f"file descriptors left open: {new_fds}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def tmp_log_dir(tmp_path: Path) -> Path:
    """A log directory that does not exist yet (start_processes creates it)."""
    return tmp_path / "logs"


@pytest.fixture
def private_tmp(tmp_path: Path) -> Iterator[Path]:
    """Send every temporary directory of this test to a directory of its own.

    The machine is shared: other runs create aioelastic_* directories in /tmp too, and a
    test that checks for leftover temporary directories must see only its own.
    """
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp)
    try:
        yield tmp
    finally:
        tempfile.tempdir = saved
