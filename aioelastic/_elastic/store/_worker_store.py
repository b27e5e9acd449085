"""The store the workers of one rendezvous round use for their process group.

Two ways to give workers a store at ``MASTER_ADDR:MASTER_PORT``: a port found free for
worker 0 to bind (`free_port`, one node without an agent store), or a TCPStore the agent
of node rank 0 hosts afresh every round (`WorkerStoreHost`, torch's shared agent store).
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["Store", "WorkerStoreHost", "free_port"]

Store = Any
"""A ``torch.distributed.Store``; typed loosely so that type checking needs no torch stubs."""

# Ours: where node rank 0 publishes the worker store it hosts for the round.
_WORKER_STORE_KEY = "aioelastic/worker_store"


def free_port() -> int:
    """A TCP port free on every address of this host right now (nothing holds it after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WorkerStoreHost:
    """A new store for each round's workers, hosted by node rank 0.

    Works around two bugs of torch 2.13's dynamic rendezvous with a shared agent store
    (``TORCHELASTIC_USE_AGENT_STORE=True``):

    * its rank 0 keeps one worker store for the whole job, so restarted workers find
      the keys of the workers before them (gloo then connects to dead addresses and
      fails in ``connectFullMesh``; torchrun's own restarts hit this). torch's worker
      side expects a new store per attempt (``torch.distributed.rendezvous``: "We
      create a new TCPStore for every retry");
    * its rank 0 publishes ``MASTER_ADDR``/``MASTER_PORT`` in a round's store only the
      first time it hosts the store, so a node joining a later round (a scale-up, a
      replacement) blocks in ``next_rendezvous`` until its store read times out.

    So node rank 0 hosts a fresh TCPStore every round and publishes it under a key of
    ours; the other nodes read it from the round's store. Rank 0 also fills in torch's keys
    where torch left them out, which is what unblocks a late joiner.

    Args:
        local_addr: this node's address as peers see it (default: its FQDN).
    """

    def __init__(self, local_addr: str | None = None) -> None:
        self._local_addr = local_addr
        self._server: Store | None = None

    def next_round(
        self, store: Store, group_rank: int, addr: str | None, port: int | None
    ) -> tuple[str, int]:
        """The address of this round's worker store; node rank 0 starts it first.

        Blocks (store round trips, a getfqdn): call it on the handler's thread, right after
        ``next_rendezvous``.

        Args:
            store: the round's store.
            group_rank: this node's rank in the round.
            addr: the workers' store address torch's handler reported, if any.
            port: its port, if any.
        """
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous import RendezvousStoreInfo

        if group_rank != 0:
            addr, port = json.loads(store.get(_WORKER_STORE_KEY))
            return str(addr), int(port)
        own_addr = self._local_addr or socket.getfqdn()
        # torch re-exports TCPStore from torch._C without listing it for type checkers.
        server = dist.TCPStore(  # type: ignore[attr-defined]
            host_name=own_addr, port=0, is_master=True, multi_tenant=True, wait_for_workers=False
        )
        # The previous round's store goes only now: its workers are stopped, and the new
        # one has a different port, so no late client of the old one can reach the new.
        self._server = server
        torch_keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
        if not store.check(torch_keys):
            store.set(torch_keys[0], (addr or own_addr).encode("UTF-8"))
            store.set(torch_keys[1], str(port or server.port).encode("UTF-8"))
        store.set(_WORKER_STORE_KEY, json.dumps([own_addr, server.port]))
        return own_addr, int(server.port)

    def close(self) -> None:
        """Drop the store this node hosts, if any (its sockets close with it)."""
        self._server = None
