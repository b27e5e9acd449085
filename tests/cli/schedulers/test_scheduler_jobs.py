"""Real launchers given exactly a scheduler's environment, no flags: one job forms.

Two launchers of two workers each on this machine, as two nodes would run them: in a SLURM
step (``srun --ntasks-per-node=1``), in the pods of Kubeflow's PyTorchJob (training
operator v1, elastic and not) and of Kubeflow Trainer's TrainJob (torch plugin). The
variables are the ones those controllers set (their sources: the training operator's
``pkg/controller.v1/pytorch/{envvar,elastic,master}.go``, the trainer's torch plugin);
only the addresses are this machine's. Every worker prints its environment; the job is
one world of four ranks.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Mapping

import pytest

from aioelastic._cli.schedulers._slurm import port
from tests.support.cli_child import SCRIPT
from tests.support.cli_run import Launcher, env_lines, with_env
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(120)

#: Every pod has it; the training operator's variables are read only in a pod.
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "PYTHONUNBUFFERED": "1"}


def _one_world(envs: list[Mapping[str, str]]) -> list[Launcher]:
    """Run a launcher per environment (no flags); check their workers form one world of 4."""
    runs = [Launcher([SCRIPT, "env"], with_env(**env), new_session=True) for env in envs]
    try:
        for run in runs:
            assert run.finish(90) == 0, run.stderr
    finally:
        for run in runs:
            run.kill()
    workers = [worker for run in runs for worker in env_lines(run)]
    assert sorted(int(w["RANK"]) for w in workers) == [0, 1, 2, 3]
    assert {w["WORLD_SIZE"] for w in workers} == {"4"}
    assert {w["LOCAL_WORLD_SIZE"] for w in workers} == {"2"}
    assert sorted(w["GROUP_RANK"] for w in workers) == ["0", "0", "1", "1"]
    return runs


def _free_step_port() -> tuple[int, int]:
    """A job id whose step 0's derived port is free here now, and that port."""
    while True:
        job = uuid.uuid4().int % 10_000_000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port(job, 0)))
            except OSError:
                continue
        return job, port(job, 0)


def test_a_slurm_step_forms_one_job_from_its_variables_alone() -> None:
    job, store = _free_step_port()
    step = {
        "SLURM_JOB_ID": str(job),
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "localhost,127.0.0.1",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NUM_TASKS": "2",
        "PET_NPROC_PER_NODE": "2",
    }
    runs = _one_world([{**step, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)} for n in range(2)])
    for node, run in enumerate(runs):
        assert (
            f"aioelastic-run: from SLURM job {job} step 0: --nnodes 2 --rdzv-backend c10d "
            f"--rdzv-endpoint localhost:{store} --rdzv-id slurm-{job}.0-r0 "
            f"--rdzv-conf is_host={int(node == 0)} --lost-node end\n"
        ) in run.err


def test_a_pytorchjob_without_elastic_policy_forms_one_job() -> None:
    # v1's envvar.go: MASTER_ADDR/MASTER_PORT (node 0's pod), WORLD_SIZE (replicas x
    # nproc) and RANK (the pod's), PET_NODE_RANK, PET_NNODES, PET_NPROC_PER_NODE.
    master = str(free_port())
    job = {**POD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master, "WORLD_SIZE": "4"}
    job |= {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"}
    runs = _one_world([{**job, "RANK": str(pod), "PET_NODE_RANK": str(pod)} for pod in range(2)])
    for run in runs:
        assert (
            "aioelastic-run: from the Kubernetes pod's MASTER_ADDR/MASTER_PORT: "
            f"--master-addr 127.0.0.1 --master-port {master}\n"
        ) in run.err


def test_an_elastic_pytorchjob_forms_one_job() -> None:
    # v1's elastic.go: PET_RDZV_ENDPOINT (worker 0's pod), PET_RDZV_BACKEND, PET_NNODES as
    # MIN:MAX, PET_MAX_RESTARTS, PET_NPROC_PER_NODE; no MASTER_ADDR (no Master replica).
    job = {**POD, "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    job |= {"PET_NNODES": "1:2", "PET_MAX_RESTARTS": "1", "PET_NPROC_PER_NODE": "2"}
    for run in _one_world([job, job]):
        assert "from the Kubernetes pod" not in run.stderr


def test_a_trainjob_forms_one_job() -> None:
    # Trainer v2's torch plugin: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the job
    # completion index), PET_MASTER_ADDR and PET_MASTER_PORT.
    job = {**POD, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"}
    job |= {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port())}
    for run in _one_world([{**job, "PET_NODE_RANK": str(pod)} for pod in range(2)]):
        assert "from the Kubernetes pod" not in run.stderr
