"""The outcome of running a group of workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._errors import ProcessFailure

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
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        """Whether any worker failed."""
        return bool(self.failures)
