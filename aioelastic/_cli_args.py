"""The command line of ``aioelastic-run``: torchrun's flags, defaults and ``PET_*`` overrides.

Every flag of torch 2.13's ``torchrun`` is accepted under the same names (dashed and
underscored spellings, short options), with the same defaults, and each can be set through
the environment as ``PET_<DEST>`` (``PET_NPROC_PER_NODE=4``), a value given on the command
line winning over the environment, as in torchrun. A handful of flags of our own follow
(marked in ``--help``). A torchrun flag we cannot honour is refused with a message when set
to anything but its default; nothing is silently ignored.

Parsing is split in two steps with no I/O and no torch in either: `parse_args` turns argv
into an `argparse.Namespace` whose values are already typed (each flag's text goes through
its parser in `._values`, the one the API uses too, so a bad value is argparse's usage
error, exit 2), `plan_from_args` checks the combinations and resolves torchrun's rules
(``--standalone``, the implicit single-node rendezvous, python vs ``--no-python`` vs
``--module``) into a `LaunchPlan`. Only ``--nproc-per-node auto|gpu|xpu|<device>`` imports
torch, since only torch can count accelerators.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from . import _values as values
from ._std import Std, to_map
from ._values import cli_type

__all__ = [
    "FLAGS",
    "Flag",
    "LaunchPlan",
    "build_parser",
    "parse_args",
    "plan_from_args",
    "resolve_nproc_per_node",
    "usage_error",
]

ENV_PREFIX = "PET_"
"""torchrun's prefix for flag overrides in the environment: ``PET_<DEST>``."""

TORCH_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
"""Where torchrun reads its (flag-less) log line prefix template from."""

TORCH_SHUTDOWN_ENV = values.SHUTDOWN_TIMEOUT_ENV
PREFIX_FIELDS = values.PREFIX_FIELDS


def _endpoint_text(text: str) -> str:
    """``--rdzv-endpoint``: checked by the one endpoint parser, kept as text for torch."""
    values.endpoint(text)
    return text.strip()


def _signals_text(text: str) -> str:
    """``--signals-to-handle``: checked now, kept as text (exported to workers as given)."""
    values.signals(text)
    return text


def _switch(value: str) -> bool:
    """torch's ``check_env`` reads ``bool(int(value))``; words are accepted too."""
    text = value.strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off", ""):
        return False
    return bool(int(text))


@dataclass(frozen=True)
class Flag:
    """One command-line option: its spellings, conversion, default and help.

    Attributes:
        names: every spelling, e.g. ``("--nproc-per-node", "--nproc_per_node")``; the first
            long one names the destination (``nproc_per_node``) and the environment
            variable (``PET_NPROC_PER_NODE``), as in torchrun.
        convert: turns the text into the value; ``None`` for a switch (no value).
        default: the value when neither the command line nor the environment sets it.
        help: the ``--help`` text.
        ours: not a torchrun flag (marked as such in ``--help``).
        refused: why a value other than the default cannot be honoured; set for the torchrun
            flags we accept only at their default.
        choices: the accepted values, if limited.
        metavar: how the value is shown in ``--help``.
    """

    names: tuple[str, ...]
    convert: Callable[[str], Any] | None
    default: Any
    help: str
    ours: bool = False
    refused: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """The attribute name on the parsed namespace (argparse's rule)."""
        long = next(n for n in self.names if n.startswith("--"))
        return long[2:].replace("-", "_")

    @property
    def env_var(self) -> str:
        """The environment variable that overrides the default (``PET_<DEST>``)."""
        return ENV_PREFIX + self.dest.upper()

    @property
    def is_switch(self) -> bool:
        """Whether the flag takes no value."""
        return self.convert is None


def _both(name: str) -> tuple[str, ...]:
    """torchrun's spellings of a multi-word flag: dashed first, then underscored."""
    underscored = name.replace("-", "_")
    return (f"--{name}", f"--{underscored}") if underscored != name else (f"--{name}",)


