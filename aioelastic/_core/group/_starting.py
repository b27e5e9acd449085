"""Starting one worker of a group: its pipes and pumps, then its record once it exists.

A start method (:mod:`._start_methods`) makes the process; what every worker needs
around it is here. :meth:`GroupStarter.open` makes a worker's pipes (or pseudo-terminals)
and output pumps; :meth:`GroupStarter.record` makes the started process a
:class:`~..worker._process.WorkerProcess` of the group: watched, pumped, fed its call.

Cleanup after a start has two parts, as in trio's ``_open_process``: what always goes once
the start was tried (the child's ends of its pipes: it holds its own copies by then,
:meth:`Opening.close_child_ends`) and what goes only if the worker will not run (our
ends, the pumps, the log files, :meth:`Opening.abort`). :meth:`GroupStarter.open` and
:meth:`GroupStarter.record` clean up with exit stacks, which live and die within one step
of the event loop. Across the launch, which waits, an :class:`Opening` is itself the
context manager and knows what it holds: a stack's callbacks are half a dozen objects for
the garbage collector, kept through the start of every worker, and in a torch-loaded
supervisor each full collection they bring on costs ~80 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import string
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio

from ..aio._pace import pace
from ..child._result_pipe import ResultReceiver
from ..hangs._guard import HangGuard
from ..output._collapse import Collapser
from ..output._console import ConsoleSink, StreamName, console
from ..output._logs import StreamPump
from ..output._std import Std
from ..output._stdin_router import StdinRouter
from ..output._stream import OutputHub, StreamOutput
from ..output._terminal import ConsoleTerminals, WorkerStdio, open_worker_stdio
from ..process._runtime import runtime
from ..start._exit_watch import ExitOutcome
from ..start._launchers import Launched, kill_and_reap, on_launcher_thread
from ..start._watchdog import watchdog
from ..worker._process import WorkerProcess
from ._preparing import GroupFiles, Prepared
from ._validate import GroupSpec


@dataclass
class OutputTarget:
    """Where a group's output items go, and the ranks and attempt they carry."""

    hub: OutputHub
    #: Global rank by local rank (under the agent); ``None``: items carry no global rank.
    ranks: Mapping[int, int] | None = None
    attempt: int | None = None
    #: Whether the group owns ``hub`` (seals and closes it) or publishes into an agent's.
    owned: bool = True


@dataclass(eq=False)
class Opening:
    """The fds and pumps of one worker being started, until it is recorded (or fails)."""

    prepared: Prepared
    stdio: WorkerStdio
    stdout: StreamPump
    stderr: StreamPump
    #: The result pipe of a function worker (-1, -1 for a binary).
    res_r: int = -1
    res_w: int = -1
    #: The child's ends were closed (see :meth:`close_child_ends`).
    _child_ends_closed: bool = False
    #: Our ends were closed, or handed to the worker's record (see :meth:`abort`).
    _ours_let_go: bool = False

    @property
    def out_w(self) -> int:
        """The child's stdout (its write end)."""
        return self.stdio.stdout_w

    @property
    def err_w(self) -> int:
        """The child's stderr (its write end)."""
        return self.stdio.stderr_w

    @property
    def stdin(self) -> int | None:
        """The child's own stdin, if it gets one."""
        return self.stdio.stdin

    @property
    def parent_ends(self) -> list[int]:
        """Our ends, which a forked child must not keep."""
        ends = self.stdio.parent_ends()
        return [*ends, self.res_r] if self.res_r >= 0 else ends

    def close_child_ends(self) -> None:
        """Close the child's ends: it was started (it holds copies) or could not be."""
        if not self._child_ends_closed:
            self._child_ends_closed = True
            _close_child_ends(self.stdio, self.res_w)

    def recorded(self) -> None:
        """The worker's record owns our ends, the pumps and the log files from now on."""
        self._ours_let_go = True

    def abort(self) -> None:
        """Close everything not handed to a record: the worker will not run. Idempotent."""
        self.close_child_ends()
        if not self._ours_let_go:
            self._ours_let_go = True
            _close_ours(self.prepared, self.stdio, [self.stdout, self.stderr], self.res_r)

    def __enter__(self) -> Opening:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """The launch was tried: the child's ends go, and all the rest if it failed."""
        if exc_type is None:
            self.close_child_ends()
        else:
            self.abort()


#: Makes the process of an opened worker: one start method's launch.
Launch = Callable[[Prepared, Opening], Awaitable[Launched]]


