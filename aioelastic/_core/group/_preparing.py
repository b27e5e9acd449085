"""Preparing a group's start: its log directory and files, and each rank's environment and call.

Everything that can fail before a worker exists is done here, for every rank, before the
first start: a call that cannot be pickled, a log directory that is a file, a full disk.
What the start method adds (the pickled call, the environment a binary gets) comes from
its :class:`~._start_methods.StartMethod`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import sys
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar

from ..aio._pace import pace
from ..child._bootstrap import FunctionCall
from ..child._error_file import ERROR_FILE_ENV
from ..hangs._guard import HangGuard
from ..output import _log_root as log_root
from ..output._logs import create_log
from ..output._std import Std
from ..start._launchers import on_launcher_thread
from ._validate import GroupSpec

logger = logging.getLogger("aioelastic")

T = TypeVar("T")

#: Groups up to this size make their FIFOs on the event loop (files are always removed
#: on a launcher thread: see ``PContext._removing``).
FILES_ON_LOOP = 8
#: Whether group files are made on the event loop (see prepare_group).
PREPARE_ON_LOOP = sys.version_info >= (3, 11)

# Start errors that mean a resource limit was hit, and the limit to name in the message.
_LIMIT_HINTS = {
    errno.EMFILE: ("", "ulimit -n", resource.RLIMIT_NOFILE),
    errno.ENFILE: ("", "ulimit -n", resource.RLIMIT_NOFILE),
    errno.EAGAIN: (" (no more processes)", "ulimit -u", resource.RLIMIT_NPROC),
    errno.ENOMEM: ("", "ulimit -v", resource.RLIMIT_AS),
}


def raise_start_error(exc: BaseException, what: str) -> NoReturn:
    """Re-raise ``exc``; a resource limit as an OSError naming the limit and what failed."""
    if not isinstance(exc, OSError) or exc.errno not in _LIMIT_HINTS:
        raise exc
    reason, command, limit = _LIMIT_HINTS[exc.errno]
    soft, _ = resource.getrlimit(limit)
    now = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    raise OSError(
        exc.errno,
        f"cannot start {what}: {os.strerror(exc.errno)}{reason}; "
        f"raise the limit with `{command}` (now {now}) or start fewer workers",
    ) from exc


async def blocking(nprocs: int, fn: Callable[[], T]) -> T:
    """``fn()``, blocking file work for each rank: here for a small group, else on a thread.

    On a thread always on Python 3.10, where a Ctrl-C could cut it in half (see
    :func:`prepare_group`).
    """
    if nprocs <= FILES_ON_LOOP and PREPARE_ON_LOOP:
        await pace()
        return fn()
    return await on_launcher_thread(fn)


class RankPreparer(Protocol):
    """What a start method adds to a rank's preparation (its half of the start-method seam)."""

    def runs_python(self, rank: int) -> bool:
        """Whether ``rank`` runs our Python hooks (answers stack requests, uses timers)."""
        ...

    def prepare(
        self, rank: int, error_file: str, overlay: dict[str, str]
    ) -> tuple[dict[str, str], FunctionCall | bytes | None]:
        """The environment and call (payload) of ``rank``; ``overlay`` is what it adds to ours.

        Raises:
            ValueError: the call cannot be made into what this method sends.
        """
        ...


@dataclass(frozen=True)
class Prepared:
    """What one rank needs to start: its environment, error file, call and log files."""

    env: dict[str, str]
    error_file: str
    #: ``None`` for a binary, the call itself for fork, else its pickled form.
    payload: FunctionCall | bytes | None
    #: The created log files of the logged streams, until a pump takes them over.
    log_fds: dict[Std, int] = field(default_factory=dict)

    def take_log(self, stream: Std) -> int | None:
        """The log file of ``stream`` (``None`` if not logged); the caller now owns it."""
        return self.log_fds.pop(stream, None)

    def close_logs(self) -> None:
        """Close the log files nobody took over (a start that failed); idempotent."""
        while self.log_fds:
            os.close(self.log_fds.popitem()[1])


def close_logs(prepared: Mapping[int, Prepared]) -> None:
    """Close the log files no worker took over, of every rank in ``prepared``."""
    for rank_prep in prepared.values():
        rank_prep.close_logs()


@dataclass(frozen=True)
class GroupFiles:
    """Where a group's files are: its log root and each rank's directory."""

    name: str
    root: Path
    #: Each rank's log directory, as text: the per-rank paths are made by hundreds per
    #: start, and pathlib's objects cost as much as the rest of a rank's set-up.
    rank_dirs: list[str]
    #: The streams of each rank written to log files (see :func:`logged_streams`).
    logged: list[Std]
    #: Whether ``root`` is a temporary directory of ours (``log_dir=None``).
    temporary: bool

    def log_path(self, rank: int, stream: Std) -> str:
        """The log file of ``stream`` of ``rank``, whether or not it is written."""
        name = "stdout.log" if stream is Std.OUT else "stderr.log"
        return os.path.join(self.rank_dirs[rank], name)

    def logged_path(self, rank: int, stream: Std) -> str:
        """The log file of ``stream`` of ``rank``; ``""`` when that stream is not logged."""
        return self.log_path(rank, stream) if stream in self.logged[rank] else ""

    def remove_temporary(self) -> None:
        """Blocking: remove the temporary log directory unless it holds something to keep."""
        if self.temporary:
            log_root.remove_if_empty(self.root, repr(self.name))


