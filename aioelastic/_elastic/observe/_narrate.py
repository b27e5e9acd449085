"""What the agent says out loud: one readable line per lifecycle event that matters.

A :class:`Narrator` consumes the agent's events (:mod:`._events`) and logs them on the
``aioelastic.agent`` logger, worded like torchrun's lines so that log scrapers keep
working::

    [default] failed (exitcode: 5) local_rank: 1 (global rank: 1, pid: 4113); error file: ...
    [default] Worker group FAILED. 3/3 attempts left; will restart worker group (restart 1
      of 3, after 2.0 s backoff)
    [default] Worker group FAILED. 0/2 attempts left; giving up
    [default] Worker group FAILED; not retried: exit code 3 is in no_retry_exit_codes
    [default] membership change (1 node(s) waiting to join): re-rendezvous without using a restart
    [default] new membership: world size 8 (2 nodes), this node is node 1
    [default] run succeeded after 1 restart(s) in 12.3 s

Failures, decisions, membership changes and a summary of any run that did not simply
succeed are WARNING or ERROR, so they show at the default ``LOGLEVEL``; INFO adds timings
(how long the rendezvous took, the workers' start); DEBUG adds every event's fields. No
line is a raw ``repr``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import IO

from ._events import (
    AgentEvent,
    FailureReason,
    GroupRestarting,
    GroupStopping,
    RendezvousCompleted,
    RunFailed,
    RunSucceeded,
    StopReason,
    WorkerFailed,
    WorkersStarted,
)

logger = logging.getLogger("aioelastic.agent")


class Narrator:
    """Turns one agent's events into log lines; keeps what it needs for timings."""

    def __init__(self) -> None:
        self._since = time.time()
        self._stopping: GroupStopping | None = None
        self._world: tuple[int, int] | None = None
        self._started_at: float | None = None

    def __call__(self, event: AgentEvent) -> None:
        """Log ``event``."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", _fields(event))
        for level, line in self.lines(event):
            logger.log(level, "[%s] %s", event.role, line)

    def lines(self, event: AgentEvent) -> list[tuple[int, str]]:
        """The ``(level, text)`` lines ``event`` is told with (no role prefix)."""
        if isinstance(event, RendezvousCompleted):
            return self._rendezvous(event)
        if isinstance(event, WorkersStarted):
            took = event.timestamp - self._since
            self._since = event.timestamp
            if self._started_at is None:
                self._started_at = event.timestamp
            ranks = sorted(event.pids)
            return [
                (
                    logging.INFO,
                    f"started {len(ranks)} worker(s) (global ranks {rank_ranges(ranks)}) "
                    f"in {took:.2f} s",
                )
            ]
        if isinstance(event, WorkerFailed):
            return [(logging.ERROR, _failure(event))]
        if isinstance(event, GroupStopping):
            self._stopping = event
            self._since = event.timestamp
            why = event.reason.value.replace("_", " ")
            detail = f" ({event.detail})" if event.detail else ""
            # Another node's end is news here: nothing local announced it.
            level = logging.WARNING if event.reason is StopReason.PEER_ENDED else logging.INFO
            return [(level, f"stopping the workers: {why}{detail}")]
        if isinstance(event, GroupRestarting):
            self._since = event.timestamp
            return [self._restarting(event)]
        if isinstance(event, RunSucceeded):
            return [self._summary(event, "run succeeded")]
        if isinstance(event, RunFailed):
            return self._failed(event)
        return []

    def _rendezvous(self, event: RendezvousCompleted) -> list[tuple[int, str]]:
        took = event.timestamp - self._since
        self._since = event.timestamp
        world = (event.world_size, event.group_world_size)
        lines = [
            (
                logging.INFO,
                f"rendezvous complete in {took:.2f} s: world size {event.world_size} "
                f"({event.group_world_size} node(s)), this node is node {event.group_rank}, "
                f"master {event.master_addr}:{event.master_port}",
            )
        ]
        if self._world is not None and world != self._world:
            lines.append(
                (
                    logging.WARNING,
                    f"new membership: world size {event.world_size} "
                    f"({event.group_world_size} node(s)), this node is node {event.group_rank}",
                )
            )
        self._world = world
        return lines

    def _restarting(self, event: GroupRestarting) -> tuple[int, str]:
        if event.reason is StopReason.MEMBERSHIP_CHANGE:
            stopping = self._stopping
            detail = f" ({stopping.detail})" if stopping is not None and stopping.detail else ""
            return (
                logging.WARNING,
                f"membership change{detail}: re-rendezvous without using a restart",
            )
        total = event.restart_count + event.restarts_left
        backoff = f", after {event.delay:.1f} s backoff" if event.delay > 0 else ""
        return (
            logging.WARNING,
            f"Worker group FAILED. {event.restarts_left + 1}/{total} attempts left; will "
            f"restart worker group (restart {event.restart_count} of {total}{backoff})",
        )

    def _failed(self, event: RunFailed) -> list[tuple[int, str]]:
        if event.reason is FailureReason.RESTARTS_EXHAUSTED:
            total = event.restart_count
            decision = f"Worker group FAILED. 0/{total} attempts left; giving up"
        elif event.reason is FailureReason.NO_RETRY_EXIT_CODE:
            decision = f"Worker group FAILED; not retried: {event.detail}"
        elif event.reason is FailureReason.PEER_FAILED:
            decision = f"Worker group FAILED; another node ended the job: {event.detail}"
        elif event.reason is FailureReason.STORE_LOST:
            decision = f"Worker group FAILED: {event.detail}"
        else:
            # Not a verdict on the workers: one line says what ended the run.
            _, summary = self._summary(event, "")
            if event.reason is FailureReason.SIGNAL:
                return [(logging.WARNING, f"stopped by {event.detail or 'a signal'}{summary}")]
            if event.reason is FailureReason.CANCELLED:
                return [(logging.INFO, f"cancelled{summary}")]
            return [(logging.ERROR, f"agent error: {event.detail}{summary}")]
        return [(logging.ERROR, decision), self._summary(event, "run failed")]

    def _summary(self, event: AgentEvent, outcome: str) -> tuple[int, str]:
        took = event.timestamp - (self._started_at or event.timestamp)
        restarts = f" after {event.restart_count} restart(s)" if event.restart_count else ""
        # The restart count is the job's: a node that joined late ran fewer attempts.
        changes = max(0, event.attempt - event.restart_count)
        membership = f", {changes} membership change(s)" if changes else ""
        if isinstance(event, RunFailed):
            level = logging.ERROR
        else:
            level = logging.WARNING if event.attempt else logging.INFO
        return level, f"{outcome}{restarts}{membership} in {took:.1f} s"


def _failure(event: WorkerFailed) -> str:
    how = f"signal: {event.signal}" if event.signal else f"exitcode: {event.exitcode}"
    line = (
        f"failed ({how}) local_rank: {event.local_rank} "
        f"(global rank: {event.global_rank}, pid: {event.pid})"
    )
    error_file = event.failure.error_file
    if error_file and os.path.exists(error_file):
        line += f"; error file: {error_file}"
    logs = os.path.dirname(error_file) if error_file and os.path.isabs(error_file) else ""
    if logs and any(os.path.exists(os.path.join(logs, n)) for n in ("stdout.log", "stderr.log")):
        line += f"; logs: {logs}"
    return line


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 2, 3, 4, 7, 8]`` -> ``"0,2-4,7,8"``: runs of three or more as a range."""
    out: list[str] = []
    run: list[int] = []
    for rank in [*sorted(ranks), None]:
        if rank is not None and run and rank == run[-1] + 1:
            run.append(rank)
            continue
        if len(run) > 2:
            out.append(f"{run[0]}-{run[-1]}")
        else:
            out += map(str, run)
        run = [] if rank is None else [rank]
    return ",".join(out)


