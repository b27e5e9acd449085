"""A group of local workers: start them, await their outcome, stop them.

The life of a worker, module by module: :mod:`._validate` checks the call;
:class:`PContext` creates its pipes and log files and asks :mod:`._launchers` (or the
warm :mod:`._forkserver`) for a process, whose child side is :mod:`._bootstrap`;
:mod:`._exit_watch` learns of its exit from the kernel; :mod:`._logs` pumps its output;
:mod:`._teardown` stops it; :mod:`._errors` and :mod:`._results` report what happened.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import signal
import socket
import string
import tempfile
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from . import _launchers
from ._bootstrap import FunctionCall
from ._console import console
from ._errors import ProcessFailure
from ._forkserver import fork_server
from ._hangs import HangConfig, HangGuard, WorkerHooks
from ._logs import StreamPump
from ._result_pipe import ResultReceiver
from ._results import RunProcsResult
from ._std import Std
from ._teardown import stop_workers
from ._validate import LaunchSpec, validate
from ._watchdog import watchdog
from ._worker import WorkerProcess

logger = logging.getLogger("aioelastic")

#: After teardown, how long to wait for the worker pipes to reach end-of-file. Only a
#: descendant that escaped its process group (``setsid``) can keep one open that long.
IO_DRAIN_TIMEOUT = 2.0


@dataclass(frozen=True)
class _Prepared:
    """What one rank needs to start: its environment, error file and call."""

    env: dict[str, str]
    error_file: str
    #: ``None`` for a binary, the call itself for fork, else its pickled form.
    payload: FunctionCall | bytes | None


class PContext:
    """A running group of local workers (an async context manager).

    Made by :func:`start_processes`; the workers start when the ``async with`` block is
    entered and are all stopped when it is left, however it is left.
    """

    def __init__(self, spec: LaunchSpec, hangs: HangConfig | None = None) -> None:
        self._spec = spec
        self._hangs = HangGuard(hangs or HangConfig(), spec.nprocs)
        #: Why a rank was found hung (timer expiry, stall): the head of its failure.
        self._hang_texts: dict[int, str] = {}
        self._hang_scope: anyio.CancelScope | None = None  # made in the loop, when started
        self._workers: dict[int, WorkerProcess] = {}
        self._failures: dict[int, ProcessFailure] = {}
        self._return_values: dict[int, Any] = {}
        self._entered = False
        self._started = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._io_scopes: list[anyio.CancelScope] = []
        self._done = anyio.Event()
        self._stopping = False
        self._stopped = anyio.Event()
        self._escalate = anyio.Event()
        self._io_finished = False
        self._log_root: Path | None = None
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
        return {rank: w.pid for rank, w in sorted(self._workers.items())}

    # -- starting ---------------------------------------------------------------------

    async def __aenter__(self) -> PContext:
        if self._entered:
            raise RuntimeError(f"PContext {self.name!r} was already started; make a new one")
        self._entered = True
        self._hangs.open()
        try:
            prepared = self._prepare()
        except BaseException:
            self._hangs.close()
            raise
        await _launchers.on_launcher_thread(watchdog.ensure_started)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._start_all(prepared)
        except BaseException as exc:
            await self.close()
            await self._tg.__aexit__(None, None, None)
            raise exc
        self._started = True
        self._tg.start_soon(self._run_hangs)
        if self._failures:
            # A worker failed while its siblings were still starting: its teardown was
            # held back until now, so that it covers every worker that was started.
            self._tg.start_soon(self._stop, signal.SIGTERM, self._spec.grace_period)
        return self

    def _prepare(self) -> dict[int, _Prepared]:
        """Log directories, environments and pickled calls: all that can fail, before a start."""
        spec = self._spec
        if spec.log_dir is None:
            root = Path(tempfile.mkdtemp(prefix=f"aioelastic_{spec.name}_"))
        else:
            root = spec.log_dir
        try:
            prepared = {rank: self._prepare_rank(rank, root) for rank in range(spec.nprocs)}
        except BaseException:
            if spec.log_dir is None:
                shutil.rmtree(root, ignore_errors=True)
            raise
        self._log_root = root
        self._temporary_log_root = spec.log_dir is None
        for rank in range(spec.nprocs):
            (root / str(rank)).mkdir(parents=True, exist_ok=True)
        if self._temporary_log_root and any(
            spec.redirects[r] | spec.tee[r] for r in spec.redirects
        ):
            logger.info("aioelastic: logs of %r are in %s", spec.name, root)
        return prepared

    def _prepare_rank(self, rank: int, root: Path) -> _Prepared:
        spec = self._spec
        error_file = str(root / str(rank) / "error.json")
        env = {**os.environ, **spec.envs[rank], "TORCHELASTIC_ERROR_FILE": error_file}
        env.update(
            self._hangs.worker_env(
                rank, python=not spec.is_binary or _runs_stack_hook(spec.args[rank])
            )
        )
        if spec.is_binary:
            return _Prepared(env, error_file, None)
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
        errors: list[BaseException] = []

        async def start(rank: int) -> None:
            try:
                await self._start_worker(rank, prepared[rank])
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for rank in range(self._spec.nprocs):
                tg.start_soon(start, rank)
        if errors:
            raise errors[0]

    async def _start_worker(self, rank: int, prepared: _Prepared) -> None:
        spec = self._spec
        assert self._log_root is not None
        assert self._tg is not None
        rank_dir = self._log_root / str(rank)
        stdout = self._pump(rank, Std.OUT, rank_dir / "stdout.log")
        stderr = self._pump(rank, Std.ERR, rank_dir / "stderr.log")
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        res_r, res_w = os.pipe2(os.O_CLOEXEC) if not spec.is_binary else (-1, -1)
        child_ends = [fd for fd in (out_w, err_w, res_w) if fd >= 0]
        parent_ends = [fd for fd in (out_r, err_r, res_r) if fd >= 0]
        try:
            stdout_pump = StreamPump(out_r, **stdout)
            stderr_pump = StreamPump(err_r, **stderr)
            stdout_pump.open_log()
            stderr_pump.open_log()
            launched = await self._launch(rank, prepared, out_w, err_w, res_w, parent_ends)
        except BaseException:
            for fd in parent_ends:
                os.close(fd)
            raise
        finally:
            for fd in child_ends:
                os.close(fd)
        watchdog.watch(launched.pid)
        self._hangs.started(rank, launched.pid)
        worker = WorkerProcess(
            local_rank=rank,
            launched=launched,
            error_file=prepared.error_file,
            stdout_path=str(rank_dir / "stdout.log") if Std.OUT in self._logged(rank) else "",
            stderr_path=str(rank_dir / "stderr.log") if Std.ERR in self._logged(rank) else "",
            stdout=stdout_pump,
            stderr=stderr_pump,
            result=ResultReceiver(res_r) if res_r >= 0 else None,
        )
        self._workers[rank] = worker
        self._tg.start_soon(self._monitor, worker)
        self._run_io(stdout_pump.run)
        self._run_io(stderr_pump.run)
        if worker.result is not None:
            self._run_io(worker.result.run)
        if launched.payload_fd is not None:
            assert isinstance(prepared.payload, bytes)
            self._run_io(_feed_payload, launched.payload_fd, prepared.payload)

    async def _launch(
        self,
        rank: int,
        prepared: _Prepared,
        out_w: int,
        err_w: int,
        res_w: int,
        parent_ends: list[int],
    ) -> _launchers.Launched:
        spec = self._spec
        payload, env = prepared.payload, prepared.env
        if spec.is_binary:
            argv = [str(spec.entrypoint), *spec.args[rank]]
            return await _launchers.on_launcher_thread(
                _launchers.start_binary, argv, env, out_w, err_w
            )
        if isinstance(payload, FunctionCall):
            # The forked child inherits every fd; these it must not keep (the watchdog's
            # pipe would otherwise outlive us in a grandchild).
            private = [*parent_ends, *filter(None, [watchdog.fileno()]), *self._hangs.fds()]
            return await _launchers.on_launcher_thread(
                _launchers.start_fork, payload, out_w, err_w, res_w, private
            )
        if spec.start_method == "spawn":
            return await _launchers.on_launcher_thread(
                _launchers.start_spawn, env, out_w, err_w, res_w
            )
        server = fork_server(spec.forkserver_preload)
        return await _launchers.on_launcher_thread(server.start_worker, out_w, err_w, res_w)

    def _pump(self, rank: int, stream: Std, log_path: Path) -> dict[str, Any]:
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
        return {
            "log_path": log_path if redirected else None,
            "console": sink,
            "prefix": prefix,
            "keep_tail": stream is Std.ERR,
        }

    def _logged(self, rank: int) -> Std:
        """The streams of ``rank`` written to log files.

        A tee'd stream is logged as well as shown, as in torch (and as API.md's "tee
        *also* prints it" says): the console is a view, the file is the record.
        """
        return self._spec.redirects[rank] | self._spec.tee[rank]

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

    async def _monitor(self, worker: WorkerProcess) -> None:
        # Shielded: the exit always comes (teardown guarantees it) and teardown itself
        # waits for this task to record it.
        with anyio.CancelScope(shield=True):
            returncode = await worker.launched.watch.wait()
        worker.exit_time = time.time()
        worker.returncode = returncode
        self._hangs.exited(worker.pid)
        worker.drain_output()
        worker.exited.set()
        self._on_exit(worker)

    def _on_exit(self, worker: WorkerProcess) -> None:
        if worker.returncode == 0:
            problem = self._collect_return_value(worker)
            # A worker we stopped may exit 0 without a value (a SIGTERM handler that
            # calls os._exit(0)): stopped, not failed.
            if problem is not None and not worker.signalled:
                self._record_failure(worker, problem)
        elif not worker.signalled or worker.local_rank in self._hang_texts:
            self._record_failure(worker, None)
        if self._failures or len(self._return_values) == self.nprocs:
            self._done.set()

    def _collect_return_value(self, worker: WorkerProcess) -> str | None:
        if worker.result is None:
            self._return_values[worker.local_rank] = None
            return None
        if not worker.result.complete:
            return "exited with code 0 but sent no return value (did it call os._exit(0)?)"
        try:
            self._return_values[worker.local_rank] = pickle.loads(worker.result.payload())
        except Exception as exc:
            return f"its return value could not be unpickled by the supervisor: {exc!r}"
        return None

    def _record_failure(self, worker: WorkerProcess, problem: str | None) -> None:
        assert worker.returncode is not None
        assert worker.exit_time is not None
        failure = ProcessFailure.from_exit(
            local_rank=worker.local_rank,
            pid=worker.pid,
            exitcode=worker.returncode if problem is None else 1,
            error_file=worker.error_file,
            exit_time=worker.exit_time,
            stderr_tail=worker.stderr.tail_lines(),
        )
        if problem is not None:
            failure.message = f"worker {worker.local_rank} {problem}"
        hang = self._hang_texts.get(worker.local_rank)
        if hang is not None:
            failure.message = f"{hang.rstrip()}\n{failure.message}"
        first = not self._failures
        self._failures[worker.local_rank] = failure
        if first and self._started and self._tg is not None:
            # A failed group is torn down the moment the failure is seen, whether or not
            # anyone is in wait() right now.
            self._tg.start_soon(self._stop, signal.SIGTERM, self._spec.grace_period)

    # -- hangs ------------------------------------------------------------------------

    async def dump_stacks(self, timeout: float | None = None) -> dict[int, str]:
        """Every thread's Python stack of each running worker, without stopping them.

        Returns ``{local_rank: text}``; a worker that does not answer within ``timeout``
        seconds (5 by default) maps to a line saying so. See docs/hangs.md.
        """
        running = {r: w.pid for r, w in sorted(self._workers.items()) if w.returncode is None}
        return await self._hangs.dump_stacks(running, timeout)

    def last_output_times(self) -> dict[int, float]:
        """When each running worker last wrote output (``time.time()``), for metrics."""
        offset = time.time() - time.monotonic()
        found = {}
        for rank, worker in sorted(self._workers.items()):
            times = [p.last_output for p in (worker.stdout, worker.stderr)]
            latest = max((t for t in times if t is not None), default=None)
            if worker.returncode is None and latest is not None:
                found[rank] = latest + offset
        return found

    async def _run_hangs(self) -> None:
        assert self._tg is not None
        tg = self._tg
        hooks = WorkerHooks(
            self._workers,
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
        Cancelling a ``wait()`` does not stop the workers.
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
        if self._failures:
            await self._stopped.wait()
        return self._result()

    def _result(self) -> RunProcsResult:
        workers = sorted(self._workers.values(), key=lambda w: w.local_rank)
        return RunProcsResult(
            return_values={} if self._failures else dict(sorted(self._return_values.items())),
            failures=dict(sorted(self._failures.items())),
            stdouts={w.local_rank: w.stdout_path for w in workers},
            stderrs={w.local_rank: w.stderr_path for w in workers},
        )

    # -- stopping ---------------------------------------------------------------------

    async def close(
        self, death_sig: int = signal.SIGTERM, grace_period: float | None = None
    ) -> None:
        """Stop every worker and everything in their process groups; idempotent.

        Sends ``death_sig`` to each worker's process group, waits (event-driven) up to
        ``grace_period`` seconds (the context's default when ``None``), SIGKILLs every
        group that still has a member, and reaps. A call with SIGKILL or a zero grace
        period while another close is in progress skips the rest of its grace period.
        """
        if not self._entered:
            return
        grace = self._spec.grace_period if grace_period is None else grace_period
        with anyio.CancelScope(shield=True):
            await self._stop(death_sig, grace)
            await self._finish_io()

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
                await stop_workers(
                    list(self._workers.values()), death_sig, grace_period, self._escalate
                )
        finally:
            self._done.set()
            self._stopped.set()

    async def _finish_io(self) -> None:
        if self._io_finished:
            return
        self._io_finished = True
        pumps = [p for w in self._workers.values() for p in (w.stdout, w.stderr)]
        # Every writer is dead now, so the pipes reach end-of-file at once — unless a
        # descendant escaped its process group and still holds one.
        with anyio.move_on_after(IO_DRAIN_TIMEOUT):
            for pump in pumps:
                await pump.closed.wait()
        for scope in self._io_scopes:
            scope.cancel()
        for pump in pumps:
            pump.drain(max_chunks=1024)
            pump.finish()
        for worker in self._workers.values():
            if worker.result is not None:
                worker.result.close()
        for stream in (console("stdout"), console("stderr")):
            await stream.flush()
        self._hangs.close()
        self._remove_temporary_logs()

    def _remove_temporary_logs(self) -> None:
        """Remove the temporary log directory unless it holds something to keep.

        Logs and error files are never deleted: only a directory that stayed empty (no
        stream redirected, no worker wrote an error file) is removed.
        """
        root = self._log_root
        if not self._temporary_log_root or root is None:
            return
        if any(path.is_file() for path in root.rglob("*")):
            logger.info("aioelastic: logs and error files of %r kept in %s", self.name, root)
            return
        shutil.rmtree(root, ignore_errors=True)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.close()
        # Outside any shield: a task group must be exited from the scope it was entered
        # in. Its tasks are all finished or shielded-and-ending by now, so this is quick.
        assert self._tg is not None
        await self._tg.__aexit__(None, None, None)
        return None


def _runs_stack_hook(args: tuple[Any, ...]) -> bool:
    """Whether a binary's arguments run a script through the stack hook (docs/hangs.md)."""
    return any(a == "-m" and b == "aioelastic._stack_hook" for a, b in itertools.pairwise(args))


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
