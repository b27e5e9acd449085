"""Hang handling for one group of workers: stacks on demand, the file timer, stalls.

:class:`HangGuard` is what a group (:class:`~aioelastic.PContext`) holds: it gives each
worker its environment (the stacks FIFO, ``TORCHELASTIC_TIMER_FILE``), runs the timer
server and the stall check while the group runs, and turns an expiry or a stall into a
call to the group's :class:`HangHooks` with the reason and the stacks. The group decides
how a rank fails and how it is stopped; this module only finds out and explains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

import anyio

from ..child._stack_hook import STACK_SIGNAL
from ..process import _values as values
from ..worker._process import WorkerProcess
from ._stacks import DEFAULT_TIMEOUT, StackChannels, py_spy_dump
from ._stall import RankActivity, StallReport, StallTeller, wait_for_stall
from ._timer_server import ENABLE_ENV, FILE_ENV, Expiry, TimerServer

logger = logging.getLogger("aioelastic")

#: How long a group's :data:`StallTeller` may take to tell a stall (an agent asks every
#: node for its stacks, bounded at 10 s) before the group's own report is printed instead
#: and the group stopped: a stall is never left running for want of a report.
STALL_TELL_TIMEOUT = 20.0


@dataclass(frozen=True)
class HangConfig:
    """What hang handling a group gets.

    Attributes:
        file_timer: serve torch's file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``).
        timer_file: where the timer FIFO goes (``TORCHELASTIC_TIMER_FILE``); a fresh
            temporary path when ``None``.
        stall_timeout: seconds without output or timer request from any worker after
            which the group is stalled; ``None`` (the default) never.
        stack_timeout: bound of one stack capture, in seconds.
    """

    file_timer: bool = False
    timer_file: Path | None = None
    stall_timeout: float | None = None
    stack_timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        # The parser every entry point uses for a duration (aioelastic._core.process._values).
        if self.stall_timeout is not None:
            values.field("stall_timeout", values.positive_duration, self.stall_timeout)
        values.field("stack_timeout", values.positive_duration, self.stack_timeout)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, stall_timeout: float | None = None
    ) -> HangConfig:
        """The configuration torchrun's agent reads from its environment, plus a stall timeout."""
        timer_file = environ.get(FILE_ENV)
        return cls(
            file_timer=environ.get(ENABLE_ENV) == "1",
            timer_file=Path(timer_file) if timer_file else None,
            stall_timeout=stall_timeout,
        )


