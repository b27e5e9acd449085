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
import math
import os
import re
import signal
import socket
import stat
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

    The file is read as `ProcessFailure` reads it: only a regular file, never more than
    `ERROR_FILE_CAP` bytes, parsed as JSON and nothing else.

    Args:
        path: the error file.

    Returns:
        The parsed JSON object, or None when the file is missing, empty, unreadable, not
        a regular file, larger than the cap, not JSON, or not a JSON object. Never raises.
    """
    try:
        contents = _load_error_file(os.fspath(path))
    except Exception:
        return None
    return contents.data if contents.problem is None else None


ERROR_FILE_CAP = 1 << 20
"""The most bytes read from an error file (1 MiB); the rest is cut with a note."""

_MAX_TIMESTAMP = 253_402_300_799
"""9999-12-31T23:59:59Z, the last second `datetime` can show: later timestamps are invalid."""

_MESSAGE_TEXT = re.compile(rb'"message"\s*:\s*("(?:[^"\\]|\\.)*")')
"""The first complete ``"message": "<text>"`` pair: what is salvaged from a cut file."""


class _Unreadable(Exception):
    """Why an error file was not read (the text follows ``"error file unreadable: "``)."""


@dataclass(frozen=True)
class _ErrorFileContents:
    """What reading an error file gave: the data, or why there is none."""

    data: dict[str, Any] | None = None
    """The parsed JSON object (None: no file, or `problem`)."""
    problem: str | None = None
    """``"error file unreadable: <why>"`` when the file exists but could not be used."""
    salvaged: str | None = None
    """The summary found in the first `ERROR_FILE_CAP` bytes of an oversized file."""


def _load_error_file(path: str) -> _ErrorFileContents:
    """Read the error file at ``path`` defensively; raises nothing but unexpected bugs.

    A worker (or anything running as its user) controls this file, and the supervisor
    reads it. A FIFO would block the read forever, a device such as ``/dev/zero`` would
    never end, and a huge file would stall the event loop and bloat the supervisor: so
    only a regular file is opened (``O_NONBLOCK`` so that even a FIFO swapped in between
    the check and the open cannot block), and at most `ERROR_FILE_CAP` bytes are read.
    """
    try:
        fd = _open_regular(path)
    except _Unreadable as e:
        return _ErrorFileContents(problem=f"error file unreadable: {e}")
    if fd is None:
        return _ErrorFileContents()
    try:
        size = os.fstat(fd).st_size
        body = _read_capped(fd)
    except OSError as e:
        return _ErrorFileContents(problem=f"error file unreadable: {_os_error_text(e)}")
    finally:
        os.close(fd)
    if len(body) > ERROR_FILE_CAP:
        size = max(size, len(body))
        over = f"it is {size} bytes, over the {ERROR_FILE_CAP}-byte (1 MiB) cap"
        salvaged = _salvage_message(body[:ERROR_FILE_CAP])
        if salvaged is None:
            return _ErrorFileContents(
                problem=f"error file unreadable: {over}, and its first 1 MiB holds no message"
            )
        note = f"[error file cut: {over}; only its first 1 MiB was read]"
        return _ErrorFileContents(salvaged=f"{salvaged}\n{note}")
    if not body.strip():
        return _ErrorFileContents(problem="error file unreadable: it is empty")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        # ValueError covers bad JSON, bad UTF-8 and integers too long to convert.
        return _ErrorFileContents(problem=f"error file unreadable: not valid JSON ({e})")
    if not isinstance(data, dict):
        kind = type(data).__name__
        return _ErrorFileContents(
            problem=f"error file unreadable: it holds a JSON {kind}, not an object"
        )
    return _ErrorFileContents(data=data)


def _open_regular(path: str) -> int | None:
    """Open ``path`` for reading if it is a regular file; None if it does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise _Unreadable(f"cannot look at it: {_os_error_text(e)}") from e
    target = path
    if stat.S_ISLNK(st.st_mode):
        target = _resolve_inside(path)
        try:
            st = os.lstat(target)
        except OSError as e:
            raise _Unreadable(f"its symbolic link target: {_os_error_text(e)}") from e
    if not stat.S_ISREG(st.st_mode):
        raise _Unreadable(f"it is {_file_kind(st.st_mode)}, not a regular file")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(target, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _Unreadable(_os_error_text(e)) from e
    # Checked again on the open file: the name may have been swapped since the lstat.
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _Unreadable(f"it is {_file_kind(mode)}, not a regular file")
    return fd


def _resolve_inside(path: str) -> str:
    """The target of the symbolic link ``path``, if it stays inside the link's directory."""
    directory = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    target = os.path.realpath(path)
    if os.path.commonpath([directory, target]) != directory:
        raise _Unreadable(
            f"it is a symbolic link to {target!r}, outside its directory {directory!r}"
        )
    return target


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
    ]
    return next((name for test, name in kinds if test(mode)), f"of file mode {mode:o}")


