"""One node's side of a rendezvous: join a round, agree on worker ranks, the exit barrier.

`NodeRendezvous` is what the agent needs; two kinds provide it. `Rendezvous` is the
awaitable face of a torch handler (`aioelastic._elastic.rendezvous._handlers`): each call
runs on the handler's own daemon thread (`aioelastic._elastic.store._serial_thread`), so
awaiting it can always be cancelled at once. A cancelled join still finishes on its
thread, and this node stays in torch's round state until its keep-alive expires, exactly as
if the agent had crashed, which torch's protocol already handles for its peers.
`LocalRendezvous` is one node without an agent store, and needs no torch at all.

The worker-rank exchange and the exit barrier use torch's store keys and encodings, so an
aioelastic agent and a torch agent can even take part in the same rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..channel._attempt_end import AttemptEnd
from ..channel._job_channel import JobChannel
from ..channel._link import SINGLE_STORE_LOST_AFTER
from ..channel._store_site import StoreSite
from ..observe._events import EndReason
from ..store._serial_thread import SerialThread, on_daemon_thread
from ..store._worker_store import Store, WorkerStoreHost, free_port
from . import _reform as reform
from ._handlers import connection_errors_explained

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = [
    "CLOSE_TIMEOUT",
    "LocalRendezvous",
    "NodeRendezvous",
    "Rendezvous",
    "RendezvousOutcome",
]

logger = logging.getLogger("aioelastic.rendezvous")

# torch's keys (torch/distributed/elastic/agent/server/api.py); kept identical so that rank
# assignment and the exit barrier interoperate with torch's own agents.
_ROLE_INFO_PREFIX = "torchelastic/role_info/"
_ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"
_TERMINAL_STATE_SYNC_ID = "torchelastic/agent/terminal_state"
# Ours: the job's restart count for the round, as node rank 0 read it.
_RESTART_COUNT_KEY = "aioelastic/restart_count"

CLOSE_TIMEOUT = 30.0
"""How long `Rendezvous.aclose` waits for torch's ``shutdown()`` (torch's close timeout)."""

# torch's handlers whose store gave the job channel no answer when an attempt ended: never
# shut down (torch's shutdown writes to that store, and would only wait out CLOSE_TIMEOUT).
# Kept by handler: the launch closes it through a `Rendezvous` of its own, after the agent's.
_STORE_LOST: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass(frozen=True)
class RendezvousOutcome:
    """What one completed round tells this node.

    Attributes:
        store: the round's store (torch's ``PrefixStore``) for the agents' own exchanges.
        group_rank: this node's rank among the nodes.
        group_world_size: the number of nodes in the round.
        master_addr: where workers find the store for their process group.
        master_port: its port.
        base_global_rank: the global rank of this node's local rank 0.
        world_size: the number of workers across all nodes.
        base_role_rank: the role rank of this node's local rank 0.
        role_world_size: the number of workers with this role across all nodes.
        restart_count: the job's restarts so far, the same on every node of the round
            (``TORCHELASTIC_RESTART_COUNT``); ``None`` when the agent counts them itself
            (one node, no store).
        channel: how this node hears from and tells the other nodes of the round
            (`JobChannel`), ``None`` without a store; the agent closes it.
    """

    store: Store
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    base_global_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int
    restart_count: int | None = None
    channel: JobChannel | None = None


class NodeRendezvous(Protocol):
    """What the agent needs from a rendezvous: `Rendezvous` or `LocalRendezvous`."""

    run_id: str
    backend: str

    @property
    def use_agent_store(self) -> bool: ...

    @property
    def membership_can_change(self) -> bool: ...

    async def next_rendezvous(
        self,
        role: str,
        local_world_size: int,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> RendezvousOutcome | None: ...

    async def num_nodes_waiting(self) -> int: ...

    def attempt_ended(self, end: AttemptEnd) -> None: ...

    async def exit_barrier(self, timeout: float) -> bool: ...

    async def aclose(self, *, shutdown: bool | None = None) -> None: ...


class LocalRendezvous:
    """One node and no agent store: a rendezvous that needs no torch.

    Used for a single node when torch's store sharing is off
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) or torch is not installed. The workers get
    what torchrun gives them in that mode: ``TORCHELASTIC_USE_AGENT_STORE=False``,
    ``MASTER_ADDR`` this host (``local_addr`` or its FQDN), ``MASTER_PORT`` a free port on
    which worker 0 hosts the workers' store. Every round picks a new port, so restarted
    workers never see an earlier attempt's keys. As in torch, the port is found free by the
    agent and bound by worker 0 a moment later: another program could take it in between,
    which a shared agent store (torch's default) rules out.

    Args:
        run_id: the job id (``TORCHELASTIC_RUN_ID``); a fresh UUID when None.
        local_addr: the address workers are given.
    """

    backend = "local"

    def __init__(self, run_id: str | None = None, local_addr: str | None = None) -> None:
        self.run_id = run_id or str(uuid.uuid4())
        self._local_addr = local_addr

    @property
    def use_agent_store(self) -> bool:
        """Always False: worker 0 hosts the workers' store."""
        return False

    @property
    def membership_can_change(self) -> bool:
        """Always False: one node, nobody to join."""
        return False

    async def next_rendezvous(
        self,
        role: str,
        local_world_size: int,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> RendezvousOutcome:
        """This node alone, ranks ``0..local_world_size-1``, a fresh free port."""
        addr = master_addr or self._local_addr
        if addr is None:
            # getfqdn() may wait on DNS; torch names the node the same way.
            addr = await on_daemon_thread(socket.getfqdn, "aioelastic-fqdn")
        return RendezvousOutcome(
            store=None,
            group_rank=0,
            group_world_size=1,
            master_addr=addr,
            master_port=master_port or free_port(),
            base_global_rank=0,
            world_size=local_world_size,
            base_role_rank=0,
            role_world_size=local_world_size,
        )

    async def num_nodes_waiting(self) -> int:
        """Always 0."""
        return 0

    def attempt_ended(self, end: AttemptEnd) -> None:
        """Nothing to count: the agent counts its own restarts."""

    async def exit_barrier(self, timeout: float) -> bool:
        """Nobody to wait for."""
        return True

    async def aclose(self, *, shutdown: bool | None = None) -> None:
        """Nothing to release."""


class Rendezvous:
    """The awaitable face of one torch ``RendezvousHandler``.

    Args:
        handler: torch's handler (``static``, ``c10d``, ...).
        owned: whether `aclose` shuts the handler down (closing the rendezvous for every
            node). True for handlers the agent created itself.
        local_addr: this node's address as its peers reach it.
        replace_lost_nodes: False: a lost node that leaves fewer than the job's fewest
            nodes ends the job at once (`NodeLostError`) instead of waiting for a node to
            replace it.
    """

    def __init__(
        self,
        handler: RendezvousHandler,
        *,
        owned: bool = False,
        local_addr: str | None = None,
        replace_lost_nodes: bool = True,
    ) -> None:
        for method in ("next_rendezvous", "num_nodes_waiting", "get_run_id", "shutdown"):
            if not callable(getattr(handler, method, None)):
                raise TypeError(
                    f"rdzv_handler must be a torch RendezvousHandler (it has no {method}()), "
                    f"got {handler!r}; create one with create_rdzv_handler(...) or torch's "
                    "get_rendezvous_handler(RendezvousParameters(...))"
                )
        self.handler = handler
        self.owned = owned
        self.run_id: str = handler.get_run_id()
        self.backend: str = handler.get_backend()
        self._thread = SerialThread(f"aioelastic-rdzv-{self.run_id}")
        self._last: RendezvousOutcome | None = None
        self._local_addr = local_addr
        self._worker_store = WorkerStoreHost(local_addr)
        # static: every node counts the ends of the attempts it took part in (the same
        # ends on every node, for membership never changes there).
        self._restarts = 0
        self._counts_itself = True
        # The last round's members (torch's node descriptors, by group rank), and the
        # group ranks seen vanishing since: the next join forgets them (`_rdzv_reform`).
        self._members: tuple[int, dict[Any, int]] | None = None
        self._lost: set[int] = set()
        self._reform = False
        self._replace_lost_nodes = replace_lost_nodes

    @property
    def use_agent_store(self) -> bool:
        """Whether workers connect to the store the agent hosts (torch's flag)."""
        return bool(self.handler.use_agent_store)

    @property
    def membership_can_change(self) -> bool:
        """False for ``static``, whose ``num_nodes_waiting()`` is always 0."""
        return self.backend != "static"

    async def next_rendezvous(
        self,
        role: str,
        local_world_size: int,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> RendezvousOutcome | None:
        """Join the next round, then agree on worker ranks with the other nodes.

        Args:
            role: this node's worker role.
            local_world_size: how many workers this node runs.
            master_addr: overrides the address torch's handler reports for workers.
            master_port: overrides its port.

        Returns:
            The round's outcome; None when torch says this node is not needed (it waited
            as a spare beyond ``max_nodes`` and the job has finished: torch's
            ``RendezvousGracefulExitError``, "not a failure").

        Raises:
            RendezvousError: torch's (timeout, closed, connection).
        """

        def join() -> RendezvousOutcome | None:
            return self._join(role, local_world_size, master_addr, master_port)

        outcome = await self._thread.call(join)
        if outcome is not None:
            self._last = outcome
        return outcome

    def _join(
        self, role: str, local_world_size: int, master_addr: str | None, master_port: int | None
    ) -> RendezvousOutcome | None:
        """`next_rendezvous` on the handler's thread: the round, the ranks, the channel."""
        from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

        logger.info("rendezvous %r: joining the next round", self.run_id)
        try:
            with self._store_named(), self._reforming():
                info = self.handler.next_rendezvous()
        except RendezvousGracefulExitError as e:
            logger.info("rendezvous %r: this node is not needed (%s)", self.run_id, e)
            return None
        self._members = reform.members(self.handler)
        addr, port = self._workers_store(info, master_addr, master_port)
        base, world, role_base, role_world = _assign_ranks(
            info.store, info.rank, info.world_size, role, local_world_size
        )
        restarts = None
        if self.membership_can_change:
            restarts = _job_restarts(self.handler, info.store, self.run_id)
            restart_count = _agree_restart_count(
                info.store, info.rank, restarts, own=self._restarts
            )
        else:
            restart_count = self._restarts
        self._counts_itself = restarts is None
        return RendezvousOutcome(
            store=info.store,
            group_rank=info.rank,
            group_world_size=info.world_size,
            master_addr=addr,
            master_port=port,
            base_global_rank=base,
            world_size=world,
            base_role_rank=role_base,
            role_world_size=role_world,
            restart_count=restart_count,
            channel=self._channel(info, restart_count, restarts),
        )

    @contextlib.contextmanager
    def _store_named(self) -> Iterator[None]:
        """torch's RendezvousConnectionError of a join, with the store named, why it failed
        and the remedy (torch says only "see inner exception for details", and the launcher
        shows one line)."""
        from torch.distributed.elastic.rendezvous import RendezvousConnectionError

        try:
            yield
        except RendezvousConnectionError as e:
            inner = e.__cause__ or e.__context__ or e
            store = getattr(self.handler, "_store", None)  # torch's handler: the round's store
            site = StoreSite(self.backend, _store_address(store))
            raise RendezvousConnectionError(
                f"{site.failure(inner, 0)} during the rendezvous; {site.remedy()}"
            ) from inner

    def _workers_store(
        self, info: Any, master_addr: str | None, master_port: int | None
    ) -> tuple[str, int]:
        """Where this round's workers find their store: given, hosted afresh, or torch's."""
        bootstrap = info.bootstrap_store_info
        addr = bootstrap.master_addr if bootstrap else None
        port = bootstrap.master_port if bootstrap else None
        if self.use_agent_store and self.membership_can_change:
            addr, port = self._worker_store.next_round(info.store, info.rank, addr, port)
        addr = master_addr or addr
        port = master_port or port
        if addr is None or port is None:
            raise RuntimeError(
                f"the {self.backend!r} rendezvous reported no store for workers; "
                "set WorkerSpec(master_addr=..., master_port=...)"
            )
        return addr, int(port)

    def _channel(
        self, info: Any, restart_count: int, restarts: tuple[Store, str] | None
    ) -> JobChannel:
        """The round's job channel, in the attempt's own key prefix of the round's store."""
        return JobChannel(
            info.store,
            f"aioelastic/attempt{restart_count}",
            node=info.rank,
            nodes=info.world_size,
            host=self._local_addr or socket.getfqdn(),
            restarts=restarts,
            site=StoreSite(self.backend, _store_address(info.store)),
            # etcd's cluster fails requests through an election and answers again;
            # the others' store lives in one launcher, and once it refuses it is gone.
            failing_lost_after=None
            if self.backend in ("etcd", "etcd-v2")
            else SINGLE_STORE_LOST_AFTER,
        )

    async def num_nodes_waiting(self) -> int:
        """How many nodes wait to join (a scale-up, or a replacement for a lost node)."""

        def waiting() -> int:
            with connection_errors_explained():
                return self.handler.num_nodes_waiting()

        return await self._thread.call(waiting)

    def attempt_ended(self, end: AttemptEnd) -> None:
        """Count ``end`` where the nodes count restarts themselves (``static``, custom);
        a node that vanished is forgotten by the next round at once; a store that gave
        the channel no answer is not shut down (`aclose`)."""
        if end.counts and self._counts_itself:
            self._restarts += 1
        if end.reason == EndReason.VANISHED:
            self._lost.add(end.node)
        channel = self._last.channel if self._last is not None else None
        if channel is not None and channel.store_silent:
            _STORE_LOST.add(self.handler)
        # Every node of the previous round rejoins now: the next join closes its round as
        # soon as they are in, and forgets one that stays silent (`_rdzv_reform`).
        self._reform = True

    @contextlib.contextmanager
    def _reforming(self) -> Iterator[None]:
        """Around a join after an attempt ended: forget vanished nodes, close the round
        when the survivors are in."""
        lost, self._lost = self._lost, set()
        after_end, self._reform = self._reform, False
        if not after_end or self._members is None:
            yield
            return
        last_round, members = self._members
        gone = {node for node, rank in members.items() if rank in lost}
        if not self._replace_lost_nodes:
            reform.end_if_short(self.handler, members, gone)
        for node in gone:
            reform.forget_node(self.handler, node)
        with reform.survivors_closing_round(self.handler, set(members) - gone, last_round):
            yield

    async def exit_barrier(self, timeout: float) -> bool:
        """Wait until every node of the last round finished its workers (torch's barrier).

        Args:
            timeout: seconds to wait for the slowest node.

        Returns:
            True when every node arrived; False (logged) on timeout or a store error, as in
            torch, where the barrier is a courtesy to peers and never fails a finished job.
        """
        last = self._last
        if last is None:
            return True

        def barrier() -> None:
            from torch.distributed.elastic.utils.store import barrier as store_barrier

            store_barrier(
                store=last.store,
                world_size=last.group_world_size,
                key_prefix=_TERMINAL_STATE_SYNC_ID,
                barrier_timeout=timeout,
            )

        try:
            await self._thread.call(barrier)
        except Exception as e:
            # Log text, not the exception: its traceback's frames would keep the handler
            # and its store sockets alive for as long as anyone holds the log record.
            logger.warning(
                "exit barrier: not every node finished within %.1f s (%s)",
                timeout,
                f"{type(e).__name__}: {e}",
            )
            return False
        return True

    async def aclose(self, *, shutdown: bool | None = None) -> None:
        """Release the handler thread, shutting the handler down first if asked.

        Args:
            shutdown: call torch's ``handler.shutdown()`` (closes the rendezvous for all
                nodes and stops heartbeats); default: only for an ``owned`` handler. Runs
                shielded from cancellation, for at most `CLOSE_TIMEOUT` seconds.
        """
        if shutdown is None:
            shutdown = self.owned
        if shutdown and self.handler in _STORE_LOST:
            logger.info(
                "rendezvous %r: its store gave no answer; not shutting it down", self.run_id
            )
            shutdown = False
        try:
            if shutdown:
                with anyio.move_on_after(CLOSE_TIMEOUT, shield=True) as scope:
                    try:
                        await self._thread.call(self.handler.shutdown)
                    except Exception:
                        logger.warning("rendezvous shutdown failed", exc_info=True)
                if scope.cancelled_caught:
                    logger.warning("rendezvous shutdown took over %.0f s; gave up", CLOSE_TIMEOUT)
        finally:
            self._last = None
            self._worker_store.close()
            self._thread.close()


def _store_address(store: Store) -> str | None:
    """``host:port`` of a round's store, for reports: the TCPStore under torch's
    ``PrefixStore``, or the etcd client's member; None when neither says."""
    store = getattr(store, "underlying_store", store)
    where = getattr(store, "client", store)  # torch's EtcdStore: its python-etcd client
    host, port = getattr(where, "host", None), getattr(where, "port", None)
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    return f"{host}:{port}"


def _job_restarts(
    handler: RendezvousHandler, store: Store, run_id: str
) -> tuple[Store, str] | None:
    """Where the job counts its restarts: a store every round shares, and the key.

    A round's store is torch's ``PrefixStore`` over the job's store (``c10d``, ``etcd-v2``);
    torch's ``etcd`` handler gives an etcd store per round, so the count goes in an
    etcd directory of the run's own. ``None`` for a handler with neither (a custom one).
    """
    underlying = getattr(store, "underlying_store", None)
    if underlying is not None:
        return underlying, f"aioelastic/{run_id}/restarts"
    impl = getattr(handler, "_rdzv_impl", None)
    if impl is not None and callable(getattr(impl, "setup_kv_store", None)):
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        path = impl.get_path("/aioelastic")
        impl.create_path_if_not_exists(path)
        return EtcdStore(etcd_client=impl.client, etcd_store_prefix=path), "restarts"
    return None  # node rank 0's own count is the job's


def _agree_restart_count(
    store: Store, group_rank: int, restarts: tuple[Store, str] | None, *, own: int
) -> int:
    """The job's restart count, as node rank 0 reads it, for every node of the round.

    Read once, by one node, after every node joined: every end of the previous attempt
    was counted before its node joined (see `JobChannel`), and no worker of this round
    runs yet, so no node can count an end of this round before another reads.
    """
    if group_rank == 0:
        count = restarts[0].add(restarts[1], 0) if restarts is not None else own
        store.set(_RESTART_COUNT_KEY, str(count))
        return int(count)
    return int(store.get(_RESTART_COUNT_KEY))


def _assign_ranks(
    store: Store, group_rank: int, group_world_size: int, role: str, local_world_size: int
) -> tuple[int, int, int, int]:
    """Global and role ranks of this node's workers: torch's exchange, torch's keys.

    Nodes may run different numbers of workers, so node 0 collects every node's
    (role, local_world_size) and hands out contiguous rank ranges in node order.
    ``TORCH_ELASTIC_WORKER_IDENTICAL=1`` promises equal nodes and skips the exchange.

    Returns:
        (base global rank, world size, base role rank, role world size).
    """
    if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
        world = group_world_size * local_world_size
        base = group_rank * local_world_size
        return base, world, base, world
    info = {"role": role, "rank": group_rank, "local_world_size": local_world_size}
    store.set(f"{_ROLE_INFO_PREFIX}{group_rank}", json.dumps(info).encode("UTF-8"))
    if group_rank == 0:
        raw = store.multi_get([f"{_ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)])
        infos = [json.loads(item.decode("UTF-8")) for item in raw]
        role_sizes: Counter[str] = Counter()
        for node in infos:
            role_sizes[node["role"]] += node["local_world_size"]
        total = sum(role_sizes.values())
        keys, values = [], []
        next_global = 0
        next_role: Counter[str] = Counter()
        for i, node in enumerate(infos):
            keys.append(f"{_ASSIGNED_RANKS_PREFIX}{i}")
            values.append(
                json.dumps([next_global, total, next_role[node["role"]], role_sizes[node["role"]]])
            )
            next_global += node["local_world_size"]
            next_role[node["role"]] += node["local_world_size"]
        store.multi_set(keys, values)
    base, world, role_base, role_world = json.loads(
        store.get(f"{_ASSIGNED_RANKS_PREFIX}{group_rank}")
    )
    return int(base), int(world), int(role_base), int(role_world)
