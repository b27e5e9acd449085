"""``elastic_launch``: torch's launcher API (``torch.distributed.launcher.api``), awaited.

::

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=4, max_restarts=2)
    outputs = await elastic_launch(config, train)(arg1, arg2)   # {global_rank: value}
    await elastic_launch(config, sys.executable)("-u", "train.py", "--epochs", "3")

This is what torchrun does after parsing its flags: build the rendezvous handler from the
config (through torch's registry), run one `LocalElasticAgent`, shut the rendezvous down,
and turn a failed run into `ChildFailedError`.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from ..._core.aio._backend import require_asyncio
from ..._core.aio._signals import SignalReceived
from ..._core.child import _stack_hook as stack_hook
from ..._core.group._options import GroupOptions, option_names
from ..._core.output._std import Std
from ..._core.process import _values as values
from ..._core.reports._failures import ChildFailedError
from ..agent._agent import LocalElasticAgent
from ..agent._types import DEFAULT_SIGNALS_TO_HANDLE, RestartBackoff, RunResult, WorkerSpec
from ..observe._event_hub import EventHub
from ..observe._events import EventStream
from ..rendezvous._handlers import create_rdzv_handler
from ..rendezvous._node import Rendezvous
from ..settings import _node_values as node_values
from ..settings._config import AgentConfig

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent", "static_store"]

_DEFAULT_RDZV_TIMEOUT = 900

#: The LaunchConfig fields that are the group's options (GroupOptions' fields, by the names
#: torch's APIs give them).
_GROUP_FIELDS = option_names(torch=True)

# The LaunchConfig fields the agent's settings and the store address are derived from
# (log_dir is not: it is only wrapped in a Path, and the launcher sets it per run).
_DERIVED_FROM = (
    "nproc_per_node",
    "max_nodes",
    "rdzv_backend",
    "rdzv_endpoint",
    "start_method",
    "exit_barrier_timeout",
    "signals_to_handle",
    "metrics_port",
    "metrics_host",
    "replace_lost_nodes",
    "options",
    *_GROUP_FIELDS,
)


def static_store(endpoint: str, max_nodes: int) -> tuple[str, int | None]:
    """Where local rank 0 hosts the workers' store for the ``static`` rendezvous.

    torchrun's rule, in the one place both `LaunchConfig` (and through it
    ``aioelastic-run``) and `launch_agent` take it from: the endpoint is the store's
    ``HOST:PORT``. A single node may leave the port out or give 0 for any free port, since
    nobody else needs to know it; every node of a larger job must reach the same port.

    Args:
        endpoint: the ``rdzv_endpoint`` text, ``HOST[:PORT]``.
        max_nodes: the most nodes of the job.

    Returns:
        ``(host, port)``; ``port`` is None for a free port (single node only).

    Raises:
        ValueError: not ``HOST[:PORT]``, or no fixed port for more than one node.
    """
    host, port = node_values.endpoint(endpoint)
    if port:
        return host, port
    if max_nodes == 1:
        return host, None
    raise ValueError(
        f"the static rendezvous of {max_nodes} nodes needs a fixed port every node can "
        f"reach, got {endpoint.strip()!r}; give HOST:PORT"
    )


@dataclass(frozen=True)
class _Derived:
    """What a `LaunchConfig` resolves to, kept with the field values it came from."""

    inputs: tuple[Any, ...]
    agent: AgentConfig
    store: tuple[str, int | None] | None


def _snapshot(value: Any) -> Any:
    """A copy of ``value`` that a later in-place change of the original does not alter."""
    if isinstance(value, Mapping):
        return tuple((key, _snapshot(item)) for key, item in value.items())
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


@dataclass
class LaunchConfig:
    """How to launch: torch's ``LaunchConfig`` fields, plus aioelastic's extras.

    torch's fields keep their names, order and meaning. Differences: ``rdzv_backend``
    defaults to ``"c10d"`` (torch's ``"etcd"`` needs an etcd server), and with no
    ``rdzv_endpoint`` and one node the launch is torchrun's ``--standalone`` (``c10d`` on
    ``localhost:0``, a fresh run id). Logs are configured by ``log_dir``, ``redirects``,
    ``tee`` and the console filters instead of a torch ``LogsSpecs`` object. Fields
    aioelastic does not implement (``logs_specs``, ``metrics_cfg``, ``event_log_handler``,
    ``numa_options``, ``duplicate_*_filters``) are accepted only at their defaults, so a
    config that relies on them fails loudly instead of being half-applied.

    Attributes:
        min_nodes: fewest nodes to start with.
        max_nodes: most nodes admitted (``--nnodes min:max``).
        nproc_per_node: workers on this node.
        logs_specs: must be None (see ``log_dir``...).
        run_id: the job id shared by all nodes; generated when empty.
        role: the workers' role (``ROLE_NAME``).
        rdzv_endpoint: ``host[:port]`` of the rendezvous store.
        rdzv_backend: ``"c10d"`` or ``"static"`` (or any torch-registered backend).
        rdzv_configs: backend options (``--rdzv-conf``), e.g. ``join_timeout``,
            ``last_call_timeout``, ``close_timeout``; for ``static`` ``rank``.
        rdzv_timeout: legacy; sets ``rdzv_configs["timeout"]`` (default 900).
        max_restarts: failure restarts allowed.
        monitor_interval: seconds between checks for nodes waiting to join.
        start_method: ``spawn``, ``fork`` or ``forkserver`` (function workers).
        log_line_prefix_template: console prefix template (``${role_name}``, ``${rank}``,
            ``${local_rank}``, ``${hostname}``).
        metrics_cfg: must be empty.
        local_addr: this node's address as peers see it.
        event_log_handler: must be ``"null"``; lifecycle events come from
            `elastic_launch.events`.
        numa_options: must be None.
        signals_to_handle: signals that stop the run (exported to workers as
            ``TORCHELASTIC_SIGNALS_TO_HANDLE``, as torchrun does).
        duplicate_stdout_filters: must be None.
        duplicate_stderr_filters: must be None.
        virtual_local_rank: ``LOCAL_RANK=0`` and one ``CUDA_VISIBLE_DEVICES`` per worker.
        shutdown_timeout: grace period before SIGKILL, seconds (default:
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30).
        log_dir: log root; attempt ``n`` goes to ``{log_dir}/attempt_{n}/{local_rank}/``.
        exit_barrier_timeout: how long a finished node waits for the others (torch
            hard-codes 300 s).
        restart_backoff: wait between failure restarts (`RestartBackoff`).
        no_retry_exit_codes: exit codes that fail the run at once.
        metrics_port: serve Prometheus metrics and ``/health`` there (``metrics_host``).
        replace_lost_nodes: True (torch's way): when a lost node leaves fewer than
            ``min_nodes``, the others wait for a node to replace it, up to the rendezvous'
            join timeout. False: they end the run at once, naming the lost node — where
            nothing can replace it, as in a SLURM step, so that the scheduler can requeue
            the job (``aioelastic-run`` sets it there). Applies to the dynamic rendezvous
            (``c10d``, ``etcd-v2``); the legacy ``etcd`` backend and custom handlers wait.
        options: the options of the workers' group as one `GroupOptions`. Each of its
            fields is also a field here, by torch's name for it: ``redirects``, ``tee``,
            ``shutdown_timeout``, ``log_line_prefix_template`` and the fields after
            ``log_dir`` that `GroupOptions` documents (the console filters, by local and
            by global rank, ``forkserver_preload``, ``stall_timeout``, the stop order,
            ``collapse_identical_lines``). A value given here is written to its field
            when the config is made; a field set differently in both places is a
            TypeError.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: None = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: None = None
    signals_to_handle: str = DEFAULT_SIGNALS_TO_HANDLE
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: float | None = None
    log_dir: str | os.PathLike[str] | None = None
    redirects: Std | Mapping[int, Std] = Std.NONE
    tee: Std | Mapping[int, Std] = Std.NONE
    local_ranks_filter: Collection[int] | None = None
    forkserver_preload: Collection[str] = ()
    exit_barrier_timeout: float = 300.0
    restart_backoff: RestartBackoff | None = None
    no_retry_exit_codes: Collection[int] = frozenset()
    stall_timeout: float | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    ranks_filter: Collection[int] | str | None = None
    stop_leader_first: bool = False
    collapse_identical_lines: float | None = None
    replace_lost_nodes: bool = True
    forward_signals: Collection[int] | str = ()
    options: GroupOptions | None = None
    _resolved: _Derived = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Each value through the parser the command line uses, so that a bad value reads
        # the same from aioelastic-run and from here.
        for name in ("min_nodes", "max_nodes", "nproc_per_node"):
            values.field(name, values.positive_int, getattr(self, name))
        values.field(
            "min_nodes, max_nodes",
            lambda pair: node_values.node_range(*pair),
            (self.min_nodes, self.max_nodes),
        )
        self._refuse_unsupported()
        self._check_rendezvous()
        if self.options is not None:
            # The record's values become the torch-named fields' (a conflict is an error).
            merged = GroupOptions.of(
                self._group_fields(), options=self.options, torch=True, caller="LaunchConfig"
            )
            for name, value in merged.given(torch=True).items():
                setattr(self, name, value)
        self.shutdown_timeout = values.field(
            "shutdown_timeout", node_values.shutdown_timeout, self.shutdown_timeout
        )
        values.field("role", values.name, self.role)
        if self.local_addr is not None:
            values.field("local_addr", node_values.host, self.local_addr)
        values.field("max_restarts", values.non_negative_int, self.max_restarts)
        values.field("monitor_interval", values.positive_duration, self.monitor_interval)
        self.no_retry_exit_codes = values.field(
            "no_retry_exit_codes", node_values.exit_codes, self.no_retry_exit_codes
        )
        # The agent's settings and the store address, checked now rather than at launch,
        # and kept: the launch reads them as they are (see _derived).
        self._resolved = self._derive()
        if not self.rdzv_endpoint.strip() and self.rdzv_backend != "c10d":
            raise ValueError(f"rdzv_backend={self.rdzv_backend!r} needs rdzv_endpoint='host:port'")
        if not self.rdzv_endpoint.strip() and self.max_nodes > 1:
            raise ValueError(
                f"max_nodes={self.max_nodes} needs rdzv_endpoint='host:port' where every "
                "node finds the rendezvous store"
            )

    def _refuse_unsupported(self) -> None:
        """torch's fields aioelastic does not implement: accepted only at their defaults."""
        unsupported = {
            "logs_specs": (self.logs_specs is not None, "use log_dir, redirects, tee"),
            "metrics_cfg": (bool(self.metrics_cfg), "aioelastic records no torch metrics"),
            "event_log_handler": (
                self.event_log_handler != "null",
                "subscribe to elastic_launch(...).events() instead",
            ),
            "numa_options": (self.numa_options is not None, "bind inside the worker"),
            "duplicate_stdout_filters": (self.duplicate_stdout_filters is not None, ""),
            "duplicate_stderr_filters": (self.duplicate_stderr_filters is not None, ""),
        }
        for name, (used, hint) in unsupported.items():
            if used:
                raise ValueError(
                    f"LaunchConfig.{name}={getattr(self, name)!r} is not supported by "
                    f"aioelastic{'; ' + hint if hint else ''}"
                )

    def _check_rendezvous(self) -> None:
        """The backend and its options, and the join timeout they give."""
        values.field("rdzv_backend", node_values.rdzv_backend, self.rdzv_backend)
        # Copied, not updated in place: the caller's dict may be shared between configs.
        # Checked against the backend's options now, not when the launch makes a handler.
        self.rdzv_configs = values.field(
            "rdzv_configs",
            lambda v: node_values.rdzv_conf(v, self.rdzv_backend),
            self.rdzv_configs,
        )
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = _DEFAULT_RDZV_TIMEOUT

    def _derived(self) -> _Derived:
        """The agent's settings and the store address; built again only after a change.

        A LaunchConfig is a plain, mutable dataclass as torch's is: a field set after
        construction (``config.nproc_per_node = 2``) must still be honoured, and checked.
        """
        resolved: _Derived | None = self.__dict__.get("_resolved")
        if resolved is None or resolved.inputs != self._inputs():
            resolved = self._resolved = self._derive()
        return resolved

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (or copied) without what it derived: that holds read-only mappings, which
        # do not pickle, and is built again where it is needed.
        state = dict(self.__dict__)
        state.pop("_resolved", None)
        return state

    def _group_fields(self) -> dict[str, Any]:
        """The group's options set in torch-named fields (those not at their default)."""
        return {
            name: getattr(self, name)
            for name in _GROUP_FIELDS
            if getattr(self, name) != _FIELD_DEFAULTS[name]
        }

    def _inputs(self) -> tuple[Any, ...]:
        return tuple(_snapshot(getattr(self, name)) for name in _DERIVED_FROM)

    def _derive(self) -> _Derived:
        """Parse what the agent reads, each value by its parser in `..._core.process._values`.

        Raises:
            ValueError, TypeError: a bad value, with the field's name.
        """
        endpoint = self.rdzv_endpoint
        store: tuple[str, int | None] | None = None
        if self.rdzv_backend == "static" and endpoint.strip():
            store = values.field(
                "rdzv_endpoint", lambda text: static_store(text, self.max_nodes), endpoint
            )
        else:
            values.field(
                "rdzv_endpoint",
                lambda text: node_values.endpoints(text, self.rdzv_backend),
                endpoint,
            )
        agent = AgentConfig.build(
            nprocs=self.nproc_per_node,
            start_method=self.start_method,
            exit_barrier_timeout=self.exit_barrier_timeout,
            signals_to_handle=self.signals_to_handle,
            metrics_port=self.metrics_port,
            metrics_host=self.metrics_host,
            replace_lost_nodes=self.replace_lost_nodes,
            options=self.options,
            # shutdown_timeout among them, resolved once (its environment) in __post_init__.
            **self._group_fields(),
        )
        return _Derived(self._inputs(), agent, store)


#: Each field's default: a group option at its default here is not given.
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}