def _read_capped(fd: int) -> bytes:
    """At most ``ERROR_FILE_CAP + 1`` bytes of ``fd`` (one more tells that it was cut)."""
    chunks: list[bytes] = []
    left = ERROR_FILE_CAP + 1
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _salvage_message(prefix: bytes) -> str | None:
    """The first ``"message"`` text found in the start of a cut error file."""
    match = _MESSAGE_TEXT.search(prefix)
    if match is None:
        return None
    try:
        text = json.loads(match.group(1))
    except ValueError:
        return None
    return text if isinstance(text, str) and text.strip() else None


def _os_error_text(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{type(error).__name__}: {error.strerror}"
    return f"{type(error).__name__}: {_safe_str(error)}"


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


def _message_and_times(
    data: Mapping[str, Any],
) -> tuple[str | None, float | None, float | None]:
    """The summary text of an error file and its two timestamps (ns and s), where valid.

    torch's reader accepts two shapes: ``{"message": {"message": ..., "extraInfo": ...}}``
    (what ``record`` writes) and ``{"message": "<text>", "timestamp": ...}``.
    """
    raw = data.get("message")
    if isinstance(raw, str):
        return (
            raw,
            _parse_time(data.get("timestamp_ns"), 10**9),
            _parse_time(data.get("timestamp"), 1),
        )
    if isinstance(raw, Mapping):
        text = raw.get("message")
        extra = raw.get("extraInfo")
        if not isinstance(extra, Mapping):
            extra = {}
        return (
            text if isinstance(text, str) else None,
            _parse_time(extra.get("timestamp_ns"), 10**9),
            _parse_time(extra.get("timestamp"), 1),
        )
    return None, None, None


def _parse_time(value: object, per_second: int) -> float | None:
    """A timestamp field (number or digits) in seconds; None unless `datetime` can show it.

    The file is the worker's to write: ``"9" * 400`` must not raise OverflowError and
    ``"9" * 25`` (year 300 million) must not break the report, so out-of-range, negative,
    NaN and infinite values are treated as absent.
    """
    if isinstance(value, bool):
        return None
    seconds: float
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        seconds = value / per_second
    elif isinstance(value, (int, str)):
        # Anything longer is out of range anyway; int() of thousands of digits is slow.
        if isinstance(value, str) and len(value) > 32:
            return None
        try:
            number = int(value)
        except ValueError:
            return None
        if not 0 < number <= _MAX_TIMESTAMP * per_second:
            return None
        seconds = number / per_second
    else:
        return None
    return seconds if 0 < seconds <= _MAX_TIMESTAMP else None


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
        contents = _load_error_file(error_file)
    except Exception as e:  # a bug here must not cost the report of the worker's exit
        contents = _ErrorFileContents(
            problem=f"error file unreadable: {type(e).__name__}: {_safe_str(e)}"
        )
    tail = _tail_text(stderr_tail)
    if contents.data is not None:
        text, ns, seconds = _message_and_times(contents.data)
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
    return NOT_AVAILABLE, tail or _exit_description(exitcode), fallback_time, {}


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
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return NOT_AVAILABLE
        return NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as local time in ISO 8601 with microseconds and UTC offset.

        A timestamp no date can show (set by hand: NaN, negative, past year 9999) gives
        ``"<invalid timestamp ...>"`` instead of raising, so a report always renders.
        """
        try:
            when = datetime.fromtimestamp(self.timestamp).astimezone()
            return when.isoformat(timespec="microseconds")
        except (OverflowError, ValueError, OSError, TypeError):
            return f"<invalid timestamp {self.timestamp!r}>"


def _unexpected(error: BaseException) -> str:
    return f"error file unreadable: {type(error).__name__}: {_safe_str(error)}"


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
                f"  host      : {failure.host or self.host}",
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
    when = root.timestamp
    if not (isinstance(when, (int, float)) and math.isfinite(when) and 0 < when <= _MAX_TIMESTAMP):
        when = time.time()  # set by hand to something no file should carry on
    ns = int(when * 1e9)
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
