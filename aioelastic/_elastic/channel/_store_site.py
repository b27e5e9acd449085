"""Which store the channel's keys live in, as a report of its loss names it (`StoreSite`).

A lost store is told differently by backend, because the remedy differs: ``c10d``'s (and
``static``'s) TCPStore lives in one node's launcher, a single point of failure that
``etcd-v2`` does not have; an etcd cluster is lost only when it has no quorum or cannot be
reached, which its members' health tells.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StoreSite"]

_ETCD = ("etcd", "etcd-v2")


@dataclass(frozen=True)
class StoreSite:
    """The rendezvous store of a round, as reports name it.

    Attributes:
        backend: the rendezvous backend (``c10d``, ``etcd-v2``, ...).
        address: ``host:port`` of the store (a TCPStore, or the etcd member the node
            talks to), None when the handler does not say.
    """

    backend: str = "c10d"
    address: str | None = None

    @property
    def replicated(self) -> bool:
        """Whether the store is an etcd cluster (it outlives any one of its members)."""
        return self.backend in _ETCD

    def name(self) -> str:
        """``"the c10d store at 10.0.0.1:29400"``, ``"the etcd-v2 store (the etcd cluster
        at 10.0.0.9:2379)"``."""
        at = f" at {self.address}" if self.address else ""
        if self.replicated:
            return f"the {self.backend} store (the etcd cluster{at})"
        return f"the {self.backend} store{at}"

    def failure(self, error: BaseException, waited: float) -> str:
        """How a call that raised ``error`` after ``waited`` seconds is told: ``"the c10d
        store at 10.0.0.1:29400 gave no answer in 2 s"``, ``"the c10d store at ... failed
        (DistNetworkError: Connection reset by peer)"`` (the first line of its message)."""
        if isinstance(error, TimeoutError):
            return f"{self.name()} gave no answer in {waited:g} s"
        lines = str(error).strip().splitlines()
        said = f": {lines[0]}" if lines else ""
        return f"{self.name()} failed ({type(error).__name__}{said})"

    def remedy(self) -> str:
        """Where the store lives and what to do about losing it."""
        if self.replicated:
            return (
                "the cluster lost its quorum or cannot be reached: check its members "
                "(etcdctl endpoint health --cluster)"
            )
        host = self.address.rsplit(":", 1)[0] if self.address else None
        where = f"the launcher of the node at {host}" if host else "one node's launcher"
        return (
            f"it lives in {where}, a single point of failure: --rdzv-backend etcd-v2 "
            "keeps the store in a replicated etcd cluster instead"
        )
