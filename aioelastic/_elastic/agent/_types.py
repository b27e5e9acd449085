"""What the agent runs and reports: the spec, the workers, their state, the run's result.

torch's public types of ``torch.distributed.elastic.agent.server`` under the same names and
contracts: `WorkerSpec` (what to run and how to recover, plus `RestartBackoff`), `Worker`
and `WorkerGroup` (this node's workers and their ranks), `WorkerState`, `RunResult`. They
hold data and check it on construction; `aioelastic._elastic.agent._agent` runs them.
"""

from __future__ import annotations

import enum
import os
import random
import string
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._core.process import _values as values
from ..._core.reports._failures import ProcessFailure
from ..settings import _node_values as node_values

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    from ..store._worker_store import Store

__all__ = [
    "DEFAULT_ROLE",
    "DEFAULT_SIGNALS_TO_HANDLE",
    "RestartBackoff",
    "RunResult",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "substitute_local_rank",
]

DEFAULT_ROLE = "default"

DEFAULT_SIGNALS_TO_HANDLE = node_values.DEFAULT_SIGNALS_TO_HANDLE
"""torch's default for ``TORCHELASTIC_SIGNALS_TO_HANDLE`` / ``--signals-to-handle``."""

_LOCAL_RANK_MACRO = "local_rank"