def _fields(event: AgentEvent) -> str:
    """Every field as ``key=value`` (DEBUG): readable, unlike the dataclass repr."""
    skip = {"kind", "failure", "failures", "timestamp", "role"}
    parts = [event.kind]
    for name in event.__dataclass_fields__:
        if name in skip:
            continue
        value = getattr(event, name)
        if hasattr(value, "value"):
            value = value.value
        if isinstance(value, dict) or type(value).__name__ == "mappingproxy":
            value = ",".join(f"{k}:{v}" for k, v in sorted(dict(value).items()))
        parts.append(f"{name}={value}")
    return " ".join(parts)


_COLOURS = {
    logging.DEBUG: "\x1b[2m",
    logging.INFO: "",
    logging.WARNING: "\x1b[33m",
    logging.ERROR: "\x1b[31m",
    logging.CRITICAL: "\x1b[1;31m",
}


class LauncherFormatter(logging.Formatter):
    """``[prog] LEVEL: message``, the level coloured only on a terminal without NO_COLOR.

    Args:
        prog: The program name in brackets.
        stream: Where the handler writes; colour is decided from it once.
    """

    def __init__(self, prog: str, stream: IO[str] | None = None) -> None:
        super().__init__(f"[{prog}] %(levelname)s: %(message)s")
        self._prog = prog
        self.colour = _wants_colour(sys.stderr if stream is None else stream)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        colour = _COLOURS.get(record.levelno, "") if self.colour else ""
        if not colour:
            return text
        head = f"[{self._prog}] {record.levelname}:"
        return f"{colour}{head}\x1b[0m{text[len(head) :]}"


def _wants_colour(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR"):  # https://no-color.org: any non-empty value
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
