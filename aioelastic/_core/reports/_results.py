"""The outcome of running a group of workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._failures import ProcessFailure

__all__ = ["RunProcsResult"]


@dataclass
class RunProcsResult:
    """What `PContext.wait` returns once every worker succeeded or one failed.

    Every dict is keyed by local rank.

    Attributes:
        return_values: each function worker's return value (``None`` for binaries); filled
            only when every worker succeeded.
        failures: only the workers that failed by themselves; siblings the supervisor
            stopped because another worker failed are not failures.
        stdouts: the path of each worker's stdout log file, ``""`` when its stdout was not
            redirected.
        stderrs: the path of each worker's stderr log file, ``""`` when its stderr was not
            redirected.
        stopped: the group was stopped (``close()``, a signal) before every worker
            succeeded and none failed by itself — a ``wait()`` that lost the race against
            ``close()``. Then ``return_values`` is empty and :meth:`is_failed` is true:
            the run did not complete.
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    stopped: bool = False

    def is_failed(self) -> bool:
        """Whether the run did not complete: a worker failed, or the group was stopped."""
        return bool(self.failures) or self.stopped
