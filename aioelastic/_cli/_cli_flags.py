"""The flags of ``aioelastic-run``: torchrun's, under its names and defaults, then ours.

Every flag of torch 2.13's ``torchrun`` is accepted under the same names (dashed and
underscored spellings, short options), with the same defaults, and each can be set through
the environment as ``PET_<DEST>`` (``PET_NPROC_PER_NODE=4``), a value given on the command
line winning over the environment, as in torchrun. A handful of flags of our own follow
(marked in ``--help``). A torchrun flag we cannot honour is refused with a message when set
to anything but its default; nothing is silently ignored.

Each flag's text goes through its parser in `.._core.process._values`, the one the API uses
too, so a bad value reads the same from the command line and from `LaunchConfig`. The table
is read by `._cli_parser` (argparse) and `._cli_plan` (the launch it describes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .._core.output._std import Std
from .._core.process import _values as values
from .._elastic.settings import _node_values as node_values

__all__ = ["ENV_PREFIX", "FLAGS", "TORCH_PREFIX_ENV", "Flag", "flag_for"]

ENV_PREFIX = "PET_"
"""torchrun's prefix for flag overrides in the environment: ``PET_<DEST>``."""

TORCH_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
"""Where torchrun reads its (flag-less) log line prefix template from."""

TORCH_SHUTDOWN_ENV = node_values.SHUTDOWN_TIMEOUT_ENV


_T = TypeVar("_T")


def cli_type(parse: Callable[[str], _T], metavar: str) -> Callable[[str], _T]:
    """``parse`` as an argparse ``type``: its message shown as is, after the flag's name.

    argparse turns a ValueError from ``type`` into a bare "invalid value"; an
    ArgumentTypeError keeps our message, and argparse adds the usage line and exits 2.
    """
    import argparse  # only the command line needs it; the API path stays lighter

    def convert(text: str) -> _T:
        try:
            return parse(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = metavar
    return convert


def _endpoint_text(text: str) -> str:
    """``--rdzv-endpoint``: checked by the one endpoint parser, kept as text for torch.

    A list (the etcd backends' members) is checked member by member here, and against
    the backend once it is known. A port alone (``:29400``) is for a SLURM step, whose
    first host is the host (`.schedulers._derive`).
    """
    checked = f"localhost{text.strip()}" if text.strip().startswith(":") else text
    node_values.endpoints(checked, next(iter(node_values.LIST_ENDPOINT_BACKENDS)))
    return text.strip()


def _log_dir_text(text: str) -> str:
    """``--log-dir``: checked by the one log directory parser, kept as text."""
    values.log_dir(text)
    return text


def _signals_text(text: str) -> str:
    """``--signals-to-handle``: checked now, kept as text (exported to workers as given)."""
    node_values.signals(text)
    return text


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
        also_default: values of a refused flag that mean what its default does, so they are
            honoured too (``--logs-specs default``).
        choices: the accepted values, if limited.
        metavar: how the value is shown in ``--help``.
    """

    names: tuple[str, ...]
    convert: Callable[[str], Any] | None
    default: Any
    help: str
    ours: bool = False
    refused: str | None = None
    also_default: tuple[str, ...] = ()
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
        cli_type(node_values.nnodes, "N|MIN:MAX"),
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
    Flag(
        _both("rdzv-backend"),
        cli_type(node_values.rdzv_backend, "BACKEND"),
        "static",
        "Rendezvous backend (static, c10d, etcd, ...).",
    ),
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
        cli_type(node_values.rdzv_conf, "K=V,..."),
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
        cli_type(_log_dir_text, "DIR"),
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
        ("--ranks-filter",),
        cli_type(values.global_rank_filter, "RANKS"),
        "",
        "Global ranks whose output is shown on the console, on every node (e.g. 0,8-15); "
        "the others still go to their log files, and their failures are still reported "
        "in full. With --local-ranks-filter too, a rank is shown when both allow it.",
        ours=True,
        metavar="RANKS",
    ),
    Flag(
        ("--collapse-identical-lines",),
        cli_type(values.collapse_window, "SECONDS"),
        None,
        "Print a console line that several local ranks write identically within SECONDS "
        "(e.g. 0.25) once, as '[ranks 0-7]: text'; each rank's lines keep their order, and "
        "log files keep every copy (off by default: every copy, as torchrun).",
        ours=True,
        metavar="SECONDS",
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
        cli_type(node_values.host, "ADDR"),
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
        cli_type(node_values.host, "ADDR"),
        None,
        "This node's address as its peers should see it (default: its FQDN).",
        metavar="ADDR",
    ),
    Flag(
        _both("logs-specs"),
        str,
        None,
        "Only 'default': torch's DefaultLogsSpecs, the log layout aioelastic-run writes "
        "anyway; other LogsSpecs plugins are refused.",
        refused="only 'default' (torch's DefaultLogsSpecs) is supported: aioelastic-run "
        "writes the logs itself, in DefaultLogsSpecs' layout, and cannot hand them to a "
        "LogsSpecs plugin (torchrun.logs_specs entry point); drop --logs-specs and use "
        "--log-dir, --redirects, --tee and --log-line-prefix-template",
        also_default=("default",),
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
        cli_type(node_values.exit_codes, "CODES"),
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
        "this many seconds, with every rank's stack in the report; before they stop, the "
        "stacks of every rank of every node are printed, grouped (off by default).",
        ours=True,
        metavar="SECONDS",
    ),
    Flag(
        ("--stop-leader-first",),
        None,
        False,
        "Stop each worker before its helpers: the stop signal (a failure, a handled signal, "
        "a restart) goes to the worker alone, so that its children (data-loader processes) "
        "keep running while it checkpoints; once it exited the rest of its process group "
        "gets the signal, and whatever is left after --shutdown-timeout is SIGKILLed. "
        "Without it the whole group gets the signal at once, as torchrun does.",
        ours=True,
    ),
    Flag(
        ("--lost-node",),
        str,
        "wait",
        "What the surviving nodes do when a lost node leaves fewer than --nnodes' minimum: "
        "'wait' for a launcher to replace it, up to the rendezvous' join timeout (torch's "
        "way; right where a restarted pod or a spare can come), or 'end' the job at once, "
        "naming the lost node (where nothing can come back, as in a SLURM step: the "
        "scheduler can then requeue the job).",
        ours=True,
        choices=("wait", "end"),
        metavar="{wait,end}",
    ),
    Flag(
        ("--forward-signals",),
        cli_type(values.forwarded_signals, "SIG,..."),
        "",
        "Signals passed on to every worker, the job going on (e.g. USR1,USR2 for a "
        "scheduler's checkpoint request): each running worker's process gets it, and one "
        "that does not handle it dies of it, a worker failure. None by default; SIGUSR1 "
        "and SIGUSR2 then never end the launcher. Not a signal of --signals-to-handle. "
        "See docs/signals.md.",
        ours=True,
        metavar="SIG,...",
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
        cli_type(node_values.host, "ADDRESS"),
        "127.0.0.1",
        "The address --metrics-port and TORCHELASTIC_HEALTH_CHECK_PORT bind.",
        ours=True,
        metavar="ADDRESS",
    ),
)

_BY_DEST = {flag.dest: flag for flag in FLAGS}


def flag_for(dest: str) -> Flag:
    """The flag whose parsed value is ``dest`` (``"nproc_per_node"``).

    Raises:
        KeyError: no such flag.
    """
    return _BY_DEST[dest]
