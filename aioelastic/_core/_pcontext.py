"""A group of local workers: start them, await their outcome, stop them.

The life of a worker, module by module: :mod:`._validate` checks the call;
:class:`PContext` creates its pipes and log files and asks :mod:`._launchers` (or the
warm :mod:`._forkserver`) for a process, whose child side is :mod:`._bootstrap`;
:mod:`._exit_watch` learns of its exit from the kernel; :mod:`._logs` pumps its output;
:mod:`._teardown` stops it; :mod:`._errors` and :mod:`._results` report what happened.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import errno
import functools
import itertools
import logging
import os
import pickle
import resource
import signal
import socket
import string
import sys
import time
from collections.abc import Callable, Collection, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from . import _launchers, _platform
from . import _log_root as log_root
from ._backend import callback_context, require_asyncio
from ._bootstrap import FunctionCall
from ._console import console
from ._errors import NOT_AVAILABLE, ProcessFailure
from ._exit_watch import ExitNotSeen, ExitOutcome
from ._forkserver import fork_server
from ._hangs import HangConfig, HangGuard, WorkerHooks
from ._lazy_event import wait_all
from ._logs import StreamPump, create_log
from ._output import DEFAULT_BUFFER, OutputHub, OutputItem, OutputStream, StreamOutput
from ._result_pipe import ResultReceiver
from ._results import RunProcsResult
from ._runtime import runtime
from ._std import Std
from ._subreaper import lineage_env
from ._teardown import CHILDREN_KILL_TIMEOUT, stop_workers
from ._terminal import ConsoleTerminals, WorkerStdio, open_worker_stdio
from ._to_the_end import to_the_end
from ._validate import GroupSpec, validate
from ._watchdog import BinaryStart, watchdog
from ._worker import WorkerProcess

logger = logging.getLogger("aioelastic")

T = TypeVar("T")

#: Groups up to this size make their FIFOs (and remove their files) on the event loop.
_FILES_ON_LOOP = 8
#: How long one stretch of a group's set-up (its files, its binaries' starts) may hold
#: the event loop before other tasks run. A task woken by a timer waits up to two of
#: them (the stretch running when its time comes, then the one queued before its
#: wake-up): 1 ms keeps that well under the 10 ms a loop may be late.
_SLICE = 0.001
#: Whether group files are made on the event loop (see PContext._prepare).
_PREPARE_ON_LOOP = sys.version_info >= (3, 11)


def _run_to_end(steps: Generator[None, None, T]) -> T:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result


#: After teardown, how long to wait for the worker pipes to reach end-of-file. Only a
#: descendant that escaped its process group (``setsid``) can keep one open that long.
IO_DRAIN_TIMEOUT = 2.0
#: How long building a failure report (reading the error file, off the event loop) may
#: take. Past it the report is made without the file: an error file replaced by a FIFO
#: or a hung network filesystem must not hold up the exit path.
REPORT_TIMEOUT = 10.0
#: Exit code reported for a worker whose exit status the kernel would not give (it was
#: reaped behind our back); its failure message says so.
UNKNOWN_EXIT_CODE = 1

# Start errors that mean a resource limit was hit, and the limit to name in the message.
_LIMIT_HINTS = {
    errno.EMFILE: ("", "ulimit -n", resource.RLIMIT_NOFILE),
    errno.ENFILE: ("", "ulimit -n", resource.RLIMIT_NOFILE),
    errno.EAGAIN: (" (no more processes)", "ulimit -u", resource.RLIMIT_NPROC),
    errno.ENOMEM: ("", "ulimit -v", resource.RLIMIT_AS),
}


@dataclass(frozen=True)
class _Prepared:
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


class PContext:
    """A running group of local workers (an async context manager).

    Made by :func:`start_processes`; the workers start when the ``async with`` block is
    entered and are all stopped when it is left, however it is left.
    """

    def __init__(self, spec: GroupSpec, hangs: HangConfig | None = None) -> None:
        self._spec = spec
        self._workers: list[WorkerProcess] = []
        self._output = OutputHub()
        self._owns_output = True
        #: Global rank by local rank and the attempt, for output items under the agent.
        self._output_ranks: Mapping[int, int] | None = None
        self._output_attempt: int | None = None
        # A binary without the stack hook never answers a stack request: no FIFO for it.
        stack_ranks = [
            r for r in range(spec.nprocs) if not spec.is_binary or _runs_stack_hook(spec.args[r])
        ]
        self._hangs = HangGuard(hangs or HangConfig(), spec.nprocs, stack_ranks=stack_ranks)
        #: Starts the workers of a binary group in batches (made when they start).
        self._binaries: _launchers.BinaryLauncher | None = None
        #: Why a rank was found hung (timer expiry, stall): the head of its failure.
        self._hang_texts: dict[int, str] = {}
        self._hang_scope: anyio.CancelScope | None = None  # made in the loop, when started
        self._entered = False
        self._started = False
        self._tg: anyio.abc.TaskGroup | None = None
        #: The context the workers' exit callbacks run in (made in the loop, when started).
        self._callbacks = contextvars.Context()
        self._io_scopes: list[anyio.CancelScope] = []
        self._done = anyio.Event()
        self._stopping = False
        self._stop_scheduled = False
        self._closing = False
        self._stopped = anyio.Event()
        self._escalate = anyio.Event()
        self._io_finished = False
        # Kept as each worker settles, so that an exit costs the same whatever N is: a
        # scan of every worker per exit made a group's end quadratic in its size.
        #: Whether any worker failed (from its exit on; its report may still be built).
        self._any_failure = False
        #: How many workers settled as succeeded.
        self._succeeded = 0
        self._log_root: Path | None = None
        #: Each rank's log directory, as text: the per-rank paths are made by hundreds
        #: per start, and pathlib's objects cost as much as the rest of a rank's set-up.
        self._rank_dirs: list[str] = []
        #: The streams of each rank written to log files (see :meth:`_logged`).
        self._logged_streams = [spec.redirects[r] | spec.tee[r] for r in range(spec.nprocs)]
        self._temporary_log_root = False

    @property
    def name(self) -> str:
        """The group's name (used in log prefixes and failure reports)."""
        return self._spec.name

    @property
    def nprocs(self) -> int:
        """Number of local workers."""
        return self._spec.nprocs

    def pids(self) -> dict[int, int]:
        """Pid of each started worker, by local rank."""
        return {w.local_rank: w.pid for w in self._ranked()}

    def output(
        self, *, replay: bool = True, buffer: int = DEFAULT_BUFFER
    ) -> OutputStream[OutputItem]:
        """Subscribe to the workers' output: every line and progress frame, live.

        ``async for item in ctx.output():`` yields an :class:`OutputItem` per line (or
        ``\\r`` frame) of every rank and stream, in the order each rank wrote them, whether
        or not the streams are redirected or tee'd, and ends once every worker's streams
        ended (the workers and their children exited, or the group was closed).
        Subscribe before or after ``async with`` is entered; any number of subscribers
        may read side by side.

        Args:
            replay: Start with what the workers wrote before this call (as much as the
                bounded history holds; ``missed`` on the first item counts what it no
                longer holds). ``False``: only what is written from now on.
            buffer: Items this subscriber may fall behind by; when more arrive, the oldest
                are dropped and the next item's ``missed`` says how many (the log files
                still hold everything). Reading slowly never slows the workers.

        Raises:
            ValueError: ``buffer`` is not a positive number of items.
        """
        return self._output.subscribe(replay=replay, buffer=buffer)

    def _share_output(self, hub: OutputHub, ranks: Mapping[int, int], attempt: int) -> None:
        """Publish into an agent's hub (spanning attempts) with global ranks, not our own."""
        self._output = hub
        self._owns_output = False
        self._output_ranks = ranks
        self._output_attempt = attempt

    def _ranked(self) -> list[WorkerProcess]:
        return sorted(self._workers, key=lambda w: w.local_rank)

    def _failed(self) -> bool:
        return self._any_failure

    # -- starting ---------------------------------------------------------------------

    async def __aenter__(self) -> PContext:
        require_asyncio("start_processes()")
        if self._entered:
            raise RuntimeError(f"PContext {self.name!r} was already started; make a new one")
        self._entered = True
        _platform.ensure_default_sigchld()
        prepared = await self._open_and_prepare()
        try:
            try:
                if not watchdog.running():
                    await _launchers.on_launcher_thread(watchdog.ensure_started)
            except OSError as exc:
                _raise_start_error(exc, f"the watchdog process of {self.name!r}")
        except BaseException:
            for rank_prep in prepared.values():
                rank_prep.close_logs()
            await self._blocking(self._hangs.close)
            raise
        self._callbacks = callback_context()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._start_all(prepared)
        except BaseException as exc:
            for rank_prep in prepared.values():
                rank_prep.close_logs()
            await self.close()
            await self._tg.__aexit__(None, None, None)
            raise exc
        self._started = True
        if self._hangs.watching:
            self._tg.start_soon(self._run_hangs)
        if self._owns_output:
            self._output.seal()  # every stream exists now: the last one to end ends output()
        # A worker that failed while its siblings were still starting had its teardown
        # held back until now, so that it covers every worker that was started.
        self._stop_if_failed()
        return self

    async def _blocking(self, fn: Callable[[], T]) -> T:
        """``fn()``, blocking file work for each rank: here for a small group, else on a thread.

        On a thread always on Python 3.10, where a Ctrl-C could cut it in half (see
        :meth:`_prepare`).
        """
        if self._spec.nprocs <= _FILES_ON_LOOP and _PREPARE_ON_LOOP:
            return fn()
        return await _launchers.on_launcher_thread(fn)

    async def _open_and_prepare(self) -> dict[int, _Prepared]:
        """The stack FIFOs, then :meth:`_prepare`."""
        await self._blocking(self._hangs.open)
        try:
            return await self._prepare()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._blocking(self._hangs.close)
            raise

    async def _prepare(self) -> dict[int, _Prepared]:
        """Log files, environments and pickled calls: all that can fail, before a start.

        Made on the event loop a slice at a time, with other tasks running in between:
        hundreds of ranks' directories and files (a millisecond each on a slow or busy
        filesystem) would otherwise hold the loop for a second. Not on a thread: while
        the loop has other work, each hand-off between the two waits for the GIL, up to
        a switch interval (5 ms) at a time, which is what a task of the loop then sees
        as lateness. The loop writes the log files itself anyway. Python 3.10 is the
        exception: there a Ctrl-C raises KeyboardInterrupt at whatever line the main
        thread is on (3.11's asyncio turns it into a cancellation, seen at a
        checkpoint), so the files are made on a thread, where it cannot cut a step in half.
        """
        steps = self._prepare_steps()
        if not _PREPARE_ON_LOOP:
            return await _launchers.on_launcher_thread(_run_to_end, steps)
        slice_end = time.monotonic() + _SLICE
        try:
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    prepared: dict[int, _Prepared] = done.value
                    return prepared
                if time.monotonic() >= slice_end:
                    await anyio.lowlevel.checkpoint()
                    slice_end = time.monotonic() + _SLICE
        except BaseException:
            steps.close()  # a cancellation at the checkpoint: the steps clean up
            raise

    def _prepare_steps(self) -> Generator[None, None, dict[int, _Prepared]]:
        """:meth:`_prepare`, one rank's step per ``next()``; cleans up if closed early."""
        spec = self._spec
        root = log_root.make_temporary(spec.name) if spec.log_dir is None else spec.log_dir
        prepared: dict[int, _Prepared] = {}
        created: list[str] = []
        rank_dirs = [os.path.join(root, str(rank)) for rank in range(spec.nprocs)]
        try:
            # Every rank's call and environment first (a call that cannot be pickled
            # fails the start before any file exists), then the files.
            for rank in range(spec.nprocs):
                prepared[rank] = self._prepare_rank(rank, rank_dirs[rank])
                yield
            root.mkdir(parents=True, exist_ok=True)
            for rank in range(spec.nprocs):
                try:
                    os.mkdir(rank_dirs[rank])
                except FileExistsError:
                    # An empty one from an earlier run (validation refused output) is
                    # fine; anything else put there since validation is not.
                    if not os.path.isdir(rank_dirs[rank]):
                        raise
                self._create_logs(rank, rank_dirs[rank], prepared[rank], created)
                yield
        except BaseException:
            for rank_prep in prepared.values():
                rank_prep.close_logs()
            if spec.log_dir is None:
                log_root.discard(root)
            else:
                # Nothing started: the empty logs made so far would only make the next
                # start with this log_dir refuse it for holding earlier output.
                for path in created:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            raise
        self._log_root = root
        self._rank_dirs = rank_dirs
        self._temporary_log_root = spec.log_dir is None
        if self._temporary_log_root and any(self._logged_streams):
            logger.info("aioelastic: logs of %r are in %s", spec.name, root)
        return prepared

    def _create_logs(
        self, rank: int, rank_dir: str, prepared: _Prepared, created: list[str]
    ) -> None:
        for stream, name in ((Std.OUT, "stdout.log"), (Std.ERR, "stderr.log")):
            if stream in self._logged(rank):
                path = os.path.join(rank_dir, name)
                try:
                    prepared.log_fds[stream] = create_log(path)
                except OSError as exc:
                    _raise_start_error(exc, f"worker {rank} of {self.name!r}")
                created.append(path)

    def _prepare_rank(self, rank: int, rank_dir: str) -> _Prepared:
        spec = self._spec
        error_file = os.path.join(rank_dir, "error.json")
        if spec.is_binary:
            # Only what this rank adds to the supervisor's environment: the watchdog lays
            # it over the one copy of ``os.environ`` sent per batch (see BinaryLauncher).
            env = {**spec.envs[rank], "TORCHELASTIC_ERROR_FILE": error_file}
            env.update(self._hangs.worker_env(rank, python=_runs_stack_hook(spec.args[rank])))
            env.update(lineage_env(collections.ChainMap(env, os.environ)))
            return _Prepared(env, error_file, None)
        env = {**os.environ, **spec.envs[rank], "TORCHELASTIC_ERROR_FILE": error_file}
        env.update(self._hangs.worker_env(rank))
        env.update(lineage_env(env))
        assert callable(spec.entrypoint)
        call = FunctionCall(spec.entrypoint, spec.args[rank], env, error_file)
        if spec.start_method == "fork":
            return _Prepared(env, error_file, call)  # inherited by fork, never pickled
        payload = self._pickle_check(call)
        if spec.start_method == "spawn":
            prep = _launchers.preparation_data(f"{spec.name}-{rank}")
            payload = pickle.dumps(prep) + payload
        return _Prepared(env, error_file, payload)

    def _pickle_check(self, call: FunctionCall) -> bytes:
        try:
            return pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ValueError(
                f"the entrypoint or args of {self.name!r} cannot be pickled for "
                f"start_method={self._spec.start_method!r} ({exc}); define the function at "
                "module level and pass picklable args, or use start_method='fork'"
            ) from exc

    async def _start_all(self, prepared: Mapping[int, _Prepared]) -> None:
        errors: list[tuple[int, BaseException]] = []
        terminals = ConsoleTerminals.probe()
        if self._spec.is_binary:
            self._binaries = _launchers.BinaryLauncher(os.environ)
            await self._start_binaries(prepared, terminals, errors)
        else:

            async def start(rank: int) -> None:
                try:
                    await self._start_worker(rank, prepared[rank], terminals)
                except Exception as exc:
                    errors.append((rank, exc))

            async with anyio.create_task_group() as tg:
                for rank in range(self._spec.nprocs):
                    tg.start_soon(start, rank)
                    # One worker's set-up (pipes, pumps, the hand-off to a launcher
                    # thread) per turn of the event loop, not all of them in one: other
                    # tasks keep running while hundreds of workers start.
                    await anyio.lowlevel.checkpoint()
        if errors:
            rank, exc = errors[0]
            _raise_start_error(exc, f"worker {rank} of {self.name!r}")
        if self._spec.start_method == "forkserver":
            # Workers for the next start of this group (a restart) are forked while the
            # server is idle, so that start takes no fork.
            fork_server(self._spec.forkserver_preload).keep_spares(self._spec.nprocs)

    async def _start_binaries(
        self,
        prepared: Mapping[int, _Prepared],
        terminals: ConsoleTerminals,
        errors: list[tuple[int, BaseException]],
    ) -> None:
        """Start every binary worker from this one task, in batches of the watchdog.

        No task per worker: a worker's set-up is a few syscalls, and a task with its
        cancel scopes cost as much again. The loop runs other tasks every
        :data:`_SLICE` seconds of set-up. The first failure to set up stops the rest from
        starting; the ones handed over are recorded (or killed) before the error counts.
        """
        spec = self._spec
        assert self._binaries is not None
        handed: collections.deque[tuple[int, _Opening, asyncio.Future[_launchers.Launched]]]
        handed = collections.deque()

        async def record(rank: int, opening: _Opening, future: asyncio.Future[Any]) -> None:
            try:
                try:
                    launched = await future
                finally:
                    opening.close_child_ends()
            except Exception as exc:
                opening.abort()
                errors.append((rank, exc))
                return
            try:
                await self._record(rank, opening, prepared[rank], launched)
            except Exception as exc:
                # Killed and closed by _record; the others handed over still get recorded.
                errors.append((rank, exc))

        interrupted: BaseException | None = None
        slice_end = time.monotonic() + _SLICE
        try:
            for rank in range(spec.nprocs):
                try:
                    opening = self._open_worker(rank, prepared[rank], terminals)
                except Exception as exc:
                    errors.append((rank, exc))
                    break
                argv = [str(spec.entrypoint), *spec.args[rank]]
                start = BinaryStart(
                    argv, prepared[rank].env, opening.out_w, opening.err_w, opening.stdin
                )
                handed.append((rank, opening, self._binaries.submit(start)))
                # The ones the watchdog has started already are put to use at once
                # (their pipes read, their exits watched) while it spawns on.
                while handed and handed[0][2].done():
                    await record(*handed.popleft())
                if time.monotonic() >= slice_end:
                    await anyio.lowlevel.checkpoint()
                    slice_end = time.monotonic() + _SLICE
            self._binaries.send_pending()
        except BaseException as exc:
            # Cancelled between slices: what was handed over may exist, so it is
            # recorded first (it is torn down with the group), then this goes on.
            interrupted = exc
        with anyio.CancelScope(shield=True):
            while handed:
                await record(*handed.popleft())
                if time.monotonic() >= slice_end:
                    await anyio.lowlevel.checkpoint()
                    slice_end = time.monotonic() + _SLICE
        if interrupted is not None:
            raise interrupted

    async def _start_worker(
        self, rank: int, prepared: _Prepared, terminals: ConsoleTerminals
    ) -> None:
        opening = self._open_worker(rank, prepared, terminals)
        try:
            try:
                launched = await self._launch(
                    prepared,
                    opening.out_w,
                    opening.err_w,
                    opening.res_w,
                    opening.parent_ends,
                    opening.stdin,
                )
            finally:
                opening.close_child_ends()
        except BaseException:
            opening.abort()
            raise
        await self._record(rank, opening, prepared, launched)

    def _open_worker(self, rank: int, prepared: _Prepared, terminals: ConsoleTerminals) -> _Opening:
        """The pipes and pumps of a worker about to start (all closed if this fails)."""
        spec = self._spec
        rank_dir = self._rank_dirs[rank]
        stdout = self._pump(rank, Std.OUT, os.path.join(rank_dir, "stdout.log"))
        stderr = self._pump(rank, Std.ERR, os.path.join(rank_dir, "stderr.log"))
        # Every fd made here is closed on any failure (EMFILE can strike at each step).
        opening = _Opening(prepared)
        try:
            stdio = open_worker_stdio(
                stdout_plain=_plain(stdout),
                stderr_plain=_plain(stderr),
                single_worker=spec.nprocs == 1,
                terminals=terminals,
            )
            opening.stdio = stdio
            opening.child_ends += stdio.child_ends()
            opening.parent_ends += stdio.parent_ends()
            if not spec.is_binary:
                opening.res_r, opening.res_w = os.pipe2(os.O_CLOEXEC)
                opening.parent_ends.append(opening.res_r)
                opening.child_ends.append(opening.res_w)
            opening.pumps.append(
                StreamPump(
                    stdio.stdout_r,
                    **stdout,
                    live=stdio.live_stdout,
                    log_fd=prepared.take_log(Std.OUT),
                )
            )
            opening.pumps.append(
                StreamPump(
                    stdio.stderr_r,
                    **stderr,
                    live=stdio.live_stderr,
                    log_fd=prepared.take_log(Std.ERR),
                )
            )
        except BaseException:
            opening.close_child_ends()
            opening.abort()
            raise
        return opening

    async def _record(
        self, rank: int, opening: _Opening, prepared: _Prepared, launched: _launchers.Launched
    ) -> None:
        """Make the started process a worker of the group, watched and pumped."""
        assert opening.stdio is not None
        stdio = opening.stdio
        stdout_pump, stderr_pump = opening.pumps
        logged = self._logged(rank)
        try:
            watchdog.watch(launched.pid)
            self._hangs.started(rank, launched.pid)
            rank_dir = self._rank_dirs[rank]
            worker = WorkerProcess(
                local_rank=rank,
                launched=launched,
                error_file=prepared.error_file,
                stdout_path=os.path.join(rank_dir, "stdout.log") if Std.OUT in logged else "",
                stderr_path=os.path.join(rank_dir, "stderr.log") if Std.ERR in logged else "",
                stdout=stdout_pump,
                stderr=stderr_pump,
                result=ResultReceiver(opening.res_r) if opening.res_r >= 0 else None,
            )
            launched.watch.on_exit(functools.partial(self._exit_seen, worker))
            runtime.worker_leaders.add(launched.pid)  # until stop_workers reaps it
        except BaseException:
            # The process exists but nothing would ever stop or reap it: do both now.
            with anyio.CancelScope(shield=True):
                await _launchers.on_launcher_thread(_launchers.kill_and_reap, launched)
            watchdog.forget(launched.pid)
            opening.abort()
            if launched.payload_fd is not None:
                os.close(launched.payload_fd)
            raise
        self._workers.append(worker)
        # Reader callbacks, not tasks: a task costs a few kB, two per worker.
        stdout_pump.start()
        stderr_pump.start()
        if stdio.uses_terminal:
            self._run_io(stdio.serve, launched.pid)
        if worker.result is not None:
            self._run_io(worker.result.run)
        if launched.payload_fd is not None:
            assert isinstance(prepared.payload, bytes)
            self._run_io(_feed_payload, launched.payload_fd, prepared.payload)

    async def _launch(
        self,
        prepared: _Prepared,
        out_w: int,
        err_w: int,
        res_w: int,
        parent_ends: list[int],
        stdin: int | None,
    ) -> _launchers.Launched:
        spec = self._spec
        payload, env = prepared.payload, prepared.env
        if isinstance(payload, FunctionCall):
            # The forked child inherits every fd; these it must not keep (the watchdog's
            # pipe would otherwise outlive us in a grandchild).
            private = [*parent_ends, *filter(None, [watchdog.fileno()]), *self._hangs.fds()]
            return await _launchers.on_launcher_thread(
                _launchers.start_fork, payload, out_w, err_w, res_w, private
            )
        if spec.start_method == "spawn":
            return await _launchers.on_launcher_thread(
                _launchers.start_spawn, env, out_w, err_w, res_w, stdin
            )
        assert isinstance(payload, bytes)
        return await fork_server(spec.forkserver_preload).start_worker(out_w, err_w, res_w, payload)

    def _pump(self, rank: int, stream: Std, log_path: str) -> dict[str, Any]:
        spec = self._spec
        shown = spec.local_ranks_filter is None or rank in spec.local_ranks_filter
        teed = stream in spec.tee[rank]
        redirected = stream in self._logged(rank)
        target = console("stdout" if stream is Std.OUT else "stderr")
        if shown and teed:
            sink, prefix = target, self._prefix(rank)
        elif shown and not redirected:
            sink, prefix = target, b""
        else:
            sink, prefix = None, b""
        ranks = self._output_ranks
        return {
            "log_path": log_path if redirected else None,
            "console": sink,
            "prefix": prefix,
            "keep_tail": stream is Std.ERR,
            "output": StreamOutput(
                self._output,
                rank,
                stream,
                rank=None if ranks is None else ranks[rank],
                attempt=self._output_attempt,
            ),
        }

    def _logged(self, rank: int) -> Std:
        """The streams of ``rank`` written to log files.

        A tee'd stream is logged as well as shown, as in torch (and as API.md's "tee
        *also* prints it" says): the console is a view, the file is the record.
        """
        return self._logged_streams[rank]

    def _prefix(self, rank: int) -> bytes:
        spec = self._spec
        if spec.log_line_prefix is None:
            return f"[{spec.name}{rank}]:".encode()
        env = spec.envs[rank]
        text = string.Template(spec.log_line_prefix).substitute(
            role_name=env.get("ROLE_NAME", spec.name),
            rank=env.get("RANK", str(rank)),
            local_rank=str(rank),
            hostname=socket.gethostname(),
        )
        return text.encode()

    def _run_io(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run an I/O task that outer cancellation cannot interrupt mid-transfer.

        Log pumps must not lose the bytes still in a pipe when the host task is
        cancelled; :meth:`_finish_io` ends them explicitly after a final drain.
        """
        scope = anyio.CancelScope(shield=True)
        self._io_scopes.append(scope)

        async def run() -> None:
            with scope:
                await fn(*args)

        assert self._tg is not None
        self._tg.start_soon(run)

    # -- watching ---------------------------------------------------------------------

    def _exit_seen(self, worker: WorkerProcess, outcome: ExitOutcome) -> None:
        # A loop callback: anyio (the failure report's task, teardown's) needs to be told
        # where it runs.
        self._callbacks.copy().run(self._on_exit, worker, outcome)

    def _on_exit(self, worker: WorkerProcess, outcome: ExitOutcome) -> None:
        """Record the worker's exit, then its outcome — whatever fails on the way.

        Called back by the worker's exit watch, from the event loop. The one rule of the
        exit path: the exit is always recorded (``exited``), with the real exit status,
        and the outcome always settled (``settled``); a fault while reading the status,
        the output, the return value or the error file becomes part of this rank's
        failure instead of escaping. Teardown waits on both events. A success settles
        here and now; only a failure, whose report reads the error file, takes a task.
        """
        if isinstance(outcome, ExitNotSeen):
            worker.returncode = UNKNOWN_EXIT_CODE
            worker.faults.append(
                f"was not seen exiting {CHILDREN_KILL_TIMEOUT:g} s after SIGKILL "
                "(uninterruptible sleep, or a stopped fork server or watchdog?); "
                "its exit status is unknown"
            )
        elif isinstance(outcome, Exception):
            worker.returncode = UNKNOWN_EXIT_CODE
            worker.faults.append(
                f"exited, but its exit status could not be read ({outcome}); "
                "was SIGCHLD ignored by another part of this process?"
            )
        else:
            worker.returncode = outcome
        worker.exit_time = time.time()
        try:
            self._hangs.exited(worker.pid)
            worker.drain_output()
        except Exception as exc:
            worker.faults.append(f"its output could not be read to the end ({exc!r})")
        worker.exited.set()
        try:
            failed = self._settle_success(worker)
        except Exception as exc:
            failed = [f"exit could not be reported: {exc!r}"]
        if failed is None:
            self._settled(worker)
            return
        # The group failed now: its teardown starts at once, while the report (which
        # reads the error file on a thread) is built beside it.
        self._any_failure = True
        try:
            self._stop_if_failed()
            assert self._tg is not None
            self._tg.start_soon(self._settle_failure, worker, failed)
        except Exception as exc:
            logger.exception("aioelastic: reporting the exit of worker %d", worker.local_rank)
            # No task can be started (the group's task group is closing): report the
            # failure without its error file rather than never.
            worker.failure = _bare_failure(
                worker, f"worker {worker.local_rank} exit could not be reported: {exc!r}"
            )
            self._settled(worker)

    def _settle_success(self, worker: WorkerProcess) -> list[str] | None:
        """Settle ``worker`` as succeeded (or stopped): ``None``; else its problems."""
        assert worker.returncode is not None
        problems = list(worker.faults)
        if worker.returncode == 0 and not problems:
            problem = self._collect_return_value(worker)
            # A worker we stopped may exit 0 without a value (a SIGTERM handler that
            # calls os._exit(0)): stopped, not failed.
            if problem is not None and not worker.signalled:
                problems.append(problem)
        if not problems and not self._own_failure(worker):
            # A log file that could not be written (full disk) is reported with the
            # group's result (see _result), not as a failure now: the other workers
            # are not stopped for it.
            worker.succeeded = worker.returncode == 0
            return None
        return problems

    def _own_failure(self, worker: WorkerProcess) -> bool:
        # A rank the hang guard killed (timer expiry, stall) failed, though we signalled it.
        hang = self._hang_texts.get(worker.local_rank)
        return worker.returncode != 0 and (not worker.signalled or hang is not None)

    async def _settle_failure(self, worker: WorkerProcess, problems: list[str]) -> None:
        """Build the failure report of ``worker`` and settle it. Shielded: it always ends."""
        with anyio.CancelScope(shield=True):
            try:
                problems = problems + worker.log_faults()
                worker.succeeded = False
                worker.return_value = None
                own_failure = self._own_failure(worker)
                failure = await self._build_failure(worker)
                if problems:
                    text = "; ".join(problems)
                    if own_failure:
                        failure.message = (
                            f"{failure.message}\n(worker {worker.local_rank} also: {text})"
                        )
                    else:
                        failure.message = f"worker {worker.local_rank} {text}"
                hang = self._hang_texts.get(worker.local_rank)
                if hang is not None:
                    failure.message = f"{hang.rstrip()}\n{failure.message}"
                worker.failure = failure
            except Exception as exc:
                logger.exception("aioelastic: reporting the exit of worker %d", worker.local_rank)
                worker.failure = _bare_failure(
                    worker, f"worker {worker.local_rank} exit could not be reported: {exc!r}"
                )
            finally:
                self._settled(worker)

    def _collect_return_value(self, worker: WorkerProcess) -> str | None:
        if worker.result is None:
            return None
        if not worker.result.complete:
            return worker.result.incomplete_reason()
        try:
            worker.return_value = pickle.loads(worker.result.payload())
        except BaseException as exc:
            # Unpickling runs code chosen by the worker's objects (``__reduce__``): it can
            # raise SystemExit or KeyboardInterrupt here, in the supervisor. Either is
            # this rank's failure, never the supervisor's exit.
            return f"its return value could not be unpickled by the supervisor: {exc!r}"
        return None

    async def _build_failure(self, worker: WorkerProcess) -> ProcessFailure:
        """The rank's failure report, with its error file read off the event loop (bounded)."""
        assert worker.returncode is not None
        assert worker.exit_time is not None
        build = functools.partial(
            ProcessFailure.from_exit,
            local_rank=worker.local_rank,
            pid=worker.pid,
            exitcode=worker.returncode,
            error_file=worker.error_file,
            exit_time=worker.exit_time,
            stderr_tail=worker.stderr.tail_lines(),
        )
        try:
            os.lstat(worker.error_file)
        except FileNotFoundError:
            # No error file (a binary's usual failure, a crash): nothing to read, so no
            # thread hop on the way to the report. The path is in our own log directory,
            # which the loop writes to anyway.
            return build()
        except OSError:
            pass
        fault = f"timed out after {REPORT_TIMEOUT:g} s"
        with anyio.move_on_after(REPORT_TIMEOUT):
            try:
                # Abandoned on timeout: a read blocked on a FIFO ends when the thread
                # does, not before; it holds no lock of ours.
                return await anyio.to_thread.run_sync(build, abandon_on_cancel=True)
            except Exception as exc:
                fault = repr(exc)
        failure = _bare_failure(worker, "")
        failure.message = (
            f"{failure.message} (its error file {worker.error_file} could not be read: {fault})"
        )
        return failure

    def _settled(self, worker: WorkerProcess) -> None:
        """Mark the outcome of ``worker`` final and count it into the group's."""
        worker.settled.set()
        if worker.failure is not None:
            self._any_failure = True
        elif worker.succeeded:
            self._succeeded += 1
        if self._failed():
            self._done.set()
            self._stop_if_failed()
        elif self._succeeded == self.nprocs:
            self._done.set()

    def _stop_if_failed(self) -> None:
        # A failed group is torn down the moment the failure is seen, whether or not
        # anyone is in wait() right now.
        if self._failed() and self._started and not self._stop_scheduled:
            self._stop_scheduled = True
            assert self._tg is not None
            self._tg.start_soon(self._stop, signal.SIGTERM, self._spec.grace_period)

    # -- hangs ------------------------------------------------------------------------

    async def dump_stacks(self, timeout: float | None = None) -> dict[int, str]:
        """Every thread's Python stack of each running worker, without stopping them.

        Returns ``{local_rank: text}``; a worker that does not answer within ``timeout``
        seconds (5 by default) maps to a line saying so. See docs/hangs.md.
        """
        running = {w.local_rank: w.pid for w in self._ranked() if w.returncode is None}
        return await self._hangs.dump_stacks(running, timeout)

    def last_output_times(self) -> dict[int, float]:
        """When each running worker last wrote output (``time.time()``), for metrics."""
        offset = time.time() - time.monotonic()
        found = {}
        for worker in self._ranked():
            times = [p.last_output for p in (worker.stdout, worker.stderr)]
            latest = max((t for t in times if t is not None), default=None)
            if worker.returncode is None and latest is not None:
                found[worker.local_rank] = latest + offset
        return found

    async def _run_hangs(self) -> None:
        assert self._tg is not None
        tg = self._tg
        hooks = WorkerHooks(
            {w.local_rank: w for w in self._workers},  # every worker has started by now
            self._hang_texts,
            lambda: tg.start_soon(self._stop, signal.SIGTERM, self._spec.grace_period),
        )
        self._hang_scope = anyio.CancelScope()
        if self._stopping:
            return
        with self._hang_scope:
            await self._hangs.run(hooks)

    # -- waiting ----------------------------------------------------------------------

    async def wait(self, timeout: float | None = None) -> RunProcsResult | None:
        """Wait for the group's outcome.

        Returns when every worker exited 0, or when the first worker failed — in that
        case after the others were stopped. With ``timeout`` (seconds; 0 only checks),
        returns ``None`` if the workers are still running, and leaves them running.
        Cancelling a ``wait()`` does not stop the workers. A ``wait()`` that returns
        because another task called :meth:`close` first gets a result with
        ``stopped=True`` (see :class:`RunProcsResult`).
        """
        if not self._entered:
            raise RuntimeError("wait() needs the workers started: use 'async with' first")
        if timeout is None:
            await self._done.wait()
        else:
            with anyio.move_on_after(timeout):
                await self._done.wait()
            if not self._done.is_set():
                return None
        if self._failed():
            await self._stopped.wait()
        return self._result()

    async def first_failures(self) -> dict[int, ProcessFailure]:
        """Wait until the group's outcome is known; the failures settled then, by local rank.

        Returns as soon as the first failure is reported — the teardown of the other
        workers has only begun — or ``{}`` once every worker succeeded or the group was
        closed. For telling others at once (the elastic agent tells the other nodes);
        :meth:`wait` gives the final result, after the teardown.
        """
        if not self._entered:
            raise RuntimeError("first_failures() needs the workers started: use 'async with'")
        await self._done.wait()
        return {w.local_rank: w.failure for w in self._ranked() if w.failure is not None}

    def _result(self) -> RunProcsResult:
        workers = self._ranked()
        for worker in workers:
            # A log file that could not be written to the end (a full disk, the file size
            # limit): the run's record is incomplete, so the result must not say success.
            faults = worker.log_faults()
            if worker.failure is None and faults and worker.returncode is not None:
                text = "; ".join(faults)
                worker.failure = _bare_failure(worker, f"worker {worker.local_rank} {text}")
                worker.succeeded = False
                self._any_failure = True
        failures = {w.local_rank: w.failure for w in workers if w.failure is not None}
        # Neither failed nor all succeeded: close() ended the group first.
        stopped = not failures and sum(w.succeeded for w in workers) < self.nprocs
        return RunProcsResult(
            return_values={}
            if failures or stopped
            else {w.local_rank: w.return_value for w in workers},
            failures=failures,
            stdouts={w.local_rank: w.stdout_path for w in workers},
            stderrs={w.local_rank: w.stderr_path for w in workers},
            stopped=stopped,
        )

    # -- stopping ---------------------------------------------------------------------

    async def close(
        self, death_sig: int = signal.SIGTERM, grace_period: float | None = None
    ) -> None:
        """Stop every worker and everything in their process groups; idempotent.

        Sends ``death_sig`` to each worker's process group, waits (event-driven) up to
        ``grace_period`` seconds (the context's default when ``None``), SIGKILLs every
        group that still has a member, and reaps. A second ``close()`` while one is in
        progress (a second Ctrl-C, say) escalates: the rest of the grace period is
        skipped and every group is SIGKILLed at once, whatever its arguments.
        """
        if not self._entered:
            return
        grace = self._spec.grace_period if grace_period is None else grace_period
        if self._closing:
            self._escalate.set()
        self._closing = True

        async def stop_and_finish() -> None:
            with anyio.CancelScope(shield=True):
                await self._stop(death_sig, grace)
                await self._finish_io()

        # The shield keeps anyio's cancellation out as before; to_the_end also runs the
        # teardown to its end despite asyncio's own (a Ctrl-C under asyncio.run cancels
        # the main task, which is often this one), and raises it only then.
        with anyio.CancelScope(shield=True):
            await to_the_end(stop_and_finish)

    async def _stop(self, death_sig: int, grace_period: float) -> None:
        if self._stopping:
            if death_sig == signal.SIGKILL or grace_period <= 0:
                self._escalate.set()
            await self._stopped.wait()
            return
        self._stopping = True
        if self._hang_scope is not None:
            self._hang_scope.cancel()
        try:
            with anyio.CancelScope(shield=True):
                await stop_workers(list(self._workers), death_sig, grace_period, self._escalate)
                # Outcomes settle within REPORT_TIMEOUT of the exit: wait() after this
                # point sees every failure, not a half-reported group.
                with anyio.move_on_after(REPORT_TIMEOUT + 1):
                    await wait_all(worker.settled for worker in self._workers)
        finally:
            self._done.set()
            self._stopped.set()

    async def _finish_io(self) -> None:
        if self._io_finished:
            return
        self._io_finished = True
        pumps = [p for w in self._workers for p in (w.stdout, w.stderr)]
        # Every writer is dead now, so the pipes reach end-of-file at once — unless a
        # descendant escaped its process group and still holds one.
        with anyio.move_on_after(IO_DRAIN_TIMEOUT):
            await wait_all(pump.closed for pump in pumps)
        for scope in self._io_scopes:
            scope.cancel()
        for worker in self._workers:
            for pump in (worker.stdout, worker.stderr):
                pump.drain(max_chunks=1024)
                pump.finish()
            if worker.result is not None:
                worker.result.close()
            # Closing a worker's pipes and log files is a handful of syscalls; for
            # hundreds of workers, other tasks run in between.
            await anyio.lowlevel.cancel_shielded_checkpoint()
        if self._owns_output:
            self._output.close()
        # Bounded: a console whose reader stopped reading (a paused terminal, a full
        # pipe nobody drains) must not hold up the end of the run.
        with anyio.move_on_after(IO_DRAIN_TIMEOUT):
            for stream in (console("stdout"), console("stderr")):
                await stream.flush()
        # Removing hundreds of FIFOs and directories is as slow as creating them.
        await self._blocking(self._remove_files)

    def _remove_files(self) -> None:
        """Blocking: remove the stack FIFOs and the temporary log directory (if empty)."""
        self._hangs.close()
        self._remove_temporary_logs()

    def _remove_temporary_logs(self) -> None:
        """Remove the temporary log directory unless it holds something to keep."""
        if self._temporary_log_root and self._log_root is not None:
            log_root.remove_if_empty(self._log_root, repr(self.name))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            await self.close()
        except asyncio.CancelledError:
            # asyncio's own cancellation, passed on by close() once its teardown ended:
            # the task group is exited first, or it would stay entered in this task.
            await self._tg.__aexit__(None, None, None)
            raise
        # Outside any shield: a task group must be exited from the scope it was entered
        # in. Its tasks are all finished or shielded-and-ending by now, so this is quick.
        await self._tg.__aexit__(None, None, None)
        return None


def _bare_failure(worker: WorkerProcess, message: str) -> ProcessFailure:
    """A failure report made without the error file."""
    assert worker.returncode is not None
    return ProcessFailure(
        local_rank=worker.local_rank,
        pid=worker.pid,
        exitcode=worker.returncode,
        error_file=NOT_AVAILABLE,
        message=message or f"exited with code {worker.returncode}",
        timestamp=worker.exit_time or time.time(),
    )


@dataclass(eq=False)
class _Opening:
    """The fds and pumps of one worker being started, until it is recorded (or fails)."""

    prepared: _Prepared
    stdio: WorkerStdio | None = None
    #: The ends the child gets: closed here once it was started (or could not be).
    child_ends: list[int] = field(default_factory=list)
    #: Our ends: owned by the pumps and the result receiver once it is recorded.
    parent_ends: list[int] = field(default_factory=list)
    pumps: list[StreamPump] = field(default_factory=list)
    res_r: int = -1
    res_w: int = -1

    @property
    def out_w(self) -> int:
        """The child's stdout (its write end)."""
        assert self.stdio is not None
        return self.stdio.stdout_w

    @property
    def err_w(self) -> int:
        """The child's stderr (its write end)."""
        assert self.stdio is not None
        return self.stdio.stderr_w

    @property
    def stdin(self) -> int | None:
        """The child's own stdin, if it gets one."""
        assert self.stdio is not None
        return self.stdio.stdin

    def close_child_ends(self) -> None:
        """Close the child's ends (it holds its own copies once started). Idempotent."""
        ends, self.child_ends = self.child_ends, []
        for fd in ends:
            os.close(fd)

    def abort(self) -> None:
        """Close our ends and the log files: the worker will not run."""
        self.prepared.close_logs()
        _close_parent_ends(self.pumps, self.parent_ends)
        self.pumps, self.parent_ends = [], []


def _close_parent_ends(pumps: list[StreamPump], parent_ends: list[int]) -> None:
    owned = set()
    for pump in pumps:
        owned.add(pump.fileno())
        pump.finish()
    for fd in parent_ends:
        if fd not in owned:
            os.close(fd)


def _raise_start_error(exc: BaseException, what: str) -> NoReturn:
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


def _plain(pump: dict[str, Any]) -> bool:
    """A stream that goes to the console unprefixed and nowhere else (see _terminal)."""
    return pump["console"] is not None and not pump["prefix"] and pump["log_path"] is None


def _runs_stack_hook(args: tuple[Any, ...]) -> bool:
    """Whether a binary's arguments run a script through the stack hook (docs/hangs.md)."""
    return any(
        a == "-m" and b == "aioelastic._core._stack_hook" for a, b in itertools.pairwise(args)
    )


async def _feed_payload(fd: int, payload: bytes) -> None:
    """Write the pickled call into a new worker's payload pipe, then close it."""
    os.set_blocking(fd, False)
    view = memoryview(payload)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await anyio.wait_writable(fd)
            except BrokenPipeError:
                return  # the worker died before reading; its exit is reported anyway
    finally:
        os.close(fd)


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str | int]],
    log_dir: str | os.PathLike[str] | None = None,
    start_method: str = "spawn",
    redirects: Std | Mapping[int, Std] = Std.NONE,
    tee: Std | Mapping[int, Std] = Std.NONE,
    *,
    grace_period: float = 30.0,
    forkserver_preload: Collection[str] = (),
    local_ranks_filter: Collection[int] | None = None,
    log_line_prefix: str | None = None,
    stall_timeout: float | None = None,
) -> PContext:
    """Validate the arguments and return a :class:`PContext` (workers start on entry).

    Args:
        name: The group's name, used in log prefixes (``[{name}{local_rank}]:``).
        entrypoint: A callable (function workers, called as ``entrypoint(*args[rank])``)
            or a str (a binary, run as ``[entrypoint, *map(str, args[rank])]``).
        args: Arguments per local rank; keys exactly ``0..n-1``.
        envs: Extra environment per local rank; same keys as ``args``.
        log_dir: Where ``{local_rank}/stdout.log|stderr.log|error.json`` go; a fresh
            temporary directory when ``None``. Must not hold earlier output.
        start_method: ``spawn``, ``fork`` or ``forkserver`` (function workers only).
        redirects: Streams written to log files, as a :class:`Std` or per rank.
        tee: Streams also printed to the console with a rank prefix.
        grace_period: Default seconds between the death signal and SIGKILL.
        forkserver_preload: Modules the fork server imports once for all workers.
        local_ranks_filter: Ranks whose console output is shown (all when ``None``).
        log_line_prefix: Template with ``${role_name} ${rank} ${local_rank} ${hostname}``.
        stall_timeout: Seconds without output or timer request from any worker after
            which the group is reported stalled, with every stack, and stopped (off when
            ``None``). ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the environment serves
            torch's file timer. See docs/hangs.md.

    Raises:
        ValueError, TypeError: On any invalid argument, before anything starts.
    """
    spec = validate(
        name=name,
        entrypoint=entrypoint,
        args=args,
        envs=envs,
        log_dir=log_dir,
        start_method=start_method,
        redirects=redirects,
        tee=tee,
        grace_period=grace_period,
        forkserver_preload=forkserver_preload,
        local_ranks_filter=local_ranks_filter,
        log_line_prefix=log_line_prefix,
    )
    return PContext(spec, HangConfig.from_env(os.environ, stall_timeout=stall_timeout))


async def run_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str | int]],
    log_dir: str | os.PathLike[str] | None = None,
    start_method: str = "spawn",
    redirects: Std | Mapping[int, Std] = Std.NONE,
    tee: Std | Mapping[int, Std] = Std.NONE,
    *,
    grace_period: float = 30.0,
    forkserver_preload: Collection[str] = (),
    local_ranks_filter: Collection[int] | None = None,
    log_line_prefix: str | None = None,
    stall_timeout: float | None = None,
) -> RunProcsResult:
    """Start the workers, wait for the outcome, stop them: :func:`start_processes` in one call."""
    ctx = start_processes(
        name,
        entrypoint,
        args,
        envs,
        log_dir,
        start_method,
        redirects,
        tee,
        grace_period=grace_period,
        forkserver_preload=forkserver_preload,
        local_ranks_filter=local_ranks_filter,
        log_line_prefix=log_line_prefix,
        stall_timeout=stall_timeout,
    )
    async with ctx:
        result = await ctx.wait()
    assert result is not None
    return result