@dataclass(frozen=True, kw_only=True)
class RestartBackoff:
    """Exponential backoff with jitter between failure restarts (torch restarts at once).

    Before failure restart ``k`` (1, 2, ...) the agent waits
    ``d * (1 - jitter) + uniform(0, d * jitter)`` seconds, where
    ``d = min(maximum, initial * multiplier ** (k - 1))``. ``jitter=1`` is "full jitter"
    (anywhere in ``[0, d]``), ``jitter=0`` waits exactly ``d``. Jitter keeps nodes that
    failed together from hammering a shared resource (a store, a filesystem, a licence
    server) in lockstep. Membership-change restarts never wait: peers are waiting.

    Attributes:
        initial: ``d`` for the first restart, seconds.
        maximum: cap on ``d``, seconds.
        multiplier: growth of ``d`` per restart (>= 1).
        jitter: the randomised fraction of ``d``, in ``[0, 1]``.
    """

    initial: float = 1.0
    maximum: float = 60.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        # Through the command line's parser for --restart-backoff/-max, so that a bad value
        # reads the same from both.
        for name in ("initial", "maximum", "multiplier", "jitter"):
            parsed = values.field(f"RestartBackoff.{name}", values.duration, getattr(self, name))
            object.__setattr__(self, name, parsed)  # frozen: set once, here
        if self.multiplier < 1:
            raise ValueError(f"RestartBackoff.multiplier must be >= 1, got {self.multiplier}")
        if self.jitter > 1:
            raise ValueError(f"RestartBackoff.jitter must be in [0, 1], got {self.jitter}")
        if self.maximum < self.initial:
            raise ValueError(
                f"RestartBackoff.maximum ({self.maximum}) must be >= initial ({self.initial})"
            )

    def delay(self, restart: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before failure restart number ``restart`` (1-based).

        Args:
            restart: which restart: 1 for the first.
            rng: source of randomness (default: the ``random`` module).

        Raises:
            ValueError: ``restart`` is less than 1.
        """
        if restart < 1:
            raise ValueError(f"restart counts from 1, got {restart}")
        try:
            base = min(self.maximum, self.initial * self.multiplier ** (restart - 1))
        except OverflowError:
            base = self.maximum
        spread = base * self.jitter
        return base - spread + (rng or random).uniform(0.0, spread)


@dataclass(kw_only=True)
class WorkerSpec:
    """What to run on this node, and how to recover: torch's ``WorkerSpec`` plus extras.

    Attributes:
        role: the workers' role (``ROLE_NAME``; the log prefix ``[{role}{local_rank}]:``).
        local_world_size: how many workers this node runs.
        entrypoint: a picklable function (function workers) or a binary's path or name
            (binary workers), as in `start_processes`.
        args: the arguments, the same for every worker; in strings ``${local_rank}`` is
            replaced by each worker's local rank (torch's macro).
        max_restarts: how many times a failed group is restarted (failures only).
        monitor_interval: how often to check the rendezvous for nodes waiting to join,
            seconds. Worker exits are events and are acted on at once.
        rdzv_handler: torch's ``RendezvousHandler``; ``None`` means one node:
            torchrun's ``--standalone`` (``c10d`` on ``localhost:0``), or, when
            ``master_port`` is given, ``static`` at ``master_addr:master_port``; with
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` or without torch, a torch-free
            `LocalRendezvous`.
        master_addr: overrides the store address workers get (``MASTER_ADDR``).
        master_port: overrides its port (``MASTER_PORT``).
        local_addr: this node's address as peers see it (for the default handler).
        virtual_local_rank: every worker gets ``LOCAL_RANK=0`` and
            ``CUDA_VISIBLE_DEVICES`` naming its one device (torch's option).
        restart_backoff: wait between failure restarts (see `RestartBackoff`); ``None``
            restarts at once, as torch does.
        no_retry_exit_codes: exit codes that fail the run at once, restarts left or not:
            failures that will only repeat (a usage error, a missing file, a bad config;
            pytorch#60910). Negative values name signals (``-9``: killed by SIGKILL).
    """

    role: str = DEFAULT_ROLE
    local_world_size: int
    entrypoint: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    max_restarts: int = 0
    monitor_interval: float = 0.1
    rdzv_handler: RendezvousHandler | None = None
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    virtual_local_rank: bool = False
    restart_backoff: RestartBackoff | None = None
    no_retry_exit_codes: Collection[int] = frozenset()

    def __post_init__(self) -> None:
        values.field("role", values.name, self.role)
        values.field("local_world_size", values.positive_int, self.local_world_size)
        if isinstance(self.entrypoint, str):
            if not self.entrypoint:
                raise ValueError("entrypoint is an empty str; give a binary's path or name")
        elif not callable(self.entrypoint):
            raise TypeError(
                "entrypoint must be a function (function workers) or a str (a binary), "
                f"got {self.entrypoint!r}"
            )
        args: object = self.args
        if isinstance(args, list):
            self.args = tuple(args)
        elif not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}: {args!r}")
        values.field("max_restarts", values.non_negative_int, self.max_restarts)
        values.field("monitor_interval", values.positive_duration, self.monitor_interval)
        for name in ("master_addr", "local_addr"):
            if getattr(self, name) is not None:
                values.field(name, node_values.host, getattr(self, name))
        if self.master_port is not None:
            # Port 0 is any free port, which is what None already asks for.
            self.master_port = values.field("master_port", values.port, self.master_port) or None
        if self.restart_backoff is not None and not isinstance(
            self.restart_backoff, RestartBackoff
        ):
            raise TypeError(
                f"restart_backoff must be a RestartBackoff or None, got {self.restart_backoff!r}"
            )
        self.no_retry_exit_codes = values.field(
            "no_retry_exit_codes", node_values.exit_codes, self.no_retry_exit_codes
        )

    def get_entrypoint_name(self) -> str:
        """The binary's file name, or the function's qualified name."""
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        return str(getattr(self.entrypoint, "__qualname__", repr(self.entrypoint)))


@dataclass
class Worker:
    """One local worker and its ranks (torch's ``Worker``).

    Attributes:
        local_rank: rank on this node.
        global_rank: rank among all workers (``RANK``).
        role_rank: rank among the workers of this role (``ROLE_RANK``).
        world_size: number of workers in total (``WORLD_SIZE``).
        role_world_size: number of workers of this role (``ROLE_WORLD_SIZE``).
        id: the worker's pid while it runs, else None.
    """

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: int | None = None


class WorkerState(str, enum.Enum):
    """The state of a `WorkerGroup`; its workers change state as a unit (torch's states).

    ``INIT`` before the first start; ``HEALTHY`` while running; ``STOPPED`` between a
    stop and the next start (restart, membership change) and after a signal or a
    cancellation; ``SUCCEEDED`` / ``FAILED`` at the end; ``UNKNOWN`` when the agent itself
    failed (e.g. a rendezvous error). ``UNHEALTHY`` is never set by this agent.
    """

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def is_running(self) -> bool:
        """Whether workers are running (``HEALTHY`` or ``UNHEALTHY``).

        Callable as ``state.is_running()`` or, as in torch, ``WorkerState.is_running(state)``.
        """
        return self in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


class WorkerGroup:
    """This node's workers for one spec (torch's ``WorkerGroup``).

    Attributes:
        spec: the spec.
        workers: one `Worker` per local rank.
        store: the last rendezvous round's store (torch's), or None before one.
        group_rank: this node's rank, or None before a rendezvous.
        group_world_size: the number of nodes, or None before a rendezvous.
        master_addr: the store address given to workers, or None before a rendezvous.
        master_port: its port, or None.
        state: the group's `WorkerState`.
    """

    __slots__ = (
        "group_rank",
        "group_world_size",
        "master_addr",
        "master_port",
        "spec",
        "state",
        "store",
        "workers",
    )

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Store | None = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.state = WorkerState.INIT


@dataclass
class RunResult:
    """How a run ended (torch's ``RunResult``); every dict is keyed by global rank.

    Attributes:
        state: ``SUCCEEDED`` or ``FAILED``.
        return_values: each local function worker's return value on success (``None`` for
            binaries).
        failures: on failure, the workers of the last attempt that failed by themselves.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)

    def is_failed(self) -> bool:
        """Whether the run failed."""
        return self.state == WorkerState.FAILED


def substitute_local_rank(args: tuple[Any, ...], local_rank: int) -> tuple[Any, ...]:
    """``args`` with torch's ``${local_rank}`` macro replaced in every string."""
    return tuple(
        string.Template(a).safe_substitute({_LOCAL_RANK_MACRO: str(local_rank)})
        if isinstance(a, str)
        else a
        for a in args
    )
