"""Rendezvous through torch's own handlers, awaited without blocking the event loop.

The agent never speaks a rendezvous protocol of its own. Handlers come from torch's
registry (``torch.distributed.elastic.rendezvous.registry``): ``static`` (a TCPStore
hosted by node rank 0) and ``c10d`` (torch's dynamic rendezvous over a TCPStore, ``min:max``
nodes), or any handler a user registered there. The worker-rank exchange and the exit
barrier use torch's store keys and encodings, so an aioelastic agent and a torch agent can
even take part in the same rendezvous.

Every call into a handler blocks (store round trips, one-second sync sleeps, joins that
wait for peers for minutes), so each runs on a thread. Not on anyio's worker threads,
though: those are non-daemon, and a join abandoned by a cancelled agent would keep the
interpreter from exiting until torch's join timeout (600 s by default) runs out. Each
`Rendezvous` owns one daemon thread that runs its handler's calls one at a time (torch's
handlers are not safe to call concurrently) and hands results back to the event loop.

Cancellation: awaiting a call can always be cancelled at once. The call itself cannot be
interrupted; it finishes on its thread and its result is dropped. For a join that means this
node stays in torch's round state until its keep-alive expires, exactly as if the agent had
crashed, which torch's protocol already handles for its peers. Later calls on the same
handler queue behind the abandoned one.

torch is imported here only, and only when a handler is created or used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

Store = Any
"""A ``torch.distributed.Store``; typed loosely so that type checking needs no torch stubs."""

__all__ = [
    "LocalRendezvous",
    "NodeRendezvous",
    "Rendezvous",
    "RendezvousOutcome",
    "create_rdzv_handler",
    "standalone_handler",
]

logger = logging.getLogger("aioelastic.rendezvous")

_T = TypeVar("_T")

# torch's keys (torch/distributed/elastic/agent/server/api.py); kept identical so that rank
# assignment and the exit barrier interoperate with torch's own agents.
_ROLE_INFO_PREFIX = "torchelastic/role_info/"
_ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"
_TERMINAL_STATE_SYNC_ID = "torchelastic/agent/terminal_state"
# Ours: where node rank 0 publishes the worker store it hosts for the round.
_WORKER_STORE_KEY = "aioelastic/worker_store"

CLOSE_TIMEOUT = 30.0
"""How long `Rendezvous.aclose` waits for torch's ``shutdown()`` (torch's close timeout)."""


class _SerialThread:
    """One daemon thread running blocking calls in submission order.

    Results travel back with ``loop.call_soon_threadsafe``; a caller that was cancelled has
    already cancelled its future, and a loop that has since closed is simply not told.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    async def call(self, fn: Callable[[], _T]) -> _T:
        if self._closed:
            raise RuntimeError(f"{self._name}: already closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._calls.put((fn, loop, future))
        return await future

    def close(self) -> None:
        """Let the thread exit once the calls already queued have run."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, loop, future = item
            if future.cancelled():
                # Abandoned before it started: nobody wants it, and not running it lets
                # the calls queued behind it go sooner.
                continue
            try:
                result, error = fn(), None
            except BaseException as e:
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                if error is not None:
                    logger.debug("abandoned rendezvous call failed", exc_info=error)
            # Drop this call before blocking on the next: its closure holds the handler,
            # whose TCPStores keep sockets open for as long as anything refers to them.
            del item, fn, loop, future, result, error


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        if error is not None:
            logger.debug("abandoned rendezvous call failed", exc_info=error)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _on_daemon_thread(fn: Callable[[], _T], name: str) -> _T:
    thread = _SerialThread(name)
    try:
        return await thread.call(fn)
    finally:
        thread.close()


def _validate_nodes(min_nodes: object, max_nodes: object) -> None:
    for label, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {value!r}")
    if not 1 <= min_nodes <= max_nodes:  # type: ignore[operator]
        raise ValueError(
            f"need 1 <= min_nodes <= max_nodes, got min_nodes={min_nodes}, "
            f"max_nodes={max_nodes}; e.g. min_nodes=1, max_nodes=2 for '--nnodes 1:2'"
        )


async def create_rdzv_handler(
    backend: str,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None = None,
    **config: Any,
) -> RendezvousHandler:
    """Create a torch rendezvous handler from torch's registry, off the event loop.

    Creating a ``c10d`` handler already connects to (or hosts) its TCPStore, which can
    block for the store's timeout; this runs on a daemon thread.

    Args:
        backend: a name registered in torch's registry: ``"c10d"``, ``"static"``, ``"etcd"``,
            ``"etcd-v2"``, or one a plugin registered.
        endpoint: ``host[:port]`` of the rendezvous store (``"localhost:0"``: any free port).
        run_id: the job id shared by every node.
        min_nodes: fewest nodes to start with.
        max_nodes: most nodes admitted.
        local_addr: this node's address as peers should see it (default: its FQDN).
        **config: backend options, torch's ``--rdzv-conf``: for ``c10d`` e.g.
            ``join_timeout``, ``last_call_timeout``, ``close_timeout``,
            ``keep_alive_interval``, ``keep_alive_max_attempt``, ``read_timeout``,
            ``is_host``; for ``static`` ``rank`` (the node rank) and ``timeout``.

    Returns:
        torch's ``RendezvousHandler``, ready for ``WorkerSpec(rdzv_handler=...)``.

    Raises:
        TypeError, ValueError: bad arguments (before any thread starts), or torch's own
            ``ValueError`` for a backend it does not know or options it rejects.
        RendezvousConnectionError: torch could not reach or host the store.
    """
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a non-empty str such as 'c10d', got {backend!r}")
    if not isinstance(endpoint, str):
        raise TypeError(f"endpoint must be a str 'host[:port]', got {endpoint!r}")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty str, got {run_id!r}")
    _validate_nodes(min_nodes, max_nodes)

    def create() -> RendezvousHandler:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        params = RendezvousParameters(
            backend=backend,
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=local_addr,
            **config,
        )
        with _connection_errors_explained():
            return get_rendezvous_handler(params)

    return await _on_daemon_thread(create, f"aioelastic-rdzv-create-{run_id}")


@contextlib.contextmanager
def _connection_errors_explained() -> Iterator[None]:
    """torch's RendezvousConnectionError, with the reason in its message and as its cause.

    torch says only "see inner exception for details", and the inner exception is lost
    wherever the error is shown as one line (a log, the launcher's error line).
    """
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    try:
        yield
    except RendezvousConnectionError as e:
        inner = e.__cause__ or e.__context__
        if inner is None or str(inner) in str(e):
            raise
        raise RendezvousConnectionError(f"{e} ({type(inner).__name__}: {inner})") from inner


async def standalone_handler(
    local_addr: str | None = None, run_id: str | None = None
) -> RendezvousHandler:
    """The single-node handler torchrun uses when given neither a rendezvous nor a port.

    That is ``--standalone``: ``c10d`` on ``localhost:0`` (a TCPStore on a free port in
    this process), one node, a fresh run id unless one is given.
    """
    return await create_rdzv_handler(
        "c10d", "localhost:0", run_id or str(uuid.uuid4()), 1, 1, local_addr=local_addr
    )


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
            addr = await _on_daemon_thread(socket.getfqdn, "aioelastic-fqdn")
        return RendezvousOutcome(
            store=None,
            group_rank=0,
            group_world_size=1,
            master_addr=addr,
            master_port=master_port or _free_port(),
            base_global_rank=0,
            world_size=local_world_size,
            base_role_rank=0,
            role_world_size=local_world_size,
        )

    async def num_nodes_waiting(self) -> int:
        """Always 0."""
        return 0

    async def exit_barrier(self, timeout: float) -> bool:
        """Nobody to wait for."""
        return True

    async def aclose(self, *, shutdown: bool | None = None) -> None:
        """Nothing to release."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Rendezvous:
    """The awaitable face of one torch ``RendezvousHandler``.

    Args:
        handler: torch's handler (``static``, ``c10d``, ...).
        owned: whether `aclose` shuts the handler down (closing the rendezvous for every
            node). True for handlers the agent created itself.
    """

    def __init__(
        self, handler: RendezvousHandler, *, owned: bool = False, local_addr: str | None = None
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
        self._thread = _SerialThread(f"aioelastic-rdzv-{self.run_id}")
        self._last: RendezvousOutcome | None = None
        self._local_addr = local_addr
        self._worker_store: Store | None = None

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
            from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

            try:
                with _connection_errors_explained():
                    info = self.handler.next_rendezvous()
            except RendezvousGracefulExitError as e:
                logger.info("rendezvous %r: this node is not needed (%s)", self.run_id, e)
                return None
            bootstrap = info.bootstrap_store_info
            addr = bootstrap.master_addr if bootstrap else None
            port = bootstrap.master_port if bootstrap else None
            if self.use_agent_store and self.membership_can_change:
                addr, port = self._fresh_worker_store(info.store, info.rank, addr, port)
            addr = master_addr or addr
            port = master_port or port
            if addr is None or port is None:
                raise RuntimeError(
                    f"the {self.backend!r} rendezvous reported no store for workers; "
                    "set WorkerSpec(master_addr=..., master_port=...)"
                )
            base, world, role_base, role_world = _assign_ranks(
                info.store, info.rank, info.world_size, role, local_world_size
            )
            return RendezvousOutcome(
                store=info.store,
                group_rank=info.rank,
                group_world_size=info.world_size,
                master_addr=addr,
                master_port=int(port),
                base_global_rank=base,
                world_size=world,
                base_role_rank=role_base,
                role_world_size=role_world,
            )

        outcome = await self._thread.call(join)
        if outcome is not None:
            self._last = outcome
        return outcome

    async def num_nodes_waiting(self) -> int:
        """How many nodes wait to join (a scale-up, or a replacement for a lost node)."""

        def waiting() -> int:
            with _connection_errors_explained():
                return self.handler.num_nodes_waiting()

        return await self._thread.call(waiting)

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
            self._worker_store = None
            self._thread.close()

    def _fresh_worker_store(
        self, store: Store, group_rank: int, addr: str | None, port: int | None
    ) -> tuple[str, int]:
        """A new store for this round's workers, hosted by node rank 0; its address.

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

        So here node rank 0 hosts a fresh TCPStore every round and publishes it under a key
        of ours; the other nodes read it from the round's store. Rank 0 also fills in
        torch's keys where torch left them out, which is what unblocks a late joiner.
        Runs on the handler thread, right after ``next_rendezvous``.
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
        self._worker_store = server
        torch_keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
        if not store.check(torch_keys):
            store.set(torch_keys[0], (addr or own_addr).encode("UTF-8"))
            store.set(torch_keys[1], str(port or server.port).encode("UTF-8"))
        store.set(_WORKER_STORE_KEY, json.dumps([own_addr, server.port]))
        return own_addr, int(server.port)


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
