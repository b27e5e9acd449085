"""torch rendezvous handlers from torch's registry, created off the event loop.

The agent never speaks a rendezvous protocol of its own. Handlers come from torch's
registry (``torch.distributed.elastic.rendezvous.registry``): ``static`` (a TCPStore
hosted by node rank 0) and ``c10d`` (torch's dynamic rendezvous over a TCPStore, ``min:max``
nodes), or any handler a user registered there. `aioelastic._elastic.rendezvous._node` drives them.

torch is imported only when a handler is created.
"""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from ..settings import _node_values as node_values
from ..store._serial_thread import on_daemon_thread

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = ["connection_errors_explained", "create_rdzv_handler", "standalone_handler"]


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
            ``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``,
            ``read_timeout``, ``is_host``, ``store_type``; for ``static`` ``rank`` (the node
            rank) and ``timeout``. For torch's own backends (``c10d``, ``etcd-v2``,
            ``etcd``, ``static``) an option the backend does not read, or a value it would
            refuse, is refused here (``timeout``, which torch's ``LaunchConfig`` gives every
            backend, is accepted as a whole number of seconds); a backend registered under
            another name gets them all as given.

    Returns:
        torch's ``RendezvousHandler``, ready for ``WorkerSpec(rdzv_handler=...)``.

    Raises:
        TypeError, ValueError: bad arguments or options (before any thread starts, with
            the same message as ``aioelastic-run --rdzv-conf``), or torch's own
            ``ValueError`` for a backend it does not know.
        RendezvousConnectionError: torch could not reach or host the store.
    """
    _check_arguments(backend, endpoint, run_id, min_nodes, max_nodes, config)
    members = node_values.endpoints(endpoint, backend) if endpoint.strip() else [endpoint]
    return await on_daemon_thread(
        partial(
            _create, backend, endpoint, members, run_id, min_nodes, max_nodes, local_addr, config
        ),
        f"aioelastic-rdzv-create-{run_id}",
    )


def _check_arguments(
    backend: str,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    config: dict[str, Any],
) -> None:
    """`create_rdzv_handler`'s arguments checked, before any thread starts."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a non-empty str such as 'c10d', got {backend!r}")
    if not isinstance(endpoint, str):
        raise TypeError(f"endpoint must be a str 'host[:port]', got {endpoint!r}")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty str, got {run_id!r}")
    _validate_nodes(min_nodes, max_nodes)
    node_values.rdzv_options(backend, config)
    if backend in ("etcd", "etcd-v2") and importlib.util.find_spec("etcd") is None:
        # torch's own message names a module called 'etcd', and the PyPI package of that
        # name is another client that torch cannot use.
        raise RuntimeError(
            f"the {backend!r} rendezvous backend needs the python-etcd client on every node: "
            "pip install 'aioelastic[etcd]' (the PyPI package named 'etcd' is another "
            "client)"
        )


def _create(
    backend: str,
    endpoint: str,
    members: list[str],
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None,
    config: dict[str, Any],
) -> RendezvousHandler:
    """Blocking: torch's handler, through the first of ``members`` that answers."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
    )
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    unreachable: list[str] = []
    for member in members:
        params = RendezvousParameters(
            backend=backend,
            endpoint=member,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=local_addr,
            **config,
        )
        try:
            with connection_errors_explained():
                return get_rendezvous_handler(params)
        except Exception as e:
            # An etcd member down when the node starts: the next one is asked. torch's
            # older handler raises the client's own error, the newer one wraps it.
            if len(members) == 1 or not _unreachable(e):
                raise
            unreachable.append(f"{member}: {e}")
    raise RendezvousConnectionError(
        f"no member of --rdzv-endpoint {endpoint!r} answered: " + "; ".join(unreachable)
    )


def _unreachable(error: BaseException) -> bool:
    """Whether ``error`` says an etcd member could not be reached (not a bad option)."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    if isinstance(error, RendezvousConnectionError):
        return True
    import etcd  # type: ignore[import-untyped]  # present: checked for the etcd backends

    return isinstance(error, etcd.EtcdException)


@contextlib.contextmanager
def connection_errors_explained() -> Iterator[None]:
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
