"""Worker failures: torch-compatible error files, `ProcessFailure`, `ChildFailedError`, `record`.

The error file format is torch's (``torch.distributed.elastic.multiprocessing.errors``), so a
file written by either side is read by the other::

    {"message": {"message": "<Type>: <msg>",
                 "extraInfo": {"py_callstack": "<traceback>",
                               "timestamp": "<int epoch seconds>",
                               "timestamp_ns": "<int epoch nanoseconds>"}}}

``timestamp`` stays an int in seconds because torch's reader does ``int(...)`` on it;
``timestamp_ns`` is ours and lets the supervisor order failures within the same second.
This module must not import torch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

__all__ = [
    "ChildFailedError",
    "ProcessFailure",
    "read_error_file",
    "record",
    "write_error_file",
]

logger = logging.getLogger("aioelastic.errors")

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""The environment variable naming a worker's error file (torch's name)."""

NOT_AVAILABLE = "<N/A>"
"""Placeholder torch uses for a missing error file or signal name."""

STDERR_TAIL_LINES = 50
"""How many trailing stderr lines a failure without an error file keeps as its message."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def write_error_file(
    path: str | os.PathLike[str], exc: BaseException, *, message: str | None = None
) -> None:
    """Record ``exc`` in ``path`` in torch's error file format.

    Called from a dying worker, so it never raises: if the file cannot be written it prints
    one line to stderr instead. The file is written to a temporary name in the same
    directory and renamed into place, so a reader never sees half a file; a missing parent
    directory is created.

    Args:
        path: the error file (usually ``os.environ["TORCHELASTIC_ERROR_FILE"]``).
        exc: the exception; its traceback (with chained exceptions) becomes ``py_callstack``.
        message: replaces the default ``"<Type>: <msg>"`` summary.
    """
    try:
        if message is None:
            message = f"{type(exc).__name__}: {_safe_str(exc)}"
        callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        now_ns = time.time_ns()
        data = {
            "message": {
                "message": message,
                "extraInfo": {
                    "py_callstack": callstack,
                    "timestamp": str(now_ns // 1_000_000_000),
                    "timestamp_ns": str(now_ns),
                },
            }
        }
        _write_json_atomic(path, data)
    except Exception as e:
        _report_write_failure(path, e)


def read_error_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read an error file written by `write_error_file` or by torch.

    Args:
        path: the error file.

    Returns:
        The parsed JSON object, or None when the file is missing, empty, unreadable, not
        JSON, or not a JSON object. Never raises.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except Exception:
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    body = json.dumps(data).encode("utf-8")
    # An unnamed file (O_TMPFILE) gets its name only once complete: a worker killed while
    # writing it (the supervisor's SIGKILL after a grace period) leaves nothing behind.
    if _write_unnamed_then_link(directory, os.path.basename(path), body):
        return
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".error-", suffix=".json.tmp")
    try:
        # mkstemp creates the file 0600; torch's plain open() gives the usual 0644.
        os.fchmod(fd, 0o644)
        _write_all(fd, body)
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_unnamed_then_link(directory: str, name: str, body: bytes) -> bool:
    """Write ``body`` to an unnamed file in ``directory``, then name it; ``False`` if not done.

    Not done where ``O_TMPFILE`` is missing (platform, filesystem) or ``name`` exists.
    """
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        except (AttributeError, OSError):
            return False
        try:
            _write_all(fd, body)
            # A dir_fd makes os.link use linkat(AT_SYMLINK_FOLLOW), which names the open
            # file itself rather than the /proc symlink.
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
        except FileExistsError:
            return False  # an earlier error file: replaced by the caller, as torch does
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _report_write_failure(path: str | os.PathLike[str], error: BaseException) -> None:
    # stderr itself may be closed in a dying worker; then there is nowhere left to report to.
    with contextlib.suppress(Exception):
        print(
            f"aioelastic: could not write error file {os.fspath(path)!r}: "
            f"{type(error).__name__}: {_safe_str(error)}",
            file=sys.stderr,
            flush=True,
        )


def _safe_str(obj: object) -> str:
    try:
        return str(obj)
    except Exception:
        return f"<unprintable {type(obj).__name__} object>"


def _exit_description(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            return f"killed by signal {-exitcode}"
        return f"killed by {name} (signal {-exitcode})"
    return f"exited with code {exitcode}"


def _message_and_timestamp(data: Mapping[str, Any]) -> tuple[str | None, float | None]:
    """The summary text and the sub-second timestamp of an error file, where present.

    torch's reader accepts two shapes: ``{"message": {"message": ..., "extraInfo": ...}}``
    (what ``record`` writes) and ``{"message": "<text>", "timestamp": ...}``.
    """
    raw = data.get("message")
    if isinstance(raw, str):
        return raw, _parse_ns(data.get("timestamp_ns"))
    if isinstance(raw, Mapping):
        text = raw.get("message")
        extra = raw.get("extraInfo")
        ns = _parse_ns(extra.get("timestamp_ns")) if isinstance(extra, Mapping) else None
        return (text if isinstance(text, str) else None), ns
    return None, None


def _parse_ns(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    try:
        return int(value) / 1e9
    except ValueError:
        return None


def _traceback_text(failure: ProcessFailure) -> str:
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

    Attributes:
        local_rank: the worker's local rank.
        pid: the worker's process id.
        exitcode: its exit status; negative means killed by signal ``-exitcode``.
        error_file: the error file it wrote, or ``"<N/A>"`` (torch's placeholder) when
            `from_exit` found none.
        message: a one-line summary from the error file (``"<Type>: <msg>"``), else the last
            lines the worker wrote to stderr (up to 50, so a plain script's traceback shows),
            else how it exited (``"exited with code 3"``, ``"killed by SIGKILL (signal 9)"``).
        timestamp: when it failed, float seconds since the epoch (sub-second resolution).
        error_file_data: the parsed error file, ``{}`` when there is none.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str = ""
    timestamp: float = 0.0
    error_file_data: dict[str, Any] = field(default_factory=dict)

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

        Args:
            local_rank: the worker's local rank.
            pid: its process id.
            exitcode: its exit status (negative: killed by that signal).
            error_file: the path of its error file, which may not exist.
            exit_time: when the supervisor saw it exit (``time.time()``); the timestamp when
                the error file carries no ``timestamp_ns`` (torch's files carry whole
                seconds only).
            stderr_tail: the last lines it wrote to stderr; only the last 50 are kept.

        Returns:
            The failure, with ``message`` taken from the error file, else the stderr tail,
            else a description of the exit status.
        """
        data = read_error_file(error_file)
        if data:
            text, ns = _message_and_timestamp(data)
            return cls(
                local_rank=local_rank,
                pid=pid,
                exitcode=exitcode,
                error_file=error_file,
                message=text or _exit_description(exitcode),
                timestamp=exit_time if ns is None else ns,
                error_file_data=data,
            )
        if isinstance(stderr_tail, str):
            stderr_tail = stderr_tail.splitlines()
        lines = [line.rstrip("\r\n") for line in stderr_tail][-STDERR_TAIL_LINES:]
        tail = "\n".join(lines).strip("\n")
        return cls(
            local_rank=local_rank,
            pid=pid,
            exitcode=exitcode,
            error_file=NOT_AVAILABLE,
            message=tail if tail.strip() else _exit_description(exitcode),
            timestamp=exit_time,
        )

    def signal_name(self) -> str:
        """The name of the signal that killed the worker (``"SIGKILL"``), else ``"<N/A>"``."""
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return NOT_AVAILABLE
        return NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as local time in ISO 8601 with microseconds and UTC offset."""
        return (
            datetime.fromtimestamp(self.timestamp).astimezone().isoformat(timespec="microseconds")
        )


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
        trace = _traceback_text(failure).rstrip("\n").replace("\n", "\n  ")
        return "\n".join(
            [
                f"[{idx}]:",
                f"  time      : {failure.timestamp_isoformat()}",
                f"  host      : {self.host}",
                f"  rank      : {rank} (local_rank: {failure.local_rank})",
                f"  exitcode  : {failure.exitcode} (pid: {failure.pid}){signal_part}",
                f"  error_file: {failure.error_file}",
                f"  traceback : {trace}",
            ]
        )


def record(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a worker's ``main`` so an uncaught exception is recorded in its error file.

    On an uncaught `Exception` the decorator writes the file named by
    ``TORCHELASTIC_ERROR_FILE`` (torch's format, see `write_error_file`) and re-raises.
    For a `ChildFailedError` (a launch nested in this worker failed) it records the nested
    root cause instead, so the outer report points at the real culprit. `SystemExit` and
    `KeyboardInterrupt` pass through unrecorded. Like torch's ``record`` it also enables
    `faulthandler` (unless already enabled), so a segfault's Python stack reaches stderr,
    whose last lines the supervisor reports.

    Args:
        fn: the function to wrap.

    Returns:
        The wrapped function, with ``fn``'s name, docstring and signature.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        _enable_faulthandler()
        try:
            return fn(*args, **kwargs)
        except ChildFailedError as e:
            _record_child_failure(e)
            raise
        except Exception as e:
            path = _error_file_or_warn(e)
            if path:
                write_error_file(path, e)
            raise

    return wrapper


def _enable_faulthandler() -> None:
    try:
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
    except Exception:
        # No usable stderr fd (e.g. replaced by an in-memory stream): nothing to dump to.
        pass


def _error_file_or_warn(exc: BaseException) -> str | None:
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        logger.warning(
            "%s is not set: the uncaught %s will not be recorded in an error file",
            ERROR_FILE_ENV,
            type(exc).__name__,
        )
        return None
    return path


def _record_child_failure(exc: ChildFailedError) -> None:
    path = _error_file_or_warn(exc)
    if not path:
        return
    try:
        _, root = exc.get_first_failure()
        data = _root_cause_data(root)
        _write_json_atomic(path, data)
    except Exception as e:
        _report_write_failure(path, e)


def _root_cause_data(root: ProcessFailure) -> dict[str, Any]:
    """The error file contents that carry a nested root cause up one level."""
    if root.error_file_data:
        data: dict[str, Any] = json.loads(json.dumps(root.error_file_data))  # deep copy
        message = data.get("message")
        if isinstance(message, dict) and root.exitcode:
            # As torch does: the child cannot know its own exit code when a signal killed it.
            message["errorCode"] = root.exitcode
        return data
    # No error file (a plain script, or a signal): torch records nothing here; we carry the
    # stderr tail or exit description so the outer report still shows the real cause.
    ns = int(root.timestamp * 1e9)
    return {
        "message": {
            "message": root.message.strip().rsplit("\n", 1)[-1] or NOT_AVAILABLE,
            "extraInfo": {
                "py_callstack": root.message,
                "timestamp": str(ns // 1_000_000_000),
                "timestamp_ns": str(ns),
            },
            "errorCode": root.exitcode,
        }
    }
