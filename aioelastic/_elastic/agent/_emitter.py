"""How the agent's lifecycle events leave it: to its subscribers and into its output timeline.

Every event carries the role, the run id, and the attempt and restart count of the moment
(read from the `RestartBudget`), so the code that emits one names only what is its own.
"""

from __future__ import annotations

import time
from typing import Any

from ..._core.output._stream import OutputHub
from ..._core.reports._failures import ProcessFailure
from ..observe._event_hub import EventHub
from ..observe._events import AgentEvent, WorkerFailed
from ._budget import RestartBudget

__all__ = ["Emitter"]


class Emitter:
    """Makes and publishes the agent's events (`aioelastic._elastic.observe._events`).

    Args:
        hub: the events' subscribers (``agent.events()``).
        output: the output timeline (``agent.timeline()``), which shows events too.
        role: the workers' role.
        budget: where the attempt number and restart count are read, event by event.
    """

    def __init__(self, hub: EventHub, output: OutputHub, role: str, budget: RestartBudget) -> None:
        self._hub = hub
        self._output = output
        self._role = role
        self._budget = budget
        #: The rendezvous run id, once the rendezvous is open.
        self.run_id = ""

    def emit(self, kind: type[AgentEvent], **fields: Any) -> None:
        """Publish a ``kind`` event that happens now, with these fields of its own."""
        self._publish(kind(timestamp=time.time(), **self._common(), **fields))

    def worker_failed(self, global_rank: int, local_rank: int, failure: ProcessFailure) -> None:
        """Publish `WorkerFailed` for ``failure``, at the time it happened."""
        signal_name = failure.signal_name() if failure.exitcode < 0 else None
        self._publish(
            WorkerFailed(
                timestamp=failure.timestamp,
                **self._common(),
                global_rank=global_rank,
                local_rank=local_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                signal=signal_name,
                message=failure.message,
                failure=failure,
            )
        )

    def _common(self) -> dict[str, Any]:
        return {
            "role": self._role,
            "run_id": self.run_id,
            "attempt": self._budget.attempt,
            "restart_count": self._budget.restart_count,
        }

    def _publish(self, event: AgentEvent) -> None:
        self._hub.emit(event)
        self._output.event(event)
