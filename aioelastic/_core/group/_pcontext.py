"""A group of local workers: its life from start to teardown.

The life of a worker, room by room: :mod:`._validate` checks the call; :mod:`._preparing`
makes its log files, environment and call; a start method (:mod:`._start_methods`: the
watchdog's ``posix_spawn`` for a binary, :mod:`..start._launchers` and the warm
:mod:`..start._forkserver` for a function) makes its process, whose child side is
:mod:`..child._bootstrap`, and :mod:`._starting` wires its pipes and pumps;
:mod:`..start._exit_watch` learns of its exit from the kernel; :mod:`..output._logs` pumps
its output; :mod:`._settle` decides what became of it; :mod:`..worker._teardown` stops it;
:mod:`..reports._failures` and :mod:`..reports._results` report what happened.
:class:`PContext` holds only the lifecycle: enter, wait, stop, close.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import signal
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from types import TracebackType

import anyio
import anyio.abc

from ..aio._backend import callback_context, require_asyncio
from ..aio._lazy_event import wait_all
from ..aio._to_the_end import to_the_end
from ..hangs._guard import HangConfig, HangGuard, WorkerHooks
from ..hangs._stall import StallTeller
from ..output._stream import OutputHub
from ..process import _platform
from ..reports._failures import ProcessFailure
from ..reports._results import RunProcsResult
from ..start import _launchers
from ..start._exit_watch import ExitOutcome
from ..start._watchdog import watchdog
from ..worker._process import WorkerProcess
from ..worker._teardown import stop_workers
from . import _preparing as preparing, _settle as settle
from ._forwarding import Forwarding
from ._group_io import GroupIO
from ._group_views import GroupViews
from ._start_methods import start_method
from ._starting import GroupStarter, OutputTarget
from ._validate import GroupSpec

logger = logging.getLogger("aioelastic")


class Phase(enum.IntEnum):
    """Where a group is in its life. It only moves forward."""

    #: Made; nothing exists yet.
    NEW = 0
    #: Entered: its files are made, then its workers started.
    STARTING = 1
    #: Every worker started.
    RUNNING = 2
    #: The teardown has begun or is scheduled (a failure, a stall, ``close()``).
    STOPPING = 3
    #: Every worker stopped and reaped; its output is being finished.
    STOPPED = 4
    #: Output finished, files removed: nothing of the group is left.
    CLOSED = 5


class PContext(GroupViews):
    """A running group of local workers (an async context manager).

    Made by :func:`start_processes`; the workers start when the ``async with`` block is
    entered and are all stopped when it is left, however it is left. Its output, stacks
    and pids are read through its base, :class:`~._group_views.GroupViews`.
    """

    #: Holds the group's task group from ``__aenter__`` until the group is left.
    _group: AsyncExitStack

    def __init__(self, spec: GroupSpec, hangs: HangConfig | None = None) -> None:
        self._spec = spec
        self._method = start_method(spec)
        self._workers: list[WorkerProcess] = []
        self._forwarding = Forwarding(spec.options.forward_signals, self._workers, spec.name)
        self._output = OutputTarget(OutputHub())
        # A worker that does not run our hooks never answers a stack request: no FIFO.
        stack_ranks = [r for r in range(spec.nprocs) if self._method.runs_python(r)]
        self._hangs = HangGuard(hangs or HangConfig(), spec.nprocs, stack_ranks=stack_ranks)
        #: Why a rank was found hung (timer expiry, stall): the head of its failure.
        self._hang_texts: dict[int, str] = {}
        self._hang_scope: anyio.CancelScope | None = None  # made in the loop, when started
        #: Tells a stall in place of the group's own report (see tell_stalls_with).
        self._stall_teller: StallTeller | None = None
        #: The group's log files, once made.
        self._files: preparing.GroupFiles | None = None
        self._phase = Phase.NEW
        self._tg: anyio.abc.TaskGroup | None = None
        #: The context the workers' exit callbacks run in (made in the loop, when started).
        self._callbacks = contextvars.Context()
        self._io = GroupIO()
        self._done = anyio.Event()
        #: How many times close() was called: a second call escalates.
        self._close_calls = 0
        self._stopped = anyio.Event()
        self._escalate = anyio.Event()
        # Kept as each worker settles, so that an exit costs the same whatever N is: a
        # scan of every worker per exit made a group's end quadratic in its size.
        #: Whether any worker failed (from its exit on; its report may still be built).
        self._any_failure = False
        #: How many workers settled as succeeded.
        self._succeeded = 0

    def __repr__(self) -> str:
        started = len(self._workers)
        return (
            f"<PContext {self.name!r} {self._method.name} nprocs={self.nprocs} "
            f"{self._phase.name.lower()} started={started}>"
        )

    @property
    def _grace(self) -> float:
        """Seconds from the stop signal to SIGKILL, unless a ``close()`` says otherwise."""
        return self._spec.options.grace_period

    def _failed(self) -> bool:
        return self._any_failure

    # -- starting ---------------------------------------------------------------------

    async def __aenter__(self) -> PContext:
        require_asyncio("start_processes()")
        if self._phase is not Phase.NEW:
            raise RuntimeError(f"PContext {self.name!r} was already started; make a new one")
        self._phase = Phase.STARTING
        _platform.ensure_default_sigchld()
        async with AsyncExitStack() as always_cleanup, AsyncExitStack() as cleanup_on_fail:
            await self._blocking(self._hangs.open)
            cleanup_on_fail.push_async_callback(self._removing, self._hangs.close)
            self._files, prepared = await preparing.prepare_group(
                self._spec, self._method, self._hangs
            )
            # The log files no worker took over are closed however the start ends: all of
            # them if it failed, none are left once every worker started.
            always_cleanup.callback(preparing.close_logs, prepared)
            await self._start_watchdog()
            self._callbacks = callback_context()
            self._group = AsyncExitStack()
            await self._forwarding.handle(self._group)
            self._tg = await self._group.enter_async_context(anyio.create_task_group())
            # From here a failed start is undone by close(), the group's one teardown,
            # which removes the FIFOs with the group's other files.
            cleanup_on_fail.pop_all()
            cleanup_on_fail.push_async_callback(self._close_and_leave)
            await self._start_all(prepared)
            cleanup_on_fail.pop_all()
        if self._phase is Phase.STARTING:  # not stopped while starting
            self._phase = Phase.RUNNING
        if self._hangs.watching:
            self._tg.start_soon(self._run_hangs)
        self._forwarding.start(self._tg)
        if self._output.owned:
            self._output.hub.seal()  # every stream exists now: the last one ends output()
        # A worker that failed while its siblings were still starting had its teardown
        # held back until now, so that it covers every worker that was started.
        self._stop_if_failed()
        return self

    async def _blocking(self, fn: Callable[[], object]) -> None:
        """``fn()``, blocking file work for each rank (see :func:`~._preparing.blocking`)."""
        await preparing.blocking(self.nprocs, fn)

    async def _removing(self, fn: Callable[[], object]) -> None:
        """``fn()``, removing the group's files: on a launcher thread whatever its size.

        Removing a directory frees its block, and on a filesystem mounted with
        ``discard`` (ext4 on many cloud disks) the kernel trims it before ``rmdir``
        returns: 5 to 40 ms that would be held on the event loop.
        """
        await _launchers.on_launcher_thread(fn)

    async def _start_watchdog(self) -> None:
        """The watchdog process, started unless it runs (it guards every worker)."""
        try:
            if not watchdog.running():
                await _launchers.on_launcher_thread(watchdog.ensure_started)
        except OSError as exc:
            preparing.raise_start_error(exc, f"the watchdog process of {self.name!r}")

    async def _start_all(self, prepared: Mapping[int, preparing.Prepared]) -> None:
        assert self._files is not None
        assert self._tg is not None
        try:
            self._io.open(self._tg, self._spec)
        except OSError as hub_error:
            preparing.raise_start_error(hub_error, f"the output readers of {self.name!r}")
        starter = GroupStarter(
            self._spec,
            self._files,
            prepared,
            self._hangs,
            self._output,
            result_pipe=self._method.returns_value,
            workers=self._workers,
            on_exit=self._exit_seen,
            run_io=self._io.run,
            collapsers=self._io.collapsers,
        )
        await self._method.start(starter)
        if starter.errors:
            rank, exc = starter.errors[0]
            preparing.raise_start_error(exc, f"worker {rank} of {self.name!r}")
        self._method.after_group()

    # -- watching ---------------------------------------------------------------------

    def _exit_seen(self, worker: WorkerProcess, outcome: ExitOutcome) -> None:
        # A loop callback: anyio (the failure report's task, teardown's) needs to be told
        # where it runs.
        self._callbacks.copy().run(self._on_exit, worker, outcome)

    def _on_exit(self, worker: WorkerProcess, outcome: ExitOutcome) -> None:
        """Record the worker's exit, then settle its outcome (see :mod:`._settle`).

        Called back by the worker's exit watch, from the event loop. A success settles
        here and now; only a failure, whose report reads the error file, takes a task.
        """
        settle.record_exit(worker, outcome, self._hangs.exited)
        try:
            problems = settle.settle_success(worker, self._hang_texts)
        except Exception as exc:
            problems = [f"exit could not be reported: {exc!r}"]
        if problems is None:
            self._settled(worker)
            return
        # The group failed now: its teardown starts at once, while the report (which
        # reads the error file on a thread) is built beside it.
        self._any_failure = True
        try:
            self._stop_if_failed()
            assert self._tg is not None
            self._tg.start_soon(self._settle_failure, worker, problems)
        except Exception as exc:
            logger.exception("aioelastic: reporting the exit of worker %d", worker.local_rank)
            # No task can be started (the group's task group is closing): report the
            # failure without its error file rather than never.
            worker.failure = settle.unreported(worker, exc)
            self._settled(worker)

    async def _settle_failure(self, worker: WorkerProcess, problems: list[str]) -> None:
        """Build the failure report of ``worker`` and settle it. Shielded: it always ends."""
        with anyio.CancelScope(shield=True):
            try:
                await settle.report_failure(worker, problems, self._hang_texts)
            finally:
                self._settled(worker)

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
        if self._failed() and self._phase is Phase.RUNNING:
            self._phase = Phase.STOPPING
            assert self._tg is not None
            self._tg.start_soon(self._teardown, signal.SIGTERM, self._grace)

    # -- hangs (dump_stacks: see GroupViews) -------------------------------------------

    async def _run_hangs(self) -> None:
        assert self._tg is not None
        tg = self._tg
        hooks = WorkerHooks(
            {w.local_rank: w for w in self._workers},  # every worker has started by now
            self._hang_texts,
            lambda: tg.start_soon(self._stop, signal.SIGTERM, self._grace),
            self._stall_teller,
        )
        self._hang_scope = anyio.CancelScope()
        if self._phase >= Phase.STOPPING:
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
        if self._phase is Phase.NEW:
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
        if self._phase is Phase.NEW:
            raise RuntimeError("first_failures() needs the workers started: use 'async with'")
        await self._done.wait()
        return {w.local_rank: w.failure for w in self._ranked() if w.failure is not None}

    def _result(self) -> RunProcsResult:
        result = settle.group_result(self._ranked(), self.nprocs)
        if result.failures:
            self._any_failure = True
        return result

    # -- stopping ---------------------------------------------------------------------

    async def close(
        self, death_sig: int = signal.SIGTERM, grace_period: float | None = None
    ) -> None:
        """Stop every worker and everything in their process groups; idempotent.

        Sends ``death_sig`` to each worker's process group, waits (event-driven) up to
        the grace period given, in seconds (the group's, from its options, when
        ``None``), SIGKILLs every group that still has a member, and reaps. When the
        group's options stop each worker before its helpers, ``death_sig`` goes to each
        worker alone, and to the rest of its group once the worker exited. A second
        ``close()`` while one is in progress (a second Ctrl-C, say) escalates: the rest
        of the grace period is skipped and every group is SIGKILLed at once, whatever its
        arguments.
        """
        if self._phase is Phase.NEW:
            return
        grace = self._grace if grace_period is None else grace_period
        if self._close_calls:
            self._escalate.set()
        self._close_calls += 1

        async def stop_and_finish() -> None:
            with anyio.CancelScope(shield=True):
                await self._stop(death_sig, grace)
                await self._finish_io()

        # The shield keeps anyio's cancellation out as before; to_the_end also runs the
        # teardown to its end despite asyncio's own (a Ctrl-C under asyncio.run cancels
        # the main task, which is often this one), and raises it only then.
        with anyio.CancelScope(shield=True):
            await to_the_end(stop_and_finish)

    async def _stop(self, death_sig: int, grace: float) -> None:
        """Tear the group down, or wait for the teardown under way (hurried, if asked)."""
        if self._phase >= Phase.STOPPING:
            if death_sig == signal.SIGKILL or grace <= 0:
                self._escalate.set()
            await self._stopped.wait()
            return
        self._phase = Phase.STOPPING
        await self._teardown(death_sig, grace)

    async def _teardown(self, death_sig: int, grace: float) -> None:
        """The one teardown of the group's workers; then the group is STOPPED."""
        if self._hang_scope is not None:
            self._hang_scope.cancel()
        self._forwarding.stop()
        try:
            with anyio.CancelScope(shield=True):
                await stop_workers(
                    list(self._workers),
                    death_sig,
                    grace,
                    self._escalate,
                    leader_first=self._spec.options.stop_leader_first,
                )
                # Outcomes settle within REPORT_TIMEOUT of the exit: wait() after this
                # point sees every failure, not a half-reported group.
                with anyio.move_on_after(settle.REPORT_TIMEOUT + 1):
                    await wait_all(worker.settled for worker in self._workers)
        finally:
            self._phase = max(self._phase, Phase.STOPPED)
            self._done.set()
            self._stopped.set()

    async def _finish_io(self) -> None:
        if self._phase is Phase.CLOSED:
            return
        self._phase = Phase.CLOSED
        await self._io.finish(self._workers, self._output)
        await self._removing(self._remove_files)

    def _remove_files(self) -> None:
        """Blocking: remove the stack FIFOs and the temporary log directory (if empty)."""
        self._hangs.close()
        if self._files is not None:
            self._files.remove_temporary()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self._close_and_leave()
        return None

    async def _close_and_leave(self) -> None:
        """:meth:`close`, then leave the group's task group (entered by ``__aenter__``)."""
        assert self._tg is not None
        try:
            await self.close()
        except asyncio.CancelledError:
            # asyncio's own cancellation, passed on by close() once its teardown ended:
            # the task group is exited first, or it would stay entered in this task.
            await self._group.aclose()
            raise
        # Outside any shield: a task group must be exited from the scope it was entered
        # in. Its tasks are all finished or shielded-and-ending by now, so this is quick.
        await self._group.aclose()
