"""What the scheduler's environment says for the flags the user did not give.

The parser calls `derive` once the command line and the ``PET_*`` variables are read, with
the flags they set (``said``): a value from either always wins, and only the rest is
derived. Inside a SLURM step (`._slurm`): the node count, a c10d rendezvous whose store is
on the step's first host, on a port made of the job and step ids, hosted by node 0 (told
to torch as ``is_host``: its guess from host names and addresses is wrong where several
nodes share one machine's interfaces), a run id new for every step and requeue, and
``--lost-node end`` (nothing replaces a node of a step). In a
Kubernetes pod (`._kubernetes`): node 0's address for a static job. What was derived is
told in one line, at the launcher's start.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._elastic.settings import _node_values as node_values
from . import _kubernetes as kubernetes, _slurm as slurm

__all__ = ["Derived", "derive"]

#: The order in which derived flags are told, torchrun's names.
_TOLD = (
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "master_addr",
    "master_port",
    "lost_node",
)


@dataclass(frozen=True)
class Derived:
    """Flag values taken from the scheduler, and what to tell about them.

    Attributes:
        values: the parsed value of each derived flag, by its destination (``nnodes``).
        note: the one line saying where they came from and what they are; None if nothing
            was derived.
        warnings: what the user should know (a launcher outside a step of a SLURM job).
    """

    values: Mapping[str, Any] = field(default_factory=dict)
    note: str | None = None
    warnings: tuple[str, ...] = ()


def derive(args: argparse.Namespace, environ: Mapping[str, str], said: set[str]) -> Derived:
    """The values the scheduler gives for the flags not in ``said``.

    Args:
        args: the parsed command line (values from flags, ``PET_*`` variables, defaults).
        environ: the launcher's environment.
        said: the flags set on the command line or by a ``PET_*`` variable.

    Raises:
        ValueError: a SLURM step this launcher cannot serve (several tasks per node), or a
            scheduler's variable that is malformed; the message names it and the fix.
    """
    if args.standalone:
        return Derived()  # one node on its own, by the user's word
    step = slurm.step_of(environ)
    if step is not None:
        values = _from_step(step, args, said)
        told = f"from SLURM job {step.job_id} step {step.step_id}"
        if step.restarts:
            told += f" (requeued {step.restarts}x)"
        return Derived(values, _note(told, values) if values else None)
    warning = slurm.outside_step(environ)
    values = kubernetes.master_of_pod(args, environ, said)
    note = _note("from the Kubernetes pod's MASTER_ADDR/MASTER_PORT", values)
    return Derived(values, note if values else None, (warning,) if warning else ())


def _from_step(step: slurm.Step, args: argparse.Namespace, said: set[str]) -> dict[str, Any]:
    """The flags a SLURM step gives, as far as they are unsaid."""
    values: dict[str, Any] = {}
    if "nnodes" not in said:
        values["nnodes"] = (step.nodes, step.nodes)
    if "rdzv_backend" not in said:
        values["rdzv_backend"] = "c10d"
    backend = values.get("rdzv_backend", args.rdzv_backend)
    if backend == "c10d":
        values.update(_c10d_store(step, args, said))
    elif backend == "static":
        # torchrun's static rendezvous: node ranks as given, the store at --rdzv-endpoint,
        # else at --master-addr:--master-port, hosted by node rank 0.
        given: dict[str, Any] = {"node_rank": step.node_id}
        if "rdzv_endpoint" not in said:
            given |= {"master_addr": step.first_host, "master_port": step.port}
        values |= {dest: value for dest, value in given.items() if dest not in said}
    if "rdzv_id" not in said:
        values["rdzv_id"] = step.run_id
    if "lost_node" not in said:
        # A step's nodes are fixed: a crashed node never rejoins it, so survivors too few
        # for the job end it, for SLURM's requeue, instead of waiting out the join timeout.
        values["lost_node"] = "end"
    return values


def _c10d_store(step: slurm.Step, args: argparse.Namespace, said: set[str]) -> dict[str, Any]:
    """The c10d store's endpoint (what ``--rdzv-endpoint`` leaves out) and its host."""
    given = args.rdzv_endpoint if "rdzv_endpoint" in said else ""
    if not given or given.startswith(":"):
        host, port = step.first_host, int(given[1:]) if given else step.port
    else:
        host, given_port = node_values.endpoint(given)
        port = step.port if given_port is None else given_port
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    values: dict[str, Any] = {}
    if endpoint != args.rdzv_endpoint:
        values["rdzv_endpoint"] = endpoint
    if host == step.first_host and "is_host" not in args.rdzv_conf:
        # Node 0 runs on the first host: it hosts the store, and no other node tries to.
        values["rdzv_conf"] = {**args.rdzv_conf, "is_host": "1" if step.node_id == 0 else "0"}
    return values


def _note(source: str, values: Mapping[str, Any]) -> str:
    """``source: --flag value ...``, each derived flag as one would type it."""
    told = []
    for dest in _TOLD:
        if dest not in values:
            continue
        value = values[dest]
        if dest == "nnodes":
            value = f"{value[0]}" if value[0] == value[1] else f"{value[0]}:{value[1]}"
        elif dest == "rdzv_conf":
            value = f"is_host={value['is_host']}"
        told.append(f"--{dest.replace('_', '-')} {value}")
    return f"{source}: {' '.join(told)}"