def _entrypoint_name(entrypoint: Callable[..., Any] | str, args: list[Any]) -> str:
    """torch's rule: a function's name; for ``python`` the script; else the binary."""
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            # The stack hook's wrapper (see run.py) is not the user's script.
            names = [str(a) for a in args if not str(a).startswith("-")]
            names = [n for n in names if n not in stack_hook.MODULES]
            return names[0] if names else ""
        return entrypoint
    return str(getattr(entrypoint, "__name__", repr(entrypoint)))


class elastic_launch:  # torch's lower-case name, so that a port is a one-line change
    """Launch an agent on this node for ``entrypoint``; awaiting the call runs it.

    Args:
        config: the `LaunchConfig`.
        entrypoint: a picklable function, or a binary (``sys.executable`` for scripts).

    Example::

        outputs = await elastic_launch(config, train)(lr, epochs)
        outputs[0]  # global rank 0's return value
    """

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str) -> None:
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"config must be a LaunchConfig, got {type(config).__name__}")
        if not (isinstance(entrypoint, str) and entrypoint) and not callable(entrypoint):
            raise TypeError(f"entrypoint must be a function or a binary's path, got {entrypoint!r}")
        self._config = config
        self._entrypoint = entrypoint
        self._hub = EventHub()

    def events(self) -> EventStream:
        """Subscribe to the agent's lifecycle events (call before awaiting the launch)."""
        return self._hub.subscribe()

    async def __call__(self, *args: Any) -> dict[int, Any]:
        """Run the agent with ``args`` for every worker.

        Returns:
            ``{global_rank: return value}`` for this node's workers (``None`` for binaries).

        Raises:
            ChildFailedError: the run failed; failures keyed by global rank.
            SignalReceived: a handled signal stopped it (``exit_code`` is ``128 + N``).
            RendezvousError: torch's, when the rendezvous fails.
        """
        return await launch_agent(self._config, self._entrypoint, list(args), _hub=self._hub)


