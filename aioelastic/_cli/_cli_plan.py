"""From parsed flags to a launch: torchrun's rules, the public `LaunchConfig`, the command.

`config_from_args` (torchrun's own name for this step) checks what only a combination of
flags can get wrong, applies torchrun's rules (``--standalone``, the implicit single-node
rendezvous, python vs ``--no-python`` vs ``--module`` vs ``--run-path``) and builds the
public `LaunchConfig`, whose own checks parse each value with the parser the API uses, plus
a `CommandLine` for what is not a `LaunchConfig` field. An error of `LaunchConfig` is told
in the command line's words: ``argument --tee: <the same message>``. No I/O, no processes;
only ``--nproc-per-node auto|gpu|xpu|<device>`` imports torch, since only torch can count
accelerators.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._core.child import _stack_hook as stack_hook
from .._core.group._options import GroupOptions, option_names
from .._core.output._std import Std, to_map
from .._core.process import _values as values
from .._elastic.agent._types import RestartBackoff
from .._elastic.launch._elastic_launch import LaunchConfig
from .._elastic.settings import _node_values as node_values
from ._cli_flags import FLAGS, flag_for

__all__ = ["CommandLine", "config_from_args", "resolve_nproc_per_node"]

# LaunchConfig's fields whose flag has another name; the others are spelled alike.
_FLAG_OF_FIELD = {
    "min_nodes, max_nodes": "nnodes",
    "min_nodes": "nnodes",
    "max_nodes": "nnodes",
    "rdzv_configs": "rdzv_conf",
    "run_id": "rdzv_id",
    "forkserver_preload": "preload",
}

# torchrun's port for the static rendezvous when neither --rdzv-endpoint nor --master-port
# gives one.
_TORCHRUN_MASTER_PORT = 29500


@dataclass(frozen=True)
class CommandLine:
    """What ``aioelastic-run`` runs and tells, besides its `LaunchConfig`.

    Attributes:
        entrypoint: the program each worker runs (python, the executable, or for
            ``run_path`` the script path; under ``preload`` the script or module).
        args: its arguments.
        run_path: run ``entrypoint`` through ``runpy.run_path`` in a function worker.
        module: the script is a module name (``-m``).
        preload: modules a warm fork server imports; every worker is forked from it and
            runs ``entrypoint`` as ``__main__``.
        log_dir: the base ``--log-dir``: each run gets its own sub-directory there; None
            for a temporary one.
        warnings: what the user should know that does not stop the launch (as torchrun's
            log warnings).
        notes: what the launcher tells at its start besides: the flags a scheduler's
            environment gave (a SLURM step, a Kubernetes pod).
    """

    entrypoint: str
    args: tuple[str, ...]
    run_path: bool = False
    module: bool = False
    preload: tuple[str, ...] = ()
    log_dir: str | None = None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def target(self) -> tuple[Callable[..., Any] | str, tuple[str, ...]]:
        """The entrypoint and arguments for ``elastic_launch(config, entrypoint)(*args)``."""
        if self.preload:
            from .._core.child._script import ScriptRun

            return ScriptRun(self.entrypoint, self.module), self.args
        if self.run_path:
            from .._core.child._script import run_script_path

            return run_script_path, (self.entrypoint, *self.args)
        if self.entrypoint == sys.executable and self.args[:1] == ("-u",):
            # Our own interpreter: run the script through the stack hook (docs/hangs.md),
            # which registers the handler answering stack requests, then runs it as
            # `python -u` would. Another interpreter (PYTHON_EXEC) may lack aioelastic.
            return self.entrypoint, ("-u", "-m", stack_hook.MODULE, *self.args[1:])
        return self.entrypoint, self.args


@dataclass(frozen=True)
class _Rendezvous:
    """Where the nodes meet, by torchrun's rules: `LaunchConfig`'s rendezvous fields."""

    backend: str
    endpoint: str
    run_id: str
    configs: dict[str, Any]
    #: The static backend (a fixed set of nodes, the store at a known address).
    static: bool


def config_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    *,
    nproc_resolver: Callable[[str], int] | None = None,
) -> tuple[LaunchConfig, CommandLine]:
    """The launch the parsed flags describe, by torchrun's rules; no I/O, no processes.

    Args:
        args: from `parse_args`.
        environ: read for ``PYTHON_EXEC`` (default ``os.environ``); `LaunchConfig`
            reads ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` from ``os.environ`` itself.
        nproc_resolver: turns ``--nproc-per-node`` into a count (default
            `resolve_nproc_per_node`).

    Returns:
        The `LaunchConfig` (its ``log_dir`` None: the launcher makes one per run under
        `CommandLine.log_dir`) and the `CommandLine`.

    Raises:
        ValueError, TypeError: an invalid value, a combination that cannot work, or a
            torchrun flag we cannot honour; the message names the flag and the fix.
    """
    if environ is None:
        environ = os.environ
    _refuse_unsupported(args)
    derived = getattr(args, "derived", None)
    warnings: list[str] = [] if derived is None else list(derived.warnings)
    nproc = (nproc_resolver or resolve_nproc_per_node)(args.nproc_per_node)
    rdzv = _rendezvous(args, _check_nodes(args, warnings), warnings)
    options = _group_options(args, nproc)
    command = _command(args, environ)
    if args.preload:
        python = environ.get("PYTHON_EXEC")
        if python is not None and python != sys.executable:
            warnings.append(
                f"--preload forks workers from this launcher's interpreter "
                f"({sys.executable}); PYTHON_EXEC={python!r} is not used"
            )
    return _launch_config(args, nproc, rdzv, options), CommandLine(
        entrypoint=command[0],
        args=command[1],
        run_path=args.run_path,
        module=args.module and not args.run_path,
        preload=args.preload,
        log_dir=args.log_dir,
        warnings=tuple(warnings),
        notes=() if derived is None or derived.note is None else (derived.note,),
    )


def _nnodes_text(args: argparse.Namespace) -> str:
    """``--nnodes`` as given: ``N`` or ``MIN:MAX``."""
    min_nodes, max_nodes = args.nnodes
    return f"{min_nodes}" if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"


def _check_nodes(args: argparse.Namespace, warnings: list[str]) -> bool:
    """Check what the node flags say together; whether the rendezvous is static.

    Raises:
        ValueError: a combination that cannot work, naming the flags.
    """
    min_nodes, max_nodes = args.nnodes
    backend = args.rdzv_backend
    if args.standalone:
        given = [
            f"{name}={value!r}"
            for name, value, default in (
                ("--rdzv-backend", backend, "static"),
                ("--rdzv-endpoint", args.rdzv_endpoint, ""),
                ("--rdzv-id", args.rdzv_id, "none"),
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
                f"--standalone runs a single node, but --nnodes={_nnodes_text(args)}; drop "
                "--standalone and give a rendezvous (--rdzv-backend c10d --rdzv-endpoint "
                "HOST:PORT) for a multi-node job"
            )
    static = backend == "static" and not args.standalone
    if not static and args.master_addr != "127.0.0.1" and not args.standalone:
        warnings.append(
            "--master-addr is only used with the static rendezvous backend; "
            f"--rdzv-backend={backend!r} ignores it (as torchrun does)"
        )
    if args.node_rank != 0 and not static:
        warnings.append(
            f"--node-rank is only used with the static rendezvous backend; it is ignored "
            f"for --rdzv-backend={'c10d (--standalone)' if args.standalone else backend!r}"
        )
    elif args.node_rank >= max_nodes:
        raise ValueError(
            f"--node-rank={args.node_rank} is out of range for --nnodes={_nnodes_text(args)}: "
            f"node ranks are 0..{max_nodes - 1}"
        )
    if static and min_nodes != max_nodes:
        raise ValueError(
            f"the static rendezvous needs a fixed number of nodes, got --nnodes="
            f"{_nnodes_text(args)}; give --nnodes N, or use --rdzv-backend c10d for MIN:MAX"
        )
    return static


def _rendezvous(args: argparse.Namespace, static: bool, warnings: list[str]) -> _Rendezvous:
    """The rendezvous by torchrun's rules, its options checked for the backend that reads them.

    Raises:
        ValueError, TypeError: no endpoint where one is needed, or a bad ``--rdzv-conf``.
    """
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    configs: dict[str, Any] = dict(args.rdzv_conf)
    single = args.nnodes[1] == 1
    if args.standalone or (static and single and not endpoint and args.master_port is None):
        # torchrun makes both --standalone and a bare single-node static run a private
        # c10d rendezvous on a free port with a fresh id: LaunchConfig's standalone launch
        # (no endpoint), which with one node skips the rendezvous store and torch, and
        # lets local rank 0 host the workers' store on a free port.
        backend, endpoint, run_id = "c10d", "", str(uuid.uuid4())
    elif static:
        # Where the store is, as torchrun's get_rdzv_endpoint: the endpoint, else
        # --master-addr:--master-port. What the endpoint then means is static_store's rule.
        configs["rank"] = args.node_rank
        if not endpoint:
            port = _TORCHRUN_MASTER_PORT if args.master_port is None else args.master_port
            endpoint = f"{args.master_addr}:{port}"
    elif not endpoint:
        raise ValueError(
            f"--rdzv-backend={backend!r} needs --rdzv-endpoint HOST:PORT (the rendezvous "
            "store every node connects to)"
        )
    if endpoint.startswith(":"):
        raise ValueError(
            f"argument {_names('rdzv_endpoint')}: {endpoint!r} gives a port alone, whose "
            "host only a SLURM step names (its first node); give HOST:PORT"
        )
    # The options given, checked now for the backend that will read them (c10d for a single
    # node, as in torchrun): torch refuses a bad one only once its store is up, as a
    # launcher failure, and ignores a misspelt one.
    try:
        node_values.rdzv_options(backend, args.rdzv_conf)
    except (ValueError, TypeError) as e:
        raise type(e)(f"argument {_names('rdzv_conf')}: {e}") from None
    read = node_values.RDZV_OPTIONS.get(backend)
    if read is not None and "timeout" in args.rdzv_conf and "timeout" not in read:
        warnings.append(
            f"--rdzv-conf timeout={args.rdzv_conf['timeout']} is ignored by the {backend} "
            "rendezvous backend (as in torchrun); its wait for nodes is join_timeout"
        )
    return _Rendezvous(backend, endpoint, run_id, configs, static)


def _group_options(args: argparse.Namespace, nproc: int) -> GroupOptions:
    """The group's options from their flags, checked for ``nproc`` local ranks.

    Each option's flag is its torch name (`GroupOptions`' table); a flag left unset
    leaves the option at its default (the shutdown timeout then comes from the
    environment, in `LaunchConfig`). Tee'd streams are written to files too, as torchrun
    does.
    """
    given = {}
    for name in option_names(torch=True):
        value = getattr(args, _FLAG_OF_FIELD.get(name, name))
        if value is not None:
            given[name] = value
    try:
        options = GroupOptions.of(given, torch=True)
        options.for_ranks(nproc)
    except (ValueError, TypeError) as e:
        raise type(e)(_in_flag_words(str(e), {})) from None
    return dataclasses.replace(options, redirects=_union(options.redirects, options.tee, nproc))


def _launch_config(
    args: argparse.Namespace, nproc: int, rdzv: _Rendezvous, options: GroupOptions
) -> LaunchConfig:
    """The `LaunchConfig`; its errors told in the command line's words."""
    backoff = (
        RestartBackoff(
            initial=args.restart_backoff,
            maximum=max(args.restart_backoff, args.restart_backoff_max),
        )
        if args.restart_backoff > 0
        else None
    )
    try:
        return LaunchConfig(
            min_nodes=args.nnodes[0],
            max_nodes=args.nnodes[1],
            nproc_per_node=nproc,
            run_id=rdzv.run_id,
            role=args.role,
            rdzv_endpoint=rdzv.endpoint,
            rdzv_backend=rdzv.backend,
            rdzv_configs=rdzv.configs,
            max_restarts=args.max_restarts,
            monitor_interval=args.monitor_interval,
            # --preload: every worker is forked from the warm server and runs the script.
            start_method="forkserver" if args.preload else args.start_method,
            local_addr=args.local_addr,
            signals_to_handle=args.signals_to_handle,
            virtual_local_rank=args.virtual_local_rank,
            restart_backoff=backoff,
            no_retry_exit_codes=args.no_retry_exit_codes,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            replace_lost_nodes=args.lost_node == "wait",
            # No shutdown timeout given: LaunchConfig reads $TORCH_ELASTIC_SHUTDOWN_TIMEOUT
            # (there only).
            options=options,
        )
    except (ValueError, TypeError) as e:
        # The endpoint made of --master-addr:--master-port is told as theirs.
        composed = rdzv.static and not args.rdzv_endpoint
        raise type(e)(
            _in_flag_words(str(e), {"rdzv_endpoint": "master_port"} if composed else {})
        ) from None


def _names(dest: str) -> str:
    """A flag as argparse names it in an error: every spelling, ``--tee/-t`` style."""
    return "/".join(flag_for(dest).names)


def _in_flag_words(message: str, flag_of_field: Mapping[str, str]) -> str:
    """A `LaunchConfig` error (``field: why``) as argparse words it (``argument --flag: why``).

    Args:
        message: the error's text.
        flag_of_field: where a field's value came from another flag than usual.
    """
    field, sep, why = message.partition(": ")
    dest = flag_of_field.get(field) or _FLAG_OF_FIELD.get(field, field)
    if not sep or dest not in {flag.dest for flag in FLAGS}:
        return message
    return f"argument {_names(dest)}: {why}"


def _refuse_unsupported(args: argparse.Namespace) -> None:
    for flag in FLAGS:
        if flag.refused is None:
            continue
        value = getattr(args, flag.dest)
        if value != flag.default and value not in flag.also_default:
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


def _union(
    a: Std | Mapping[int, Std], b: Std | Mapping[int, Std], nproc: int
) -> Std | dict[int, Std]:
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
