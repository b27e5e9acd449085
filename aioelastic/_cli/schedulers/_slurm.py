"""A SLURM step, as the variables ``srun`` gives each of its tasks describe it.

Inside a step (``srun --ntasks-per-node=1 aioelastic-run ...``) every launcher sees the
same job id, step id, restart count, node count and node list, and its own node id: enough
for every node to agree, without talking, on where the rendezvous store is, on which node
hosts it and on a job id that no other step or requeued run shares. A launcher is in a
step when ``SLURM_JOB_ID``, ``SLURM_STEP_ID`` (a step's number, not one of the ids SLURM
gives the batch shell, the extern and interactive steps) and ``SLURM_PROCID`` are all set.
A batch or ``salloc`` shell has a job id but no step: nothing is taken from SLURM there
(the launcher runs on that one node only), and a job of several nodes gets a warning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ._hostlist import first_host

__all__ = ["Step", "outside_step", "port", "step_of"]

#: The store's port is ``_FIRST_PORT + (16 * job + step) % _SPAN``, counted on past each
#: of `_COMMON_PORTS` it reaches (so within 20001-29008, none of them): unprivileged, below
#: Linux's ephemeral range (32768-60999, where the kernel picks the ports of outgoing
#: connections) and Kubernetes' node ports (30000-32767), away from torch's own 29400 and
#: 29500. Steps 0-15 of jobs less than 562 ids apart never share a port, so jobs submitted
#: one after another on shared nodes do not collide.
_FIRST_PORT = 20000
_SPAN = 9000
#: Well-known services in that range: Kubeflow PyTorchJob's 23456, GlusterFS, Minecraft,
#: CockroachDB, MongoDB, RethinkDB.
_COMMON_PORTS = frozenset({20000, 23456, 24007, 25565, 26257, 27017, 27018, 27019, 28015})
#: SLURM's step ids from 0xFFFFFFF0 up are not steps of srun (batch shell, extern,
#: interactive, pending).
_SPECIAL_STEPS = 0xFFFFFFF0
#: ``SLURM_STEP_TASKS_PER_NODE``: ``2(x3),1``, a count per node, ``(xN)`` for N nodes.
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class Step:
    """The step this launcher is a task of.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        step_id: ``SLURM_STEP_ID``.
        restarts: ``SLURM_RESTART_COUNT``: how often the job was requeued (0 at first).
        node_id: ``SLURM_NODEID``: this node's index in the step's node list.
        nodes: the step's node count.
        first_host: the first host of the step's node list, where node 0 hosts the store.
    """

    job_id: int
    step_id: int
    restarts: int
    node_id: int
    nodes: int
    first_host: str

    @property
    def run_id(self) -> str:
        """The rendezvous id: ``slurm-JOB.STEP-rRESTARTS``, new for every step and requeue."""
        return f"slurm-{self.job_id}.{self.step_id}-r{self.restarts}"

    @property
    def port(self) -> int:
        """The store's port, the same on every node of the step (`port`)."""
        return port(self.job_id, self.step_id)


def port(job_id: int, step_id: int) -> int:
    """The rendezvous store's port for a step: deterministic, see `_FIRST_PORT`."""
    chosen = _FIRST_PORT + (16 * job_id + step_id) % _SPAN
    for common in sorted(_COMMON_PORTS):
        # Counted past, not stepped off: two steps never land on one port this way.
        if chosen >= common:
            chosen += 1
    return chosen


def step_of(environ: Mapping[str, str]) -> Step | None:
    """The step this launcher runs in; None outside one.

    Raises:
        ValueError: the step runs more than one launcher on a node (the message names the
            fix, ``srun --ntasks-per-node=1``), or one of its variables is malformed.
    """
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if not job or step is None or "SLURM_PROCID" not in environ:
        return None
    if not step.isdigit() or int(step) >= _SPECIAL_STEPS:
        return None
    nodes = _number(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if nodes is None or nodes < 1:
        raise ValueError("a SLURM step without a node count (SLURM_STEP_NUM_NODES)")
    _refuse_several_tasks_per_node(environ, nodes)
    node_id = _number(environ, "SLURM_NODEID")
    if node_id is None or node_id >= nodes:
        raise ValueError(
            f"SLURM_NODEID={environ.get('SLURM_NODEID')!r} is not a node of this {nodes}-node step"
        )
    name = next(
        (
            n
            for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if n in environ
        ),
        None,
    )
    if name is None:
        raise ValueError("a SLURM step without a node list (SLURM_STEP_NODELIST)")
    try:
        host = first_host(environ[name])
    except ValueError as e:
        raise ValueError(f"{name} is not a SLURM host list: {e}") from None
    return Step(
        job_id=_number(environ, "SLURM_JOB_ID", "SLURM_JOBID") or 0,
        step_id=int(step),
        restarts=_number(environ, "SLURM_RESTART_COUNT") or 0,
        node_id=node_id,
        nodes=nodes,
        first_host=host,
    )


def outside_step(environ: Mapping[str, str]) -> str | None:
    """A warning for a launcher run in a batch or salloc shell of a job of several nodes."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
    if not job or not nodes.isdigit() or int(nodes) < 2:
        return None
    return (
        f"running in SLURM job {job} outside a step of srun: only this node of its "
        f"{nodes} runs workers, and nothing is taken from SLURM; to use them all, start "
        "one launcher per node: srun --ntasks-per-node=1 aioelastic-run ..."
    )


def _number(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as a whole number >= 0; None if none is set."""
    for name in names:
        text = environ.get(name)
        if text is None:
            continue
        if not text.strip().isdigit():
            raise ValueError(f"{name}={text!r} is not a whole number >= 0")
        return int(text)
    return None


def _refuse_several_tasks_per_node(environ: Mapping[str, str], nodes: int) -> None:
    """Refuse a step of several launcher tasks on a node: each would start its workers.

    The step's own layout decides when srun gave it (``SLURM_STEP_TASKS_PER_NODE``,
    ``SLURM_STEP_NUM_TASKS``): ``SLURM_NTASKS_PER_NODE`` may be the batch job's, inherited.
    """
    layout = environ.get("SLURM_STEP_TASKS_PER_NODE")
    if layout is not None:
        counts = [_TASKS_ITEM.fullmatch(item.strip()) for item in layout.split(",")]
        if not all(counts):
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={layout!r} is not N(xM),... ")
        crowded = max(int(m.group(1)) for m in counts if m) > 1
        said = f"SLURM_STEP_TASKS_PER_NODE={layout}"
    elif (tasks := _number(environ, "SLURM_STEP_NUM_TASKS")) is not None:
        crowded, said = tasks > nodes, f"SLURM_STEP_NUM_TASKS={tasks} on {nodes} nodes"
    else:
        per_node = _number(environ, "SLURM_NTASKS_PER_NODE") or 1
        tasks = _number(environ, "SLURM_NTASKS") or nodes
        crowded = per_node > 1 or tasks > nodes
        said = f"SLURM_NTASKS_PER_NODE={per_node}, SLURM_NTASKS={tasks} on {nodes} nodes"
    if crowded:
        raise ValueError(
            f"this SLURM step runs more than one task per node ({said}), and every task "
            "would be a launcher starting its own workers: start one launcher per node, "
            "srun --ntasks-per-node=1 aioelastic-run ... (workers per node are "
            "--nproc-per-node)"
        )
