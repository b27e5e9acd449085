"""Rendezvous names at the module path that launcher code imports them from.

The rendezvous is four modules: `._rdzv_handlers` (creating torch's handlers),
`._rdzv_node` (one node's side of a round: `Rendezvous`, `LocalRendezvous`, rank
assignment, the exit barrier), `._rdzv_store` (the workers' store) and `._rdzv_thread`
(blocking calls awaited on a daemon thread).
"""

from __future__ import annotations

from ._rdzv_handlers import create_rdzv_handler, standalone_handler
from ._rdzv_node import (
    CLOSE_TIMEOUT,
    LocalRendezvous,
    NodeRendezvous,
    Rendezvous,
    RendezvousOutcome,
)
from ._rdzv_store import Store

__all__ = [
    "CLOSE_TIMEOUT",
    "LocalRendezvous",
    "NodeRendezvous",
    "Rendezvous",
    "RendezvousOutcome",
    "Store",
    "create_rdzv_handler",
    "standalone_handler",
]
