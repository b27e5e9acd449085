"""The module path the error types were defined in until they got modules of their own.

A pickle names a class by its module path: a `ProcessFailure` or `ChildFailedError`
pickled by an earlier version names ``aioelastic._core._errors`` (this module's path before
``_core`` had rooms, which still imports: see ``aioelastic._compat._old_paths``), so this
module keeps answering for them. New code imports from the modules that define them:
:mod:`..child._error_file` (the error file), :mod:`._failures` (the failure report) and
:mod:`._record` (the worker-side decorator).
"""

from __future__ import annotations

from ..child._error_file import (
    ERROR_FILE_CAP,
    ERROR_FILE_ENV,
    NOT_AVAILABLE,
    read_error_file,
    write_error_file,
)
from ._failures import STDERR_TAIL_LINES, ChildFailedError, ProcessFailure
from ._record import record

__all__ = [
    "ERROR_FILE_CAP",
    "ERROR_FILE_ENV",
    "NOT_AVAILABLE",
    "STDERR_TAIL_LINES",
    "ChildFailedError",
    "ProcessFailure",
    "read_error_file",
    "record",
    "write_error_file",
]