FLAGS: tuple[Flag, ...] = (
    # -- sizes ------------------------------------------------------------------------
    Flag(
        _both("nnodes"),
        cli_type(values.nnodes, "N|MIN:MAX"),
        "1:1",
        "Number of nodes, or the range of nodes as MIN:MAX.",
        metavar="N|MIN:MAX",
    ),
    Flag(
        _both("nproc-per-node"),
        str,
        "1",
        "Workers per node: an int, 'cpu' (usable cores), or 'auto' (accelerators if any, "
        "else cores); 'auto', 'gpu' and 'xpu' import torch to count devices.",
        metavar="N|auto|cpu|gpu|xpu",
    ),
    # -- rendezvous -------------------------------------------------------------------
    Flag(_both("rdzv-backend"), str, "static", "Rendezvous backend (static, c10d, etcd, ...)."),
    Flag(
        _both("rdzv-endpoint"),
        cli_type(_endpoint_text, "HOST[:PORT]"),
        "",
        "Rendezvous endpoint, usually HOST:PORT.",
        metavar="HOST[:PORT]",
    ),
    Flag(_both("rdzv-id"), str, "none", "Job id shared by every node of the job."),
    Flag(
        _both("rdzv-conf"),
        cli_type(values.rdzv_conf, "K=V,..."),
        "",
        "Rendezvous options, KEY=VALUE,KEY=VALUE (e.g. join_timeout=60).",
        metavar="K=V,...",
    ),
    Flag(
        ("--standalone",),
        None,
        False,
        "Single-node job with a private rendezvous on a free port and a fresh job id; the "
        "rendezvous flags are ignored (as in torchrun).",
    ),
    # -- running the workers ----------------------------------------------------------
    Flag(
        _both("max-restarts"),
        cli_type(values.non_negative_int, "N"),
        0,
        "Worker group restarts allowed before failing.",
    ),
    Flag(
        _both("monitor-interval"),
        cli_type(values.positive_duration, "SECONDS"),
        0.1,
        "How often to check for nodes waiting to join; worker exits are acted on when the "
        "kernel reports them, never polled.",
        metavar="SECONDS",
    ),
    Flag(
        _both("start-method"),
        cli_type(values.start_method, "METHOD"),
        "spawn",
        "How workers are made with --run-path (scripts always start as new processes).",
        choices=values.START_METHODS,
    ),
    Flag(
        _both("event-log-handler"),
        str,
        "null",
        "torch's event log handler; only 'null' (aioelastic-run logs its own events).",
        refused="torch's event log handlers are not supported; aioelastic-run logs the "
        "agent's lifecycle itself (use --event-log-handler null, the default)",
    ),
    Flag(_both("role"), cli_type(values.name, "NAME"), "default", "Role name of the workers."),
    Flag(
        ("-m", "--module"),
        None,
        False,
        "Run the script as a module, like 'python -m'.",
    ),
    Flag(
        _both("no-python"),
        None,
        False,
        "Run the script directly instead of through 'python' (any executable).",
    ),
    Flag(
        _both("run-path"),
        None,
        False,
        "Run the script with runpy.run_path in a worker interpreter made by --start-method "
        "(an absolute path). Takes precedence over --no-python.",
    ),
    Flag(
        _both("log-dir"),
        str,
        None,
        "Base directory for log files; each run gets its own sub-directory "
        "'<rdzv-id>_<random>' there, so it can be reused across runs.",
        metavar="DIR",
    ),
    Flag(
        ("-r", "--redirects"),
        cli_type(Std.from_str, "STD"),
        "0",
        "Streams written to files in the log directory: 0 none, 1 stdout, 2 stderr, 3 both; "
        "or per local rank, e.g. 0:3,1:0.",
        metavar="STD",
    ),
    Flag(
        ("-t", "--tee"),
        cli_type(Std.from_str, "STD"),
        "0",
        "Streams written to files and also to the console with a rank prefix "
        "(same format as --redirects).",
        metavar="STD",
    ),
    Flag(
        _both("local-ranks-filter"),
        cli_type(values.rank_filter, "RANKS"),
        "",
        "Local ranks whose output is shown on the console (e.g. 0,1); the others still "
        "go to their log files, and their failures are still reported in full.",
        metavar="RANKS",
    ),
    Flag(
        _both("duplicate-stdout-filters"),
        str,
        "",
        "Not supported (torch copies matching stdout lines to an extra file).",
        refused="duplicating filtered output lines to an extra file is not supported; "
        "filter the log files afterwards (grep) instead",
        metavar="FILTERS",
    ),
    Flag(
        _both("duplicate-stderr-filters"),
        str,
        "",
        "Not supported (torch copies matching stderr lines to an extra file).",
        refused="duplicating filtered output lines to an extra file is not supported; "
        "filter the log files afterwards (grep) instead",
        metavar="FILTERS",
    ),
    # -- static rendezvous (torch.distributed.launch compatibility) -------------------
    Flag(
        _both("node-rank"),
        cli_type(values.non_negative_int, "N"),
        0,
        "Rank of this node (static rendezvous only).",
    ),
    Flag(
        _both("master-addr"),
        str,
        "127.0.0.1",
        "Address of node rank 0 (static rendezvous only).",
        metavar="ADDR",
    ),
    Flag(
        _both("master-port"),
        cli_type(values.port, "PORT"),
        None,
        "Port on node rank 0 (static rendezvous only); a free port for a single-node job.",
        metavar="PORT",
    ),
    Flag(
        _both("local-addr"),
        str,
        None,
        "This node's address as its peers should see it (default: its FQDN).",
        metavar="ADDR",
    ),
    Flag(
        _both("logs-specs"),
        str,
        None,
        "Not supported (torch's LogsSpecs plugins).",
        refused="torch's LogsSpecs plugins (torchrun.logs_specs entry points) are not "
        "supported; use --log-dir, --redirects, --tee and --log-line-prefix-template",
        metavar="NAME",
    ),
    Flag(
        _both("numa-binding"),
        str,
        None,
        "Not supported (binds workers to CPUs near their GPU).",
        refused="NUMA binding of GPU workers is not supported; bind inside the script "
        "(os.sched_setaffinity) or run torchrun",
        metavar="MODE",
    ),
    Flag(
        _both("signals-to-handle"),
        cli_type(_signals_text, "SIG,..."),
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "Signals that stop the job: the workers get SIGTERM and --shutdown-timeout seconds "
        "before SIGKILL; a second signal kills at once. Exit status 128+N for signal N.",
        metavar="SIG,...",
    ),
    Flag(
        _both("shutdown-timeout"),
        cli_type(values.duration, "SECONDS"),
        None,
        f"Seconds between the stop signal and SIGKILL (default: ${TORCH_SHUTDOWN_ENV} or 30).",
        metavar="SECONDS",
    ),
    Flag(
        _both("virtual-local-rank"),
        None,
        False,
        "LOCAL_RANK=0 for every worker, CUDA_VISIBLE_DEVICES narrowed to its own device.",
    ),
    # -- ours -------------------------------------------------------------------------
    Flag(
        ("--log-line-prefix-template",),
        cli_type(values.prefix_template, "TEMPLATE"),
        None,
        "Prefix of tee'd console lines, with ${role_name} ${rank} ${local_rank} "
        f"${{hostname}} (default: ${TORCH_PREFIX_ENV}, as torchrun, else "
        "'[<role><local_rank>]:').",
        ours=True,
        metavar="TEMPLATE",
    ),
    Flag(
        ("--restart-backoff",),
        cli_type(values.duration, "SECONDS"),
        0.0,
        "Seconds to wait before the first restart, doubled at each further restart (with "
        "jitter), up to --restart-backoff-max; 0 restarts at once, as torchrun.",
        ours=True,
        metavar="SECONDS",
    ),
    Flag(
        ("--restart-backoff-max",),
        cli_type(values.duration, "SECONDS"),
        60.0,
        "Longest wait between restarts.",
        ours=True,
        metavar="SECONDS",
    ),
    Flag(
        ("--preload",),
        cli_type(values.module_names, "MODULES"),
        "",
        "Modules (e.g. torch) imported once by a warm interpreter, which then forks every "
        "worker and runs the script in it as python would (same __main__, sys.argv, "
        "sys.path[0], exit codes, signals); restarts fork from it again. Not with "
        "--no-python.",
        ours=True,
        metavar="MODULES",
    ),
    Flag(
        ("--no-retry-exit-codes",),
        cli_type(values.exit_codes, "CODES"),
        "",
        "Worker exit codes that fail the job at once, restarts left or not (e.g. 2,3 for "
        "usage and configuration errors that a restart cannot fix).",
        ours=True,
        metavar="CODES",
    ),
    Flag(
        ("--stall-timeout",),
        cli_type(values.positive_duration, "SECONDS"),
        None,
        "Stop the workers as stalled when none wrote output or sent a timer request for "
        "this many seconds, with every rank's stack in the report (off by default).",
        ours=True,
        metavar="SECONDS",
    ),
    Flag(
        ("--metrics-port",),
        cli_type(values.port, "PORT"),
        None,
        "Serve Prometheus metrics (/metrics) and liveness (/health) on this port of "
        "--metrics-host; needs aioelastic[metrics].",
        ours=True,
        metavar="PORT",
    ),
    Flag(
        ("--metrics-host",),
        str,
        "127.0.0.1",
        "The address --metrics-port and TORCHELASTIC_HEALTH_CHECK_PORT bind.",
        ours=True,
        metavar="ADDRESS",
    ),
)