async def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
    *,
    _hub: EventHub | None = None,
) -> dict[int, Any]:
    """torch's ``launch_agent``: what `elastic_launch` runs. See `elastic_launch`."""
    require_asyncio("elastic_launch")
    if config.log_dir is not None:
        # Before the rendezvous: peers would otherwise meet a node that then fails.
        values.field("log_dir", values.log_dir, config.log_dir)
    derived = config._derived()
    endpoint = config.rdzv_endpoint.strip()
    master_addr, master_port = derived.store or (None, None)
    handler: RendezvousHandler | None = None
    # torchrun's --standalone (LaunchConfig allows no endpoint for one node only): the
    # agent makes that rendezvous itself, and without torch when it can.
    run_id = config.run_id or str(uuid.uuid4() if not endpoint else uuid.uuid4().int)
    if endpoint and not (config.rdzv_backend == "static" and config.max_nodes == 1):
        # A single static node meets nobody: the agent's torch-free LocalRendezvous.
        handler = await create_rdzv_handler(
            config.rdzv_backend,
            endpoint,
            run_id,
            config.min_nodes,
            config.max_nodes,
            local_addr=config.local_addr,
            **config.rdzv_configs,
        )
    shutdown_rdzv = handler is not None
    try:
        result = await _run_agent(
            config, derived.agent, entrypoint, args, handler, run_id, master_addr, master_port, _hub
        )
    except (SignalReceived, anyio.get_cancelled_exc_class()):
        # As torch: a node stopped from outside leaves the rendezvous open, so that the
        # job can go on with the other nodes (and a join may still be in flight).
        shutdown_rdzv = False
        raise
    finally:
        if handler is not None:
            if shutdown_rdzv:
                await Rendezvous(handler, owned=True).aclose()
            # torch's handler sits in reference cycles, so the TCPStore it hosts (and its
            # port) would outlive this launch until the cycle collector happens to run: a
            # second launch of the same config would then join the old, closed rendezvous.
            handler = None
            gc.collect()
    if result.is_failed():
        # Raised here, not in _run_agent: a traceback through the agent's frames would
        # keep the handler and its store alive for as long as the error is kept.
        raise ChildFailedError(name=_entrypoint_name(entrypoint, args), failures=result.failures)
    return result.return_values


async def _run_agent(
    config: LaunchConfig,
    agent_config: AgentConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
    handler: RendezvousHandler | None,
    run_id: str,
    master_addr: str | None,
    master_port: int | None,
    hub: EventHub | None,
) -> RunResult:
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        virtual_local_rank=config.virtual_local_rank,
        restart_backoff=config.restart_backoff,
        no_retry_exit_codes=config.no_retry_exit_codes,
    )
    agent = LocalElasticAgent(
        spec,
        _event_hub=hub,
        # Built once from the config; the agent reads it and parses nothing again.
        _config=dataclasses.replace(
            agent_config,
            run_id=run_id,
            log_dir=None if config.log_dir is None else Path(config.log_dir),
        ),
    )
    return await agent.run()