class HangHooks(Protocol):
    """What the guard needs from its group."""

    def running(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the workers still running."""

    def activity(self) -> list[RankActivity]:
        """Each rank's last output."""

    def hung(self, rank: int, text: str, sig: int) -> None:
        """Rank ``rank`` is hung: record ``text`` as its failure and stop it with ``sig``."""

    def stalled(self, texts: dict[int, str]) -> None:
        """The group stalled: record each rank's text as its failure and stop the group."""

    async def tell_stall(self, report: StallReport) -> str:
        """The text printed for a stall, before the group is stopped (may raise)."""


class HangGuard:
    """Stacks, timers and stall checks for the workers of one group."""

    def __init__(
        self, config: HangConfig, nprocs: int, *, stack_ranks: Collection[int] | None = None
    ) -> None:
        """Make the guard of a group of ``nprocs`` workers (no I/O until :meth:`open`).

        Args:
            config: What is enabled (file timer, stall timeout) and its bounds.
            nprocs: The number of workers.
            stack_ranks: The ranks that can answer stack requests and so get a stack
                FIFO (all when ``None``).
        """
        self.config = config
        self._stacks = StackChannels(range(nprocs) if stack_ranks is None else stack_ranks)
        self._timer: TimerServer | None = None
        self._owner: dict[int, int] = {}
        self._answering: set[int] = set()
        self._started_at = time.monotonic()
        self.stalls = 0

    @property
    def watching(self) -> bool:
        """Whether :meth:`run` has anything to do (a file timer or a stall timeout)."""
        return self.config.file_timer or self.config.stall_timeout is not None

    @property
    def timer(self) -> TimerServer | None:
        """The timer server, when the file timer is enabled."""
        return self._timer

    def open(self) -> None:
        """Create the stack FIFOs and, if enabled, the timer FIFO."""
        self._stacks.open()
        if not self.config.file_timer:
            return
        with contextlib.ExitStack() as cleanup_on_fail:
            cleanup_on_fail.callback(self._stacks.close)
            path = self.config.timer_file
            if path is None:
                fd, name = tempfile.mkstemp(prefix="aioelastic_timer_", suffix=".fifo")
                os.close(fd)
                os.unlink(name)  # only the unique name is wanted: mkfifo creates it
                path = Path(name)
            self._timer = TimerServer(path, self._owner.get)
            self._timer.open()
            cleanup_on_fail.pop_all()

    def fds(self) -> list[int]:
        """The supervisor's own FIFO descriptors (a forked worker must close them)."""
        found = self._stacks.fds()
        if self._timer is not None and self._timer.fd is not None:
            found.append(self._timer.fd)
        return found

    def worker_env(self, rank: int, *, python: bool = True) -> dict[str, str]:
        """The environment entries of rank ``rank``.

        ``python``: the worker runs our bootstrap or the stack hook and can answer stack
        requests. Others (any other binary) get no stacks FIFO: their environment stays
        exactly torchrun's, and a stack request answers at once that there is none.
        """
        env = {}
        if python and rank in self._stacks.channels:
            env.update(self._stacks.channels[rank].env())
            self._answering.add(rank)
        if self._timer is not None:
            env[FILE_ENV] = str(self._timer.path)
        return env

    def started(self, rank: int, pid: int) -> None:
        """Worker ``rank`` runs as ``pid``: accept its timer requests."""
        self._owner[pid] = rank

    def exited(self, pid: int) -> None:
        """Worker ``pid`` exited: its timers go with it."""
        self._owner.pop(pid, None)
        if self._timer is not None:
            self._timer.forget(pid)

    async def dump_stacks(
        self, pids: Mapping[int, int], timeout: float | None = None
    ) -> dict[int, str]:
        """Every thread's stack of each ``{rank: pid}``, without stopping them."""
        asked = {r: p for r, p in pids.items() if r in self._answering}
        bound = timeout or self.config.stack_timeout
        found = await self._stacks.capture(asked, bound)

        async def from_outside(rank: int) -> None:
            # No hook in this worker: py-spy, where installed, reads it from outside.
            dump = await py_spy_dump(pids[rank], bound)
            found[rank] = dump or (
                f"(no Python stack: local rank {rank} runs a binary without aioelastic's "
                "stack hook, and py-spy is not installed or may not trace it; see "
                "docs/hangs.md)\n"
            )

        async with anyio.create_task_group() as tg:  # all at once: one bound in all
            for rank in pids.keys() - asked.keys():
                tg.start_soon(from_outside, rank)
        return dict(sorted(found.items()))

    async def run(self, hooks: HangHooks) -> None:
        """Serve timers and watch for stalls until cancelled."""
        async with anyio.create_task_group() as tg:
            if self._timer is not None:

                async def on_expired(expiry: Expiry) -> None:
                    await self._expired(expiry, hooks)

                tg.start_soon(self._timer.serve, on_expired)
            if self.config.stall_timeout is not None:
                tg.start_soon(self._watch_stalls, self.config.stall_timeout, hooks)

    async def _expired(self, expiry: Expiry, hooks: HangHooks) -> None:
        if hooks.running().get(expiry.rank) != expiry.pid:
            return  # it exited meanwhile: nothing is hung
        stacks = await self.dump_stacks({expiry.rank: expiry.pid})
        text = f"{expiry.reason()}\n{stacks[expiry.rank]}"
        logger.warning(
            "aioelastic: local rank %d (pid %d): %s", expiry.rank, expiry.pid, text.rstrip()
        )
        hooks.hung(expiry.rank, text, expiry.signal)

    def _last_activity(self, hooks: HangHooks) -> float:
        times = [self._started_at]
        times += [a.last_output for a in hooks.activity() if a.last_output is not None]
        if self._timer is not None and self._timer.last_request is not None:
            times.append(self._timer.last_request)
        return max(times)

    async def _watch_stalls(self, timeout: float, hooks: HangHooks) -> None:
        idle = await wait_for_stall(timeout, lambda: self._last_activity(hooks))
        running = hooks.running()
        stacks = await self.dump_stacks(running)
        report = StallReport(timeout, idle, hooks.activity(), stacks)
        self.stalls += 1
        text = None
        try:
            with anyio.move_on_after(STALL_TELL_TIMEOUT):
                text = await hooks.tell_stall(report)
        except Exception as exc:
            logger.warning("aioelastic: could not tell the stall in full: %r", exc)
        if text is None:
            text = report.format()
        logger.warning("aioelastic: %s", text.rstrip())
        by_rank = {a.rank: a for a in report.ranks}
        texts = {}
        for rank in running:
            line = report.rank_line(by_rank.get(rank, RankActivity(rank, None)))
            texts[rank] = f"{report.reason()}\n{line}\n{stacks.get(rank, '')}"
        hooks.stalled(texts)

    def close(self) -> None:
        """Remove every FIFO; idempotent."""
        self._stacks.close()
        if self._timer is not None:
            self._timer.close()


class WorkerHooks:
    """:class:`HangHooks` over a group's worker records.

    Args:
        workers: the group's workers by local rank (read live).
        texts: where the hang text of each failed rank goes; the group prepends it to
            that rank's failure message.
        stop_group: starts the group's teardown (after a stall).
        teller: tells a stall (an agent's, with every node's stacks); ``None``: the
            report of this group's ranks.
    """

    def __init__(
        self,
        workers: Mapping[int, WorkerProcess],
        texts: dict[int, str],
        stop_group: Callable[[], object],
        teller: StallTeller | None = None,
    ) -> None:
        self._workers = workers
        self._texts = texts
        self._stop_group = stop_group
        self._teller = teller

    def running(self) -> dict[int, int]:
        return {r: w.pid for r, w in sorted(self._workers.items()) if w.returncode is None}

    def activity(self) -> list[RankActivity]:
        found = []
        for rank, worker in sorted(self._workers.items()):
            pumps = [p for p in (worker.stdout, worker.stderr) if p.last_output is not None]
            if not pumps:
                found.append(RankActivity(rank, None))
                continue
            latest = max(pumps, key=lambda p: p.last_output or 0.0)
            text = latest.last_chunk.decode("utf-8", "replace")
            lines = [line for line in text.splitlines() if line.strip()]
            found.append(RankActivity(rank, latest.last_output, lines[-1] if lines else ""))
        return found

    def hung(self, rank: int, text: str, sig: int) -> None:
        worker = self._workers[rank]
        if worker.returncode is not None:
            return
        self._record(worker, text)
        # The leader is not reaped before teardown, so its pid still names its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, sig)

    def stalled(self, texts: dict[int, str]) -> None:
        for rank, text in texts.items():
            self._record(self._workers[rank], text)
        self._stop_group()

    async def tell_stall(self, report: StallReport) -> str:
        if self._teller is None:
            return report.format()
        return await self._teller(report)

    def _record(self, worker: WorkerProcess, text: str) -> None:
        self._texts[worker.local_rank] = text
        if worker.stderr_path:
            # O_APPEND, like the log pump's own descriptor: neither overwrites the other.
            with contextlib.suppress(OSError):
                fd = os.open(worker.stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                try:
                    os.write(fd, f"[aioelastic] {text}".encode(errors="replace"))
                finally:
                    os.close(fd)


#: The signal that asks the launcher (the agent, ``aioelastic-run``) to print the stacks of
#: every local worker: the same one each worker answers (see :mod:`..child._stack_hook`).
LAUNCHER_STACK_SIGNAL = STACK_SIGNAL


def _show(stacks: Mapping[int, str] | str, stream: TextIO) -> None:
    """Print what a stack request gave: a report, or each local rank's stack."""
    if isinstance(stacks, str):
        stream.write(stacks)
    else:
        for rank, text in sorted(stacks.items()):
            stream.write(f"--- stack of local rank {rank} ---\n{text}")
        if not stacks:
            stream.write("--- no worker is running ---\n")
    stream.flush()


@asynccontextmanager
async def stack_requests(
    dump: Callable[[], Awaitable[Mapping[int, str] | str]], out: TextIO | None = None
) -> AsyncIterator[None]:
    """While the block runs, print every worker's stacks when the process gets ``SIGURG``.

    ``kill -URG <launcher pid>`` prints them to ``out`` (stderr) without stopping anything:
    ``dump()`` gives them by local rank, or as a report already written (the agent's, of
    the whole job). Off the main thread (where no signal handler can be installed) this
    does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:

        async def answer() -> None:
            with anyio.open_signal_receiver(LAUNCHER_STACK_SIGNAL) as signals:
                async for _ in signals:
                    # Shielded: the block may end while the report is gathered (a node
                    # that never answers is found vanished, and the job ends), and a
                    # report that was asked for is still printed. The dump bounds itself.
                    with anyio.CancelScope(shield=True):
                        _show(await dump(), out if out is not None else sys.stderr)

        tg.start_soon(answer)
        try:
            yield
        except BaseException as exc:
            # Whatever ends the block is re-raised outside the task group, which would
            # wrap it (a KeyboardInterrupt, too) in an exception group.
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
