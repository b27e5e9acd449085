"""The fan-out of an agent's events: every subscriber's stream, and the launcher's log lines.

Apart from `._events` (what the events are) so that the narrator, which formats events,
and the hub, which feeds it, both depend on the events and not on each other.
"""

from __future__ import annotations

import math

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from ._events import AgentEvent, EventStream
from ._narrate import Narrator

__all__ = ["EventHub"]


class EventHub:
    """Fans an agent's events out to its subscribers; logs each one."""

    def __init__(self) -> None:
        self._subscribers: list[MemoryObjectSendStream[AgentEvent]] = []
        self._closed = False
        self._narrate = Narrator()

    def subscribe(self) -> EventStream:
        send, receive = anyio.create_memory_object_stream[AgentEvent](math.inf)
        if self._closed:
            send.close()
        else:
            self._subscribers.append(send)
        return EventStream(receive)

    def emit(self, event: AgentEvent) -> None:
        self._narrate(event)
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The subscriber went away; stop feeding it.
                self._subscribers.remove(send)
                send.close()

    def close(self) -> None:
        """End every subscriber's iteration (after what is buffered)."""
        self._closed = True
        for send in self._subscribers:
            send.close()
        self._subscribers.clear()