class GroupStarter:
    """Opens and records the workers of one group's start.

    Args:
        spec: the group.
        files: its log files (made by :func:`~._preparing.prepare_group`).
        prepared: each rank's environment and call.
        hangs: the group's hang guard (told of each worker's pid).
        output: where output items go.
        result_pipe: whether workers send a return value back (function workers).
        workers: the group's records, appended to as workers are recorded.
        on_exit: called back by each worker's exit watch.
        run_io: runs an I/O task of the group (shielded, ended at teardown).
        collapsers: the group's collapsing stage per console stream (none: every line is
            printed as written).
    """

    def __init__(
        self,
        spec: GroupSpec,
        files: GroupFiles,
        prepared: Mapping[int, Prepared],
        hangs: HangGuard,
        output: OutputTarget,
        *,
        result_pipe: bool,
        workers: list[WorkerProcess],
        on_exit: Callable[[WorkerProcess, ExitOutcome], None],
        run_io: Callable[..., None],
        collapsers: Mapping[StreamName, Collapser] | None = None,
    ) -> None:
        self.spec = spec
        self.files = files
        self.prepared = prepared
        self._hangs = hangs
        self._output = output
        self._result_pipe = result_pipe
        self._workers = workers
        self._on_exit = on_exit
        self._run_io = run_io
        self._collapsers = collapsers or {}
        self._terminals = ConsoleTerminals.probe()
        self._router: StdinRouter | None = None
        #: The starts that failed, by rank, in the order seen: the first one is raised.
        self.errors: list[tuple[int, BaseException]] = []

    def private_fds(self) -> list[int]:
        """The supervisor's fds a forked worker must close (they would outlive us in it)."""
        return [*filter(None, [watchdog.fileno()]), *self._hangs.fds()]

    async def start_one(self, rank: int, launch: Launch) -> None:
        """Open, launch and record the worker of ``rank``; a failure goes to :attr:`errors`."""
        try:
            await pace()
            opening = self.open(rank)
            with opening:
                launched = await launch(self.prepared[rank], opening)
            # The process exists: only its record may follow, whatever is cancelled.
            with anyio.CancelScope(shield=True):
                await pace()
            await self.record(rank, opening, launched)
        except Exception as exc:
            self.errors.append((rank, exc))

    def open(self, rank: int) -> Opening:
        """The pipes and pumps of a worker about to start (all closed if this fails)."""
        prepared = self.prepared[rank]
        # Every fd made here is closed on any failure (EMFILE can strike at each step).
        with contextlib.ExitStack() as cleanup_on_fail:
            cleanup_on_fail.callback(prepared.close_logs)  # the ones no pump took
            stdout = self._pump_settings(rank, Std.OUT)
            stderr = self._pump_settings(rank, Std.ERR)
            stdio = open_worker_stdio(
                stdout_plain=_plain(stdout),
                stderr_plain=_plain(stderr),
                single_worker=self.spec.nprocs == 1,
                terminals=self._terminals,
            )
            cleanup_on_fail.callback(_close_child_ends, stdio, -1)
            pumps: list[StreamPump] = []
            cleanup_on_fail.callback(_close_pumped, stdio, pumps)
            res_r = res_w = -1
            if self._result_pipe:
                res_r, res_w = os.pipe2(os.O_CLOEXEC)
                cleanup_on_fail.callback(os.close, res_r)
                cleanup_on_fail.callback(os.close, res_w)
            for fd, settings, live, stream in (
                (stdio.stdout_r, stdout, stdio.live_stdout, Std.OUT),
                (stdio.stderr_r, stderr, stdio.live_stderr, Std.ERR),
            ):
                log_fd = prepared.log_fds.get(stream)
                pumps.append(StreamPump(fd, **settings, live=live, log_fd=log_fd))
                prepared.take_log(stream)  # only now: the pump made owns it
            cleanup_on_fail.pop_all()
        return Opening(prepared, stdio, pumps[0], pumps[1], res_r, res_w)

    async def record(self, rank: int, opening: Opening, launched: Launched) -> None:
        """Make the started process a worker of the group, watched and pumped."""
        async with contextlib.AsyncExitStack() as cleanup_on_fail:
            cleanup_on_fail.push_async_callback(_undo_launch, opening, launched)
            watchdog.watch(launched.pid)
            self._hangs.started(rank, launched.pid)
            worker = WorkerProcess(
                local_rank=rank,
                launched=launched,
                error_file=opening.prepared.error_file,
                stdout_path=self.files.logged_path(rank, Std.OUT),
                stderr_path=self.files.logged_path(rank, Std.ERR),
                stdout=opening.stdout,
                stderr=opening.stderr,
                result=ResultReceiver(opening.res_r) if opening.res_r >= 0 else None,
            )
            launched.watch.on_exit(functools.partial(self._on_exit, worker))
            runtime.worker_leaders.add(launched.pid)  # until stop_workers reaps it
            cleanup_on_fail.pop_all()
        opening.recorded()
        self._workers.append(worker)
        # Reader callbacks, not tasks: a task costs a few kB, two per worker.
        worker.stdout.start()
        worker.stderr.start()
        if opening.stdio.uses_terminal:
            self._run_io(opening.stdio.serve, launched.pid)
        if opening.stdio.stdin_master is not None:
            streams = (worker.stdout, worker.stderr)
            target = opening.stdio.stdin_target(rank, self._label(rank), launched.pid, streams)
            self._run_io(self._stdin_router().attach, target)
        if worker.result is not None:
            worker.result.start(asyncio.get_running_loop())
        if launched.payload_fd is not None:
            assert isinstance(opening.prepared.payload, bytes)
            self._run_io(feed_payload, launched.payload_fd, opening.prepared.payload)

    def _stdin_router(self) -> StdinRouter:
        """The router of typed input to this start's workers, run from its first use."""
        if self._router is None:
            self._router = StdinRouter(alone=self.spec.nprocs == 1)
            self._run_io(self._router.run)
        return self._router

    def _label(self, rank: int) -> str:
        """How the console names the worker of local rank ``rank``."""
        ranks = self._output.ranks
        if ranks is None:
            return f"local rank {rank}"
        return f"rank {ranks[rank]} (local rank {rank})"

    def _pump_settings(self, rank: int, stream: Std) -> dict[str, Any]:
        spec = self.spec
        shown = spec.options.shows(rank, self._output.ranks)
        teed = stream in spec.tee[rank]
        redirected = stream in self.files.logged[rank]
        name: StreamName = "stdout" if stream is Std.OUT else "stderr"
        target: ConsoleSink = console(name)
        if shown and teed:
            sink, prefix = target, _prefix(spec, rank)
        elif shown and not redirected:
            sink, prefix = target, b""
        else:
            sink, prefix = None, b""
        collapser = self._collapsers.get(name)
        if sink is not None and collapser is not None:
            sink = collapser.lane(_shown_rank(spec, rank), prefix)
        ranks = self._output.ranks
        return {
            "log_path": self.files.log_path(rank, stream) if redirected else None,
            "console": sink,
            "prefix": prefix,
            "keep_tail": stream is Std.ERR,
            "output": StreamOutput(
                self._output.hub,
                rank,
                stream,
                rank=None if ranks is None else ranks[rank],
                attempt=self._output.attempt,
            ),
        }