def logged_streams(spec: GroupSpec) -> list[Std]:
    """The streams of each rank written to log files.

    A tee'd stream is logged as well as shown, as in torch (and as API.md's "tee *also*
    prints it" says): the console is a view, the file is the record.
    """
    return [spec.redirects[r] | spec.tee[r] for r in range(spec.nprocs)]


async def prepare_group(
    spec: GroupSpec, method: RankPreparer, hangs: HangGuard
) -> tuple[GroupFiles, dict[int, Prepared]]:
    """Log files, environments and calls: all that can fail, before a start.

    Made on the event loop a rank at a time, within the loop's budget (:func:`pace`):
    hundreds of ranks' directories and files (a millisecond each on a slow or busy
    filesystem) would otherwise hold the loop for a second. Not on a thread: while
    the loop has other work, each hand-off between the two waits for the GIL, up to
    a switch interval (5 ms) at a time, which is what a task of the loop then sees
    as lateness. The loop writes the log files itself anyway. Python 3.10 is the
    exception: there a Ctrl-C raises KeyboardInterrupt at whatever line the main
    thread is on (3.11's asyncio turns it into a cancellation, seen at a
    checkpoint), so the files are made on a thread, where it cannot cut a step in half.
    """
    steps = _prepare_steps(spec, method, hangs)
    if not PREPARE_ON_LOOP:
        return await on_launcher_thread(_run_to_end, steps)
    # Closed early (a cancellation while it waited for its turn), the steps clean up.
    with contextlib.closing(steps):
        while True:
            await pace()
            try:
                next(steps)
            except StopIteration as done:
                prepared: tuple[GroupFiles, dict[int, Prepared]] = done.value
                return prepared


def _run_to_end(steps: Generator[None, None, T]) -> T:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result


def _prepare_steps(
    spec: GroupSpec, method: RankPreparer, hangs: HangGuard
) -> Generator[None, None, tuple[GroupFiles, dict[int, Prepared]]]:
    """:func:`prepare_group`, one rank's step per ``next()``; cleans up if closed early."""
    root = log_root.make_temporary(spec.name) if spec.log_dir is None else spec.log_dir
    files = GroupFiles(
        name=spec.name,
        root=root,
        rank_dirs=[os.path.join(root, str(rank)) for rank in range(spec.nprocs)],
        logged=logged_streams(spec),
        temporary=spec.log_dir is None,
    )
    prepared: dict[int, Prepared] = {}
    created: list[str] = []
    with contextlib.ExitStack() as cleanup_on_fail:
        if spec.log_dir is None:
            cleanup_on_fail.callback(log_root.discard, root)
        else:
            # Nothing started: the empty logs made so far would only make the next
            # start with this log_dir refuse it for holding earlier output.
            cleanup_on_fail.callback(_unlink_all, created)
        cleanup_on_fail.callback(close_logs, prepared)
        # Every rank's call and environment first (a call that cannot be pickled
        # fails the start before any file exists), then the files.
        for rank in range(spec.nprocs):
            error_file = os.path.join(files.rank_dirs[rank], "error.json")
            overlay = {**spec.envs[rank], ERROR_FILE_ENV: error_file}
            overlay.update(hangs.worker_env(rank, python=method.runs_python(rank)))
            env, payload = method.prepare(rank, error_file, overlay)
            prepared[rank] = Prepared(env, error_file, payload)
            yield
        root.mkdir(parents=True, exist_ok=True)
        for rank in range(spec.nprocs):
            rank_dir = files.rank_dirs[rank]
            try:
                os.mkdir(rank_dir)
            except FileExistsError:
                # An empty one from an earlier run (validation refused output) is
                # fine; anything else put there since validation is not.
                if not os.path.isdir(rank_dir):
                    raise
            _create_logs(spec.name, files, rank, prepared[rank], created)
            yield
        cleanup_on_fail.pop_all()
    if files.temporary and any(files.logged):
        logger.info("aioelastic: logs of %r are in %s", spec.name, root)
    return files, prepared


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _create_logs(
    name: str, files: GroupFiles, rank: int, prepared: Prepared, created: list[str]
) -> None:
    for stream in (Std.OUT, Std.ERR):
        if stream in files.logged[rank]:
            path = files.log_path(rank, stream)
            try:
                prepared.log_fds[stream] = create_log(path)
            except OSError as exc:
                raise_start_error(exc, f"worker {rank} of {name!r}")
            created.append(path)