_BY_DEST = {flag.dest: flag for flag in FLAGS}


class _Parser(argparse.ArgumentParser):
    """argparse with our prog name; errors exit 2 with usage, like torchrun's."""


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser, with defaults taken from ``PET_*`` variables in ``environ``.

    Args:
        environ: the environment to read overrides from (default ``os.environ``).

    Returns:
        An ``argparse.ArgumentParser`` for ``aioelastic-run``.

    Raises:
        ValueError: a ``PET_*`` variable holds a value its flag does not accept (the
            message names the variable).
    """
    if environ is None:
        environ = os.environ
    parser = _Parser(
        prog="aioelastic-run",
        description="Launch a training script on one or more nodes: a drop-in replacement "
        "for torchrun (same flags, same defaults, same worker environment).",
        epilog=f"Every flag can also be set in the environment as {ENV_PREFIX}<FLAG>, e.g. "
        f"{ENV_PREFIX}NPROC_PER_NODE=4 (the command line wins). Flags marked [aioelastic] "
        "are not torchrun's. Exit status: 0 on success; the root cause's exit code when a "
        "worker fails (128+N when signal N killed it); 128+N when the launcher is stopped "
        "by signal N.",
    )
    for flag in FLAGS:
        default = _env_default(flag, environ)
        help_text = f"[aioelastic] {flag.help}" if flag.ours else flag.help
        help_text = help_text.replace("%", "%%")
        if flag.is_switch:
            parser.add_argument(
                *flag.names, dest=flag.dest, action="store_true", default=default, help=help_text
            )
        else:
            assert flag.convert is not None
            parser.add_argument(
                *flag.names,
                dest=flag.dest,
                type=flag.convert,
                default=default,
                choices=flag.choices,
                metavar=flag.metavar,
                help=help_text,
            )
    parser.add_argument(
        "training_script",
        help="The script (or module with -m, or executable with --no-python) every worker "
        "runs, followed by its own arguments.",
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _env_default(flag: Flag, environ: Mapping[str, str]) -> Any:
    raw = environ.get(flag.env_var)
    if flag.dest == "log_line_prefix_template" and raw is None:
        raw = environ.get(TORCH_PREFIX_ENV)
    if raw is None:
        return flag.default
    try:
        value: Any = _switch(raw) if flag.convert is None else flag.convert(raw)
    except (ValueError, argparse.ArgumentTypeError) as e:
        why = "not 0 or 1" if flag.is_switch else str(e)
        raise ValueError(
            f"{flag.env_var}={raw!r} (for {flag.names[0]}): {why}; fix or unset {flag.env_var}"
        ) from None
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(
            f"{flag.env_var}={raw!r} is not one of {', '.join(flag.choices)} "
            f"(for {flag.names[0]}); fix or unset {flag.env_var}"
        )
    return value


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse a command line (``sys.argv[1:]`` by default); exits 2 on a usage error.

    Args:
        argv: the arguments after the program name.
        environ: where ``PET_*`` overrides are read (default ``os.environ``).

    Returns:
        The namespace, one attribute per flag (see `FLAGS`) plus ``training_script`` and
        ``training_script_args``.
    """
    try:
        parser = build_parser(environ)
    except ValueError as e:
        # A bad PET_* variable: the usage of the parser without the environment.
        usage_error(str(e))
    return parser.parse_args(argv)


