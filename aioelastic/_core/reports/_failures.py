"""The failure report: how one worker failed (`ProcessFailure`) and how a group did
(`ChildFailedError`), read from the workers' error files (:mod:`..child._error_file`).
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..child._error_file import (
    NOT_AVAILABLE,
    ErrorFileContents,
    load_error_file,
    message_and_times,
    safe_str,
)
from ..process._exit_status import exit_description, signal_name

__all__ = ["STDERR_TAIL_LINES", "ChildFailedError", "ProcessFailure", "failure_traceback"]

STDERR_TAIL_LINES = 50
"""How many trailing stderr lines a failure without an error file keeps as its message."""


def _tail_text(stderr_tail: Sequence[str]) -> str:
    if isinstance(stderr_tail, str):
        stderr_tail = stderr_tail.splitlines()
    lines = [str(line).rstrip("\r\n") for line in stderr_tail][-STDERR_TAIL_LINES:]
    tail = "\n".join(lines).strip("\n")
    return tail if tail.strip() else ""


def _describe(
    *,
    exitcode: int,
    error_file: str,
    fallback_time: float,
    stderr_tail: Sequence[str],
    file_seconds: bool,
) -> tuple[str, str, float, dict[str, Any]]:
    """``(error_file, message, timestamp, error_file_data)`` of a failed worker.

    ``file_seconds``: use the file's whole-second ``timestamp`` when it has no
    ``timestamp_ns`` (torch's constructor does); else ``fallback_time``, the supervisor's
    sub-second view of the exit, wins over a time truncated to the second.
    """
    try:
        contents = load_error_file(error_file)
    except Exception as e:  # a bug here must not cost the report of the worker's exit
        contents = ErrorFileContents(
            problem=f"error file unreadable: {type(e).__name__}: {safe_str(e)}"
        )
    tail = _tail_text(stderr_tail)
    if contents.data is not None:
        text, ns, seconds = message_and_times(contents.data)
        when = fallback_time
        if ns is not None:
            when = ns
        elif file_seconds and seconds is not None:
            when = seconds
        if text is None or not text.strip():
            text = 'error file unreadable: it has no "message" text'
            if tail:
                text = f"{text}\n{tail}"
        return error_file, text, when, contents.data
    if contents.salvaged is not None:
        return error_file, contents.salvaged, fallback_time, {}
    if contents.problem is not None:
        message = f"{contents.problem}\n{tail}" if tail else contents.problem
        return error_file, message, fallback_time, {}
    return NOT_AVAILABLE, tail or exit_description(exitcode), fallback_time, {}


def failure_traceback(failure: ProcessFailure) -> str:
    """What `ChildFailedError.format_msg` shows as a failure's traceback."""
    raw = failure.error_file_data.get("message")
    if isinstance(raw, Mapping):
        extra = raw.get("extraInfo")
        if isinstance(extra, Mapping) and isinstance(extra.get("py_callstack"), str):
            return str(extra["py_callstack"])
        if isinstance(raw.get("message"), str):
            return str(raw["message"])
    elif isinstance(raw, str):
        return raw
    return failure.message or NOT_AVAILABLE


@dataclass
class ProcessFailure:
    """How one worker failed.

    Built with only its first four fields, as code written against torch does
    (``ProcessFailure(local_rank, pid, exitcode, error_file)``), it reads the error file
    like torch's dataclass: ``message``, ``timestamp`` and ``error_file_data`` come from
    the file (read defensively, see `from_exit`), and ``error_file`` becomes ``"<N/A>"``
    when there is none. Given any of those three fields it does no I/O.

    Attributes:
        local_rank: the worker's local rank.
        pid: the worker's process id.
        exitcode: its exit status; negative means killed by signal ``-exitcode``.
        error_file: the error file it wrote, or ``"<N/A>"`` (torch's placeholder) when
            there was none.
        message: a one-line summary from the error file (``"<Type>: <msg>"``), else the last
            lines the worker wrote to stderr (up to 50, so a plain script's traceback shows),
            else how it exited (``"exited with code 3"``, ``"killed by SIGKILL (signal 9)"``).
            An error file that exists but cannot be used gives
            ``"error file unreadable: <why>"`` (followed by the stderr tail, if any).
        timestamp: when it failed, float seconds since the epoch (sub-second resolution).
        error_file_data: the parsed error file, ``{}`` when there is none.
        host: the host the worker ran on, when that is not the host reporting it (a
            failure on another node, told through the rendezvous); ``""`` otherwise.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str = ""
    timestamp: float = 0.0
    error_file_data: dict[str, Any] = field(default_factory=dict)
    host: str = ""

    def __post_init__(self) -> None:
        if self.message or self.timestamp or self.error_file_data:
            return  # built field by field: nothing to read
        try:
            described = _describe(
                exitcode=self.exitcode,
                error_file=self.error_file,
                fallback_time=time.time(),
                stderr_tail=(),
                file_seconds=True,
            )
        except Exception as e:
            described = (self.error_file, _unexpected(e), time.time(), {})
        self.error_file, self.message, self.timestamp, self.error_file_data = described

    @classmethod
    def from_exit(
        cls,
        *,
        local_rank: int,
        pid: int,
        exitcode: int,
        error_file: str,
        exit_time: float,
        stderr_tail: Sequence[str] = (),
    ) -> ProcessFailure:
        """Describe a worker that has exited, reading its error file if it wrote one.

        Never raises, whatever the file holds, and blocks only on a local regular file:
        only a regular file is read (not a FIFO, a device, a socket, or a symbolic link
        leading out of its directory), at most 1 MiB of it (a longer file is cut, its
        first ``"message"`` kept with a note), and parsed as JSON only. Timestamps that
        are negative, NaN, infinite or beyond year 9999 are ignored.

        Args:
            local_rank: the worker's local rank.
            pid: its process id.
            exitcode: its exit status (negative: killed by that signal).
            error_file: the path of its error file, which may not exist.
            exit_time: when the supervisor saw it exit (``time.time()``); the timestamp when
                the error file carries no valid ``timestamp_ns`` (torch's files carry whole
                seconds only).
            stderr_tail: the last lines it wrote to stderr; only the last 50 are kept.

        Returns:
            The failure, with ``message`` taken from the error file, else
            ``"error file unreadable: <why>"`` when it exists but cannot be used, else the
            stderr tail, else a description of the exit status.
        """
        try:
            described = _describe(
                exitcode=exitcode,
                error_file=error_file,
                fallback_time=exit_time,
                stderr_tail=stderr_tail,
                file_seconds=False,
            )
        except Exception as e:
            described = (error_file, _unexpected(e), exit_time, {})
        path, message, timestamp, data = described
        return cls(
            local_rank=local_rank,
            pid=pid,
            exitcode=exitcode,
            error_file=path,
            message=message,
            timestamp=timestamp,
            error_file_data=data,
        )

    def signal_name(self) -> str:
        """The name of the signal that killed the worker (``"SIGKILL"``), else ``"<N/A>"``."""
        name = signal_name(-self.exitcode) if self.exitcode < 0 else None
        return name or NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as local time in ISO 8601 with microseconds and UTC offset.

        A timestamp no date can show (set by hand: NaN, negative, past year 9999) gives
        ``"<invalid timestamp ...>"`` instead of raising, so a report always renders.
        """
        # Imported here: a start never renders a report, and it is the only use.
        from datetime import datetime

        try:
            when = datetime.fromtimestamp(self.timestamp).astimezone()
            return when.isoformat(timespec="microseconds")
        except (OverflowError, ValueError, OSError, TypeError):
            return f"<invalid timestamp {self.timestamp!r}>"


def _unexpected(error: BaseException) -> str:
    return f"error file unreadable: {type(error).__name__}: {safe_str(error)}"


_WIDTH_LIMIT = 60


@functools.lru_cache(maxsize=1)
def _hostname() -> str:
    # getfqdn() can block on DNS; resolve once per process, and only when a report is made.
    return socket.getfqdn()


class ChildFailedError(Exception):
    """One or more workers of a group failed.

    ``str(exc)`` is `format_msg`: a report led by the root cause (the earliest failure).
    It pickles, so it can cross processes.

    Args:
        name: the group's name (the entrypoint or role).
        failures: ``{rank: ProcessFailure}``, keyed by local rank from `start_processes`
            and by global rank from the elastic agent.

    Raises:
        ValueError: ``failures`` is empty.
    """

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError(
                f"ChildFailedError({name!r}) needs at least one failure, got {failures!r}"
            )
        # args carries exactly what __init__ takes, so the default exception pickling
        # (cls(*args) then __dict__ update) round-trips it.
        super().__init__(name, failures)
        self.name = name
        self.failures = failures
        self._host: str | None = None

    @property
    def host(self) -> str:
        """The host the failures happened on (fully qualified); kept through pickling."""
        if self._host is None:
            self._host = _hostname()
        return self._host

    def __reduce__(self) -> tuple[Any, ...]:
        # Resolve the host before pickling so a report rebuilt elsewhere names the host
        # the workers ran on, not the one that unpickled it.
        state = dict(self.__dict__, _host=self.host)
        return (type(self), (self.name, self.failures), state)

    def __str__(self) -> str:
        return self.format_msg()

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: the failure with the earliest timestamp (ties: lowest rank).

        Returns:
            ``(rank, failure)``.
        """
        rank = min(self.failures, key=lambda r: (self.failures[r].timestamp, r))
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """A readable report of every failure, the root cause last and marked as such.

        Same layout as torch's: a title, a ``Failures:`` section with the other failures
        in the order they happened (or ``<NO_OTHER_FAILURES>``), and a ``Root Cause (first
        observed failure):`` section, each failure with its time, host, rank and local
        rank, exit code, pid, signal name, error file and traceback.

        Args:
            boarder_delim: the character of the outer rules (torch's spelling kept).
            section_delim: the character of the rules between sections.

        Returns:
            The report, starting and ending with a newline like torch's.
        """
        title = f"{self.name} FAILED"
        root_rank, root = self.get_first_failure()
        others = sorted(
            (item for item in self.failures.items() if item[0] != root_rank),
            key=lambda item: (item[1].timestamp, item[0]),
        )
        root_block = self._format_failure(0, root_rank, root)
        other_blocks = [
            self._format_failure(idx, rank, failure)
            for idx, (rank, failure) in enumerate(others, start=1)
        ]
        width = max(
            len(line) for block in [title, root_block, *other_blocks] for line in block.split("\n")
        )
        width = min(width, _WIDTH_LIMIT)
        border = boarder_delim * width
        section = section_delim * width
        return "\n".join(
            [
                "",
                border,
                title,
                section,
                "Failures:",
                "\n".join(other_blocks) if other_blocks else "  <NO_OTHER_FAILURES>",
                section,
                "Root Cause (first observed failure):",
                root_block,
                border,
            ]
        )

    def _format_failure(self, idx: int, rank: int, failure: ProcessFailure) -> str:
        signal_name = failure.signal_name()
        signal_part = f" ({signal_name})" if signal_name != NOT_AVAILABLE else ""
        trace = failure_traceback(failure).rstrip("\n").replace("\n", "\n  ")
        return "\n".join(
            [
                f"[{idx}]:",
                f"  time      : {failure.timestamp_isoformat()}",
                f"  host      : {failure.host or self.host}",
                f"  rank      : {rank} (local_rank: {failure.local_rank})"
                if rank >= 0
                else "  rank      : none (a node's end, not a worker's: see traceback)",
                f"  exitcode  : {failure.exitcode} (pid: {failure.pid}){signal_part}"
                if failure.pid >= 0
                else "  exitcode  : none (no process)",
                f"  error_file: {failure.error_file}",
                f"  traceback : {trace}",
            ]
        )