async def _undo_launch(opening: Opening, launched: Launched) -> None:
    """Kill and reap a started process that will not be recorded, and close its fds."""
    # The process exists but nothing would ever stop or reap it: do both now.
    with anyio.CancelScope(shield=True):
        await on_launcher_thread(kill_and_reap, launched)
    watchdog.forget(launched.pid)
    opening.abort()
    if launched.payload_fd is not None:
        os.close(launched.payload_fd)


def _close_child_ends(stdio: WorkerStdio, res_w: int) -> None:
    """Close the descriptors made for the child (its copies are its own)."""
    if res_w >= 0:
        os.close(res_w)
    for fd in stdio.child_ends():
        os.close(fd)


def _close_ours(
    prepared: Prepared, stdio: WorkerStdio, pumps: list[StreamPump], res_r: int
) -> None:
    """Close what the supervisor made for a worker that will not run.

    The pumps are finished (closing their pipes and logs), then the ends none of them
    owns, then the log files no pump took.
    """
    if res_r >= 0:
        os.close(res_r)
    _close_pumped(stdio, pumps)
    prepared.close_logs()


def _close_pumped(stdio: WorkerStdio, pumps: list[StreamPump]) -> None:
    """Finish the pumps (closing their pipes and logs), then close the ends none owns."""
    owned = set()
    for pump in pumps:
        owned.add(pump.fileno())
        pump.finish()
    for fd in stdio.parent_ends():
        if fd not in owned:
            os.close(fd)


def _shown_rank(spec: GroupSpec, rank: int) -> int:
    """The number the console prefix of local rank ``rank`` shows, for collapsed lines.

    The global rank (``RANK``) when the prefix template uses ``${rank}``; otherwise the
    local rank, as the default prefix ``[{name}{local_rank}]:`` shows it.
    """
    template = spec.options.log_line_prefix
    if template is not None and "rank" in _template_fields(template):
        text = spec.envs[rank].get("RANK", "")
        if text.isdigit():
            return int(text)
    return rank


def _template_fields(template: str) -> set[str]:
    """The names a ``string.Template`` substitutes (``${rank}`` and ``$rank`` alike)."""
    return {
        m.group("named") or m.group("braced")
        for m in string.Template.pattern.finditer(template)
        if m.group("named") or m.group("braced")
    }


def _prefix(spec: GroupSpec, rank: int) -> bytes:
    if spec.options.log_line_prefix is None:
        return f"[{spec.name}{rank}]:".encode()
    env = spec.envs[rank]
    text = string.Template(spec.options.log_line_prefix).substitute(
        role_name=env.get("ROLE_NAME", spec.name),
        rank=env.get("RANK", str(rank)),
        local_rank=str(rank),
        hostname=socket.gethostname(),
    )
    return text.encode()


def _plain(pump: dict[str, Any]) -> bool:
    """A stream that goes to the console unprefixed and nowhere else (see _terminal)."""
    return pump["console"] is not None and not pump["prefix"] and pump["log_path"] is None


async def feed_payload(fd: int, payload: bytes) -> None:
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