def usage_error(message: str) -> NoReturn:
    """Exit 2 with the usage line and ``message``, as argparse does for a bad flag.

    For the checks that involve several flags (made after parsing) and a bad ``PET_*``
    variable, so that every command-line mistake ends the same way.
    """
    build_parser({}).error(message)


@dataclass(frozen=True)
class LaunchPlan:
    """What to launch and how: the checked, resolved command line.

    Attributes:
        min_nodes: fewest nodes to start with.
        max_nodes: most nodes admitted.
        nproc_per_node: local workers per node.
        single_node: one node with no rendezvous to run: the workers' store is hosted by
            local rank 0 at ``master_addr:master_port`` and the launcher needs no torch.
            True for ``--standalone`` and for torchrun's implicit single-node case (static
            backend, one node).
        rdzv_backend: the rendezvous backend (for multi-node and explicit dynamic jobs).
        rdzv_endpoint: its endpoint (``master_addr:master_port`` for ``static``).
        run_id: the job id (a fresh uuid for ``--standalone`` / implicit single node).
        rdzv_configs: rendezvous options (``rank`` added for ``static``).
        node_rank: this node's rank for ``static``.
        master_addr: for ``static`` and single-node jobs.
        master_port: for ``static``; ``None`` picks a free port for a single-node job.
        local_addr: this node's address as peers see it.
        role: the workers' role name.
        max_restarts: group restarts allowed.
        monitor_interval: accepted for compatibility.
        start_method: for ``--run-path`` workers.
        log_dir: the base log directory, or ``None``.
        redirects: streams written to files (tee'd streams included, as in torchrun).
        tee: streams also shown on the console with a prefix.
        local_ranks_filter: ranks shown on the console, ``None`` for all.
        log_line_prefix_template: the tee prefix template, or ``None`` for the default.
        signals_to_handle: signals that stop the job.
        signals_to_handle_text: the same as given, exported to workers as torchrun does.
        shutdown_timeout: seconds between the stop signal and SIGKILL.
        restart_backoff: seconds before the first restart (0: at once).
        restart_backoff_max: longest wait between restarts.
        no_retry_exit_codes: exit codes that fail the job without a restart.
        virtual_local_rank: torch's virtual local rank mode.
        entrypoint: the program each worker runs (python, the executable, or for
            ``run_path`` the script path).
        args: its arguments.
        run_path: run ``entrypoint`` through ``runpy.run_path`` in a function worker.
        preload: modules a warm fork server imports; when set, ``entrypoint`` is the script
            (or module, see ``module``) that each worker forked from it runs as ``__main__``.
        module: the script is a module name (``-m``).
        warnings: things the user should know that do not stop the launch (as torchrun's
            log warnings).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    single_node: bool
    rdzv_backend: str
    rdzv_endpoint: str
    run_id: str
    rdzv_configs: dict[str, Any]
    node_rank: int
    master_addr: str
    master_port: int | None
    local_addr: str | None
    role: str
    max_restarts: int
    monitor_interval: float
    start_method: str
    log_dir: str | None
    redirects: Std | dict[int, Std]
    tee: Std | dict[int, Std]
    local_ranks_filter: frozenset[int] | None
    log_line_prefix_template: str | None
    signals_to_handle: tuple[signal.Signals, ...]
    signals_to_handle_text: str
    shutdown_timeout: float
    restart_backoff: float
    restart_backoff_max: float
    no_retry_exit_codes: frozenset[int]
    stall_timeout: float | None
    metrics_port: int | None
    metrics_host: str
    virtual_local_rank: bool
    entrypoint: str
    args: tuple[str, ...]
    run_path: bool
    warnings: tuple[str, ...]
    preload: tuple[str, ...] = ()
    module: bool = False


def plan_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    *,
    nproc_resolver: Callable[[str], int] | None = None,
) -> LaunchPlan:
    """Check the parsed flags and apply torchrun's rules; no I/O, no processes.

    Args:
        args: from `parse_args`.
        environ: read for ``PYTHON_EXEC`` and ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
            (default ``os.environ``).
        nproc_resolver: turns ``--nproc-per-node`` into a count (default
            `resolve_nproc_per_node`).

    Returns:
        The `LaunchPlan`.

    Raises:
        ValueError: an invalid value, a combination that cannot work, or a torchrun flag
            we cannot honour; the message names the flag and the fix.
    """
    if environ is None:
        environ = os.environ
    _refuse_unsupported(args)
    warnings: list[str] = []
    min_nodes, max_nodes = args.nnodes
    nnodes_text = f"{min_nodes}" if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
    nproc = (nproc_resolver or resolve_nproc_per_node)(args.nproc_per_node)

    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    if args.standalone:
        given = [
            f"{name}={value!r}"
            for name, value, default in (
                ("--rdzv-backend", backend, "static"),
                ("--rdzv-endpoint", endpoint, ""),
                ("--rdzv-id", run_id, "none"),
            )
            if value != default
        ]
        if given:
            warnings.append(
                f"--standalone ignores {', '.join(given)} (as torchrun does): the job "
                "runs on this node only"
            )
        if max_nodes != 1:
            raise ValueError(
                f"--standalone runs a single node, but --nnodes={nnodes_text}; drop "
                "--standalone and give a rendezvous (--rdzv-backend c10d --rdzv-endpoint "
                "HOST:PORT) for a multi-node job"
            )
    single_node = args.standalone or (backend == "static" and max_nodes == 1)
    if backend != "static" and not args.standalone and args.master_addr != "127.0.0.1":
        warnings.append(
            "--master-addr is only used with the static rendezvous backend; "
            f"--rdzv-backend={backend!r} ignores it (as torchrun does)"
        )
    if args.node_rank != 0 and (backend != "static" or args.standalone):
        warnings.append(
            f"--node-rank is only used with the static rendezvous backend; it is ignored "
            f"for --rdzv-backend={'c10d (--standalone)' if args.standalone else backend!r}"
        )
    elif args.node_rank >= max_nodes:
        raise ValueError(
            f"--node-rank={args.node_rank} is out of range for --nnodes={nnodes_text}: "
            f"node ranks are 0..{max_nodes - 1}"
        )
    if backend == "static" and not args.standalone and min_nodes != max_nodes:
        raise ValueError(
            f"the static rendezvous needs a fixed number of nodes, got --nnodes="
            f"{nnodes_text}; give --nnodes N, or use --rdzv-backend c10d for MIN:MAX"
        )

    rdzv_configs: dict[str, Any] = dict(args.rdzv_conf)
    master_addr, master_port = args.master_addr, args.master_port
    if single_node:
        # torchrun makes both --standalone and a bare single-node static run a private
        # c10d rendezvous on a free port with a fresh id. With one node there is nothing to
        # agree on, so we skip the rendezvous store (and torch) and let local rank 0 host
        # the workers' store, as a static job does; the ids stay fresh for each run.
        if args.standalone:
            master_addr, master_port, endpoint = "127.0.0.1", None, ""
            backend, run_id = "static", str(uuid.uuid4())
        elif endpoint:
            master_addr, master_port = values.endpoint(endpoint, master_port)
        elif master_port is None:
            run_id = str(uuid.uuid4())
        # Port 0 is any free port: with one node nobody else needs to know which.
        master_port = master_port or None
        rdzv_configs["rank"] = 0
    elif backend == "static":
        rdzv_configs["rank"] = args.node_rank
        if not endpoint:
            endpoint = f"{master_addr}:{29500 if master_port is None else master_port}"
        master_addr, master_port = values.endpoint(endpoint, master_port)
        if master_port is None or master_port == 0:
            raise ValueError(
                f"the static rendezvous of {nnodes_text} nodes needs a fixed port every node "
                f"can reach, got --rdzv-endpoint/--master-port {endpoint!r}; give HOST:PORT"
            )
    elif not endpoint:
        raise ValueError(
            f"--rdzv-backend={backend!r} needs --rdzv-endpoint HOST:PORT (the rendezvous "
            "store every node connects to)"
        )

    redirects, tee = args.redirects, args.tee
    for name, value in (("--redirects", redirects), ("--tee", tee)):
        try:
            to_map(value, nproc)
        except ValueError as e:
            raise ValueError(f"{name}: {e} (--nproc-per-node {nproc})") from None
    try:
        shutdown_timeout = values.shutdown_timeout(args.shutdown_timeout, environ)
    except ValueError as e:
        raise ValueError(f"--shutdown-timeout not given and {e}") from None
    if args.local_ranks_filter is not None:
        bad = sorted(rank for rank in args.local_ranks_filter if rank >= nproc)
        if bad:
            raise ValueError(
                f"--local-ranks-filter names local rank {bad[0]}, but there are local ranks "
                f"0..{nproc - 1} (--nproc-per-node {nproc})"
            )
    entrypoint, cmd_args = _command(args, environ)
    if args.preload:
        python = environ.get("PYTHON_EXEC")
        if python is not None and python != sys.executable:
            warnings.append(
                f"--preload forks workers from this launcher's interpreter "
                f"({sys.executable}); PYTHON_EXEC={python!r} is not used"
            )
    return LaunchPlan(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        single_node=single_node,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        run_id=run_id,
        rdzv_configs=rdzv_configs,
        node_rank=args.node_rank if backend == "static" else 0,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=args.local_addr,
        role=args.role,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=args.start_method,
        log_dir=args.log_dir,
        redirects=_union(redirects, tee, nproc),
        tee=tee,
        local_ranks_filter=args.local_ranks_filter,
        log_line_prefix_template=args.log_line_prefix_template,
        signals_to_handle=values.signals(args.signals_to_handle),
        signals_to_handle_text=args.signals_to_handle,
        shutdown_timeout=shutdown_timeout,
        restart_backoff=args.restart_backoff,
        restart_backoff_max=args.restart_backoff_max,
        no_retry_exit_codes=args.no_retry_exit_codes,
        stall_timeout=args.stall_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        virtual_local_rank=args.virtual_local_rank,
        entrypoint=entrypoint,
        args=cmd_args,
        run_path=args.run_path,
        warnings=tuple(warnings),
        preload=args.preload,
        module=args.module and not args.run_path,
    )


def _refuse_unsupported(args: argparse.Namespace) -> None:
    for flag in FLAGS:
        if flag.refused is None:
            continue
        value = getattr(args, flag.dest)
        if value != flag.default:
            raise ValueError(
                f"{flag.names[0]}={value!r} cannot be honoured by aioelastic-run: {flag.refused}"
            )


def resolve_nproc_per_node(text: str) -> int:
    """torchrun's ``--nproc-per-node``: an int, ``cpu``, ``auto``, ``gpu``, ``xpu``, or a device.

    ``cpu`` counts the cores this process may run on (its affinity mask, as torch does).
    The others import torch to count devices.

    Raises:
        ValueError: not a positive int or a known name, or the device type is absent.
    """
    value = text.strip()
    if value.lstrip("+-").isdigit():
        try:
            return values.positive_int(value)
        except ValueError as e:
            raise ValueError(f"--nproc-per-node: {e}") from None
    if value == "cpu":
        return _usable_cpus()
    if value in ("auto", "gpu", "xpu") or value.isidentifier():
        return _count_devices(value)
    raise ValueError(
        f"--nproc-per-node={text!r} is not supported: use an int, cpu, auto, gpu or xpu"
    )


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _count_devices(kind: str) -> int:
    """Ask torch how many devices of ``kind`` there are (torch imported here only)."""
    import torch

    if kind == "auto":
        if torch.accelerator.is_available():
            return int(torch.accelerator.device_count())
        return _usable_cpus()
    if kind == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("--nproc-per-node=gpu: CUDA is not available on this machine")
        return int(torch.cuda.device_count())
    if kind == "xpu":
        if not torch.xpu.is_available():
            raise ValueError("--nproc-per-node=xpu: XPU is not available on this machine")
        return int(torch.xpu.device_count())
    if kind == torch._C._get_privateuse1_backend_name():
        module = getattr(torch, kind)
        if not module.is_available():
            raise ValueError(f"--nproc-per-node={kind}: {kind} is not available")
        return int(module.device_count())
    raise ValueError(
        f"--nproc-per-node={kind!r} is not supported: use an int, cpu, auto, gpu or xpu"
    )


def _union(a: Std | dict[int, Std], b: Std | dict[int, Std], nproc: int) -> Std | dict[int, Std]:
    """Per-rank ``a | b``: torchrun writes tee'd streams to files too."""
    if isinstance(a, Std) and isinstance(b, Std):
        return a | b
    left, right = to_map(a, nproc), to_map(b, nproc)
    return {rank: left[rank] | right[rank] for rank in range(nproc)}


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """What each worker runs, by torchrun's rules (``-u`` keeps Python's output unbuffered)."""
    script: str = args.training_script
    rest = tuple(args.training_script_args)
    if args.run_path:
        if not os.path.isabs(script):
            raise ValueError(
                f"--run-path needs the script as an absolute path, got {script!r}; "
                f"use {os.path.abspath(script)!r}"
            )
        return script, rest
    if args.preload and not args.run_path:
        if args.no_python:
            raise ValueError(
                "--preload and --no-python cannot be used together: --preload forks Python "
                "workers from a warm interpreter, --no-python runs an executable; drop one"
            )
        return script, rest
    if args.no_python:
        if args.module:
            raise ValueError(
                "--no-python and --module (-m) cannot be used together: -m runs a Python "
                "module, --no-python runs an executable"
            )
        return script, rest
    python = environ.get("PYTHON_EXEC", sys.executable)
    module = ("-m",) if args.module else ()
    return python, ("-u", *module, script, *rest)
