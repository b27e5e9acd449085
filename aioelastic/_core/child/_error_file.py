"""The error file: torch's format, read defensively, written atomically.

The format is torch's (``torch.distributed.elastic.multiprocessing.errors``), so a file
written by either side is read by the other::

    {"message": {"message": "<Type>: <msg>",
                 "extraInfo": {"py_callstack": "<traceback>",
                               "timestamp": "<int epoch seconds>",
                               "timestamp_ns": "<int epoch nanoseconds>"}}}

``timestamp`` stays an int in seconds because torch's reader does ``int(...)`` on it;
``timestamp_ns`` is ours and lets the supervisor order failures within the same second.
:func:`error_file_payload` is the one builder of that shape, :func:`usable_seconds` the
one check of a timestamp. This module must not import torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ERROR_FILE_CAP",
    "ERROR_FILE_ENV",
    "NOT_AVAILABLE",
    "ErrorFileContents",
    "error_file_payload",
    "load_error_file",
    "message_and_times",
    "read_error_file",
    "report_write_failure",
    "safe_str",
    "usable_seconds",
    "write_error_data",
    "write_error_file",
]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""The environment variable naming a worker's error file (torch's name)."""

NOT_AVAILABLE = "<N/A>"
"""Placeholder torch uses for a missing error file or signal name."""


def error_file_payload(
    message: str, callstack: str, time_ns: int, *, error_code: int | None = None
) -> dict[str, Any]:
    """The contents of an error file, in torch's shape (see the module's docstring).

    Args:
        message: the one-line summary (``"<Type>: <msg>"``).
        callstack: the traceback text (``py_callstack``).
        time_ns: when it failed, in nanoseconds since the epoch.
        error_code: the exit code to record (``errorCode``), when known.
    """
    info: dict[str, Any] = {
        "message": message,
        "extraInfo": {
            "py_callstack": callstack,
            "timestamp": str(time_ns // 1_000_000_000),
            "timestamp_ns": str(time_ns),
        },
    }
    if error_code is not None:
        info["errorCode"] = error_code
    return {"message": info}


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
            message = f"{type(exc).__name__}: {safe_str(exc)}"
        callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        write_error_data(path, error_file_payload(message, callstack, time.time_ns()))
    except Exception as e:
        report_write_failure(path, e)


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
        contents = load_error_file(os.fspath(path))
    except Exception:
        return None
    return contents.data if contents.problem is None else None


ERROR_FILE_CAP = 1 << 20
"""The most bytes read from an error file (1 MiB); the rest is cut with a note."""

MAX_TIMESTAMP = 253_402_300_799
"""9999-12-31T23:59:59Z, the last second `datetime` can show: later timestamps are invalid."""

_MESSAGE_TEXT = re.compile(rb'"message"\s*:\s*("(?:[^"\\]|\\.)*")')
"""The first complete ``"message": "<text>"`` pair: what is salvaged from a cut file."""


class _Unreadable(Exception):
    """Why an error file was not read (the text follows ``"error file unreadable: "``)."""


@dataclass(frozen=True)
class ErrorFileContents:
    """What reading an error file gave: the data, or why there is none."""

    data: dict[str, Any] | None = None
    """The parsed JSON object (None: no file, or `problem`)."""
    problem: str | None = None
    """``"error file unreadable: <why>"`` when the file exists but could not be used."""
    salvaged: str | None = None
    """The summary found in the first `ERROR_FILE_CAP` bytes of an oversized file."""


def load_error_file(path: str) -> ErrorFileContents:
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
        return ErrorFileContents(problem=f"error file unreadable: {e}")
    if fd is None:
        return ErrorFileContents()
    try:
        size = os.fstat(fd).st_size
        body = _read_capped(fd)
    except OSError as e:
        return ErrorFileContents(problem=f"error file unreadable: {_os_error_text(e)}")
    finally:
        os.close(fd)
    if len(body) > ERROR_FILE_CAP:
        size = max(size, len(body))
        over = f"it is {size} bytes, over the {ERROR_FILE_CAP}-byte (1 MiB) cap"
        salvaged = _salvage_message(body[:ERROR_FILE_CAP])
        if salvaged is None:
            return ErrorFileContents(
                problem=f"error file unreadable: {over}, and its first 1 MiB holds no message"
            )
        note = f"[error file cut: {over}; only its first 1 MiB was read]"
        return ErrorFileContents(salvaged=f"{salvaged}\n{note}")
    if not body.strip():
        return ErrorFileContents(problem="error file unreadable: it is empty")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        # ValueError covers bad JSON, bad UTF-8 and integers too long to convert.
        return ErrorFileContents(problem=f"error file unreadable: not valid JSON ({e})")
    if not isinstance(data, dict):
        kind = type(data).__name__
        return ErrorFileContents(
            problem=f"error file unreadable: it holds a JSON {kind}, not an object"
        )
    return ErrorFileContents(data=data)


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
    return f"{type(error).__name__}: {safe_str(error)}"


def write_error_data(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as the error file ``path``, atomically (a reader never sees half)."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    body = json.dumps(data).encode("utf-8")
    # An unnamed file (O_TMPFILE) gets its name only once complete: a worker killed while
    # writing it (the supervisor's SIGKILL after a grace period) leaves nothing behind.
    if _write_unnamed_then_link(directory, os.path.basename(path), body):
        return
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".error-", suffix=".json.tmp")
    with contextlib.ExitStack() as cleanup_on_fail:
        cleanup_on_fail.callback(_remove_quietly, tmp)
        # mkstemp creates the file 0600; torch's plain open() gives the usual 0644.
        os.fchmod(fd, 0o644)
        _write_all(fd, body)
        os.close(fd)
        os.replace(tmp, path)
        cleanup_on_fail.pop_all()


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


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


def report_write_failure(path: str | os.PathLike[str], error: BaseException) -> None:
    """Say on stderr that the error file ``path`` could not be written (never raises)."""
    # stderr itself may be closed in a dying worker; then there is nowhere left to report to.
    with contextlib.suppress(Exception):
        print(
            f"aioelastic: could not write error file {os.fspath(path)!r}: "
            f"{type(error).__name__}: {safe_str(error)}",
            file=sys.stderr,
            flush=True,
        )


def safe_str(obj: object) -> str:
    """``str(obj)``, or a placeholder when its ``__str__`` raises."""
    try:
        return str(obj)
    except Exception:
        return f"<unprintable {type(obj).__name__} object>"


def message_and_times(
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
        if not 0 < number <= MAX_TIMESTAMP * per_second:
            return None
        seconds = number / per_second
    else:
        return None
    return seconds if usable_seconds(seconds) else None


def usable_seconds(seconds: float) -> bool:
    """Whether ``seconds`` since the epoch is a time a report can show.

    Finite, after the epoch and no later than year 9999 (the last second ``datetime`` can
    show): a worker writes its error file, and a value out of that range must not break
    the report that reads it.
    """
    return math.isfinite(seconds) and 0 < seconds <= MAX_TIMESTAMP
