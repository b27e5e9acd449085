"""The worker side of failure reporting: `record`, which writes the error file.

A worker's ``main`` decorated with ``@record`` writes the file named by
``TORCHELASTIC_ERROR_FILE`` (:mod:`..child._error_file`) when it raises; a launch nested in a
worker hands its root cause up the same way (:func:`record_child_failure`).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from ..child._error_file import (
    ERROR_FILE_ENV,
    NOT_AVAILABLE,
    error_file_payload,
    report_write_failure,
    usable_seconds,
    write_error_data,
    write_error_file,
)
from ._failures import ChildFailedError, ProcessFailure

__all__ = ["record", "record_child_failure"]

logger = logging.getLogger("aioelastic.errors")

_P = ParamSpec("_P")
_R = TypeVar("_R")


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
            record_child_failure(e)
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


def record_child_failure(exc: ChildFailedError) -> None:
    """Write the root cause of ``exc`` (a nested launch's failure) as our error file.

    What ``@record`` does for a `ChildFailedError`, for a launcher that catches it itself
    (``aioelastic-run`` nested under another launcher). Never raises.
    """
    path = _error_file_or_warn(exc)
    if not path:
        return
    try:
        _, root = exc.get_first_failure()
        data = _root_cause_data(root)
        write_error_data(path, data)
    except Exception as e:
        report_write_failure(path, e)


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
    if not (isinstance(when, (int, float)) and usable_seconds(when)):
        when = time.time()  # set by hand to something no file should carry on
    return error_file_payload(
        root.message.strip().rsplit("\n", 1)[-1] or NOT_AVAILABLE,
        root.message,
        int(when * 1e9),
        error_code=root.exitcode,
    )
