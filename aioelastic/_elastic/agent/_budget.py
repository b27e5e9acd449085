"""The restart budget, and where a restart is decided.

After an attempt whose workers failed (here or on another node), `RestartBudget.decide`
says whether the job restarts or ends, and why; `RestartBudget.restart` then spends a
restart (a membership change spends none) and numbers the next attempt. The three counters
live in this one record and change nowhere else:

* ``remaining``: failure restarts still allowed (``max_restarts`` at first);
* ``restart_count``: failure restarts so far, the workers' ``TORCHELASTIC_RESTART_COUNT``.
  On several nodes the job's count, read from the rendezvous (`agree`), so that a node that
  keeps failing cannot give the job more attempts than ``max_restarts`` (torch counts per
  node);
* ``attempt``: the attempt's number, +1 for every new group of workers, membership changes
  included (logs go to ``attempt_{attempt}``).

Every node decides alike: the job's restart count is the same on all of them, and an end
that is final anywhere (an exit code never retried, the store lost) is final everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._core.reports._failures import ProcessFailure
from ..channel._attempt_end import AttemptEnd
from ..observe._events import EndReason, FailureReason, StopReason
from ._types import RestartBackoff

__all__ = ["GiveUp", "RestartBudget"]


@dataclass(frozen=True)
class GiveUp:
    """The run ends in failure instead of restarting.

    Attributes:
        reason: why (`RunFailed.reason`).
        detail: what to say about it.
    """

    reason: FailureReason
    detail: str


@dataclass
class RestartBudget:
    """The agent's restarts: how many are left, how many were used, and the attempt number.

    Attributes:
        max_restarts: the spec's ``max_restarts``.
        remaining: failure restarts still allowed.
        restart_count: failure restarts so far (``TORCHELASTIC_RESTART_COUNT``).
        attempt: the number of the attempt running now (0 first).
    """

    max_restarts: int
    remaining: int
    restart_count: int = 0
    attempt: int = 0

    @classmethod
    def of(cls, max_restarts: int) -> RestartBudget:
        """A run's budget before its first attempt."""
        return cls(max_restarts=max_restarts, remaining=max_restarts)

    @property
    def exhausted(self) -> bool:
        """No failure restart is left."""
        return self.remaining == 0

    def agree(self, job_restart_count: int | None) -> None:
        """Take the job's restart count from a completed rendezvous (None: count here)."""
        if job_restart_count is None:
            return
        self.restart_count = job_restart_count
        self.remaining = max(0, self.max_restarts - job_restart_count)

    def decide(
        self, fatal: ProcessFailure | None, cause: AttemptEnd | None, elsewhere: bool
    ) -> GiveUp | None:
        """After a failed attempt: None to restart, else why the run ends.

        Args:
            fatal: a local worker's failure whose exit code is never retried, if any.
            cause: the attempt's root cause across the job, if the nodes share one.
            elsewhere: ``cause`` is another node's end (or not a worker failure).
        """
        if fatal is None and not (cause is not None and cause.final) and not self.exhausted:
            return None
        if fatal is not None:
            return GiveUp(
                FailureReason.NO_RETRY_EXIT_CODE,
                f"exit code {fatal.exitcode} is in no_retry_exit_codes",
            )
        if cause is not None and cause.reason is EndReason.STORE_LOST:
            return GiveUp(cause.reason.failure_reason, cause.describe())
        if self.exhausted:
            detail = f"max_restarts={self.max_restarts} used up"
            if cause is not None and elsewhere:
                detail += f"; last: {cause.describe()}"
            return GiveUp(FailureReason.RESTARTS_EXHAUSTED, detail)
        assert cause is not None
        return GiveUp(cause.reason.failure_reason, cause.describe())

    def restart(self, reason: StopReason, backoff: RestartBackoff | None) -> float:
        """Start the next attempt after one that stopped for ``reason``; the delay before.

        A membership change spends no restart and waits for nothing (peers are waiting);
        any other reason spends one, with ``backoff``'s delay.
        """
        delay = 0.0
        if reason is not StopReason.MEMBERSHIP_CHANGE:
            self.remaining -= 1
            self.restart_count += 1
            if backoff is not None:
                delay = backoff.delay(self.restart_count)
        self.attempt += 1
        return delay
