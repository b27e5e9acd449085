"""The environment torchrun gives each worker, built in one place.

Keys and values follow torch 2.13's ``LocalElasticAgent._start_workers`` plus what
``torchrun`` itself exports to its workers (``OMP_NUM_THREADS``,
``TORCHELASTIC_SIGNALS_TO_HANDLE``). ``TORCHELASTIC_ERROR_FILE`` is not here: the process
layer sets it for every worker it starts, agent or not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._types import Worker, WorkerGroup, WorkerSpec

__all__ = ["worker_env"]


def worker_env(
    group: WorkerGroup,
    worker: Worker,
    *,
    restart_count: int,
    run_id: str,
    use_agent_store: bool,
    signals_to_handle: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables the agent sets for one worker, on top of the inherited environment.

    Args:
        group: the rendezvoused group (``group_rank``, ``group_world_size``, ``master_addr``,
            ``master_port`` set) and its spec.
        worker: the worker, with its ranks assigned.
        restart_count: how many failure restarts happened before this attempt
            (``TORCHELASTIC_RESTART_COUNT``; membership changes do not count).
        run_id: the rendezvous run id.
        use_agent_store: whether workers connect to the store the agent hosts at
            ``MASTER_ADDR:MASTER_PORT`` instead of rank 0 hosting one.
        signals_to_handle: exported as ``TORCHELASTIC_SIGNALS_TO_HANDLE`` when given, as
            torchrun does with its ``--signals-to-handle``.
        environ: the agent's environment (default ``os.environ``); read for
            ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``OMP_NUM_THREADS`` and
            ``CUDA_VISIBLE_DEVICES``, never modified.

    Returns:
        ``{name: value}`` for this worker.

    Raises:
        ValueError: the group has not been through a rendezvous yet, or, with
            ``virtual_local_rank``, ``CUDA_VISIBLE_DEVICES`` lists fewer devices than there
            are local workers.
    """
    if environ is None:
        environ = os.environ
    spec = group.spec
    master_addr = _master_addr(group)
    env = {
        "RANK": str(worker.global_rank),
        "GROUP_RANK": str(group.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(group.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        # torch writes str(bool); its workers compare against "True" exactly.
        "TORCHELASTIC_USE_AGENT_STORE": str(bool(use_agent_store)),
        **_from_environ(spec, worker, environ),
    }
    if signals_to_handle is not None:
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_to_handle
    return env


def _master_addr(group: WorkerGroup) -> str:
    """The group's ``MASTER_ADDR``, once it is checked that the group has its ranks."""
    if (
        group.group_rank is None
        or group.group_world_size is None
        or group.master_addr is None
        or group.master_port is None
    ):
        raise ValueError("worker_env needs a group that completed a rendezvous")
    return group.master_addr


def _from_environ(spec: WorkerSpec, worker: Worker, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that depend on the agent's environment, and the worker's devices."""
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if spec.virtual_local_rank:
        # Every worker sees its one device as device 0.
        env["LOCAL_RANK"] = "0"
        if visible is not None:
            devices = visible.split(",")
            if worker.local_rank >= len(devices):
                raise ValueError(
                    f"local rank {worker.local_rank} has no device: CUDA_VISIBLE_DEVICES="
                    f"{visible!r} lists {len(devices)}; list one device per local worker"
                )
            env["CUDA_VISIBLE_DEVICES"] = devices[worker.local_rank].strip()
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(worker.local_rank)
    else:
        env["LOCAL_RANK"] = str(worker.local_rank)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
    if "OMP_NUM_THREADS" in environ:
        env["OMP_NUM_THREADS"] = environ["OMP_NUM_THREADS"]
    elif spec.local_world_size > 1:
        # torchrun's guard against N workers each starting one OpenMP thread per core.
        env["OMP_NUM_THREADS"] = "1"
    return env
