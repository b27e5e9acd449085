"""torchrun's worker environment: the function that builds it, and a real side-by-side run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aioelastic._elastic.agent._env import worker_env
from aioelastic._elastic.agent._types import Worker, WorkerGroup, WorkerSpec
from tests.children import agent as children


def group(local_world_size: int = 2, **spec: object) -> WorkerGroup:
    made = WorkerGroup(
        WorkerSpec(
            role="trainer",
            local_world_size=local_world_size,
            entrypoint=children.report,
            max_restarts=3,
            **spec,  # type: ignore[arg-type]
        )
    )
    made.group_rank, made.group_world_size = 1, 2
    made.master_addr, made.master_port = "node0", 29400
    made.workers = [
        Worker(local_rank=lr, global_rank=2 + lr, role_rank=2 + lr, world_size=4, role_world_size=4)
        for lr in range(local_world_size)
    ]
    return made


def env_of(
    g: WorkerGroup, local_rank: int, environ: dict[str, str], **kw: object
) -> dict[str, str]:
    return worker_env(
        g,
        g.workers[local_rank],
        restart_count=kw.pop("restart_count", 2),  # type: ignore[arg-type]
        run_id="job7",
        use_agent_store=kw.pop("use_agent_store", True),  # type: ignore[arg-type]
        environ=environ,
        **kw,  # type: ignore[arg-type]
    )


def test_the_agent_sets_torchruns_variables() -> None:
    env = env_of(group(), 1, {})
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert env_of(group(), 0, {}, use_agent_store=False)["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_threads_and_nccl_settings_of_the_agent_win_over_the_defaults() -> None:
    # One worker: no OpenMP guard needed, as with torchrun.
    assert "OMP_NUM_THREADS" not in env_of(group(1), 0, {})
    given = {"OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = env_of(group(), 0, given)
    assert (env["OMP_NUM_THREADS"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("8", "0")
    env = env_of(group(), 0, {}, signals_to_handle="SIGTERM,SIGINT")
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT"
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in env_of(group(), 0, {})


def test_virtual_local_rank_gives_each_worker_its_one_device_as_device_0() -> None:
    plain = env_of(group(), 1, {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert (plain["LOCAL_RANK"], plain["CUDA_VISIBLE_DEVICES"]) == ("1", "4,5")
    virtual = group(virtual_local_rank=True)
    env = env_of(virtual, 1, {"CUDA_VISIBLE_DEVICES": "4, 5"})
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "5")
    assert env_of(virtual, 1, {})["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        env_of(virtual, 1, {"CUDA_VISIBLE_DEVICES": "4"})


def test_a_group_without_a_rendezvous_has_no_environment() -> None:
    fresh = WorkerGroup(WorkerSpec(local_world_size=1, entrypoint=children.report))
    with pytest.raises(ValueError, match="rendezvous"):
        worker_env(fresh, fresh.workers[0], restart_count=0, run_id="x", use_agent_store=True)


# -- side by side with torchrun --------------------------------------------------------

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _added(env: dict[str, str]) -> dict[str, str]:
    """What the launcher set or changed relative to this test process's environment."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


@pytest.mark.torch
@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("torch_store_warmed", "collect_stores")
@pytest.mark.parametrize("sharing", ["agent store", "worker store"])
async def test_workers_see_what_they_see_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharing: str
) -> None:
    from aioelastic._elastic.launch._elastic_launch import LaunchConfig, elastic_launch

    for name in ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    # torch's switch: workers host their own store (then our agent needs no torch).
    monkeypatch.setenv(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1" if sharing == "worker store" else "0"
    )
    job = ["-m", "tests.children.agent", "env"]
    under_torchrun = tmp_path / "torchrun"
    under_agent = tmp_path / "agent"
    under_torchrun.mkdir()
    under_agent.mkdir()

    # torchrun with its defaults on one node: --standalone, role "default", no restarts.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    subprocess.run(
        [*torchrun, *job, str(under_torchrun)],
        # Explicitly os.environ, which is what the agent passes on: without env=, a child
        # inherits the C-level environment, where pytest's readline import put COLUMNS
        # and LINES that os.environ never shows.
        env=dict(os.environ),
        check=True,
        capture_output=True,
        timeout=90,
    )
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, role="default", max_restarts=0
    )
    await elastic_launch(config, sys.executable)("-u", *job, str(under_agent))

    for rank in (0, 1):
        theirs = _added(json.loads((under_torchrun / f"{rank}.json").read_text()))
        ours = _added(json.loads((under_agent / f"{rank}.json").read_text()))
        assert sorted(ours) == sorted(theirs)
        by_shape = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
        if sharing == "agent store":
            # The one deliberate difference: one node needs no agent store, so ours has
            # none (and the agent never imports torch); worker 0 hosts the workers' store.
            assert (
                theirs["TORCHELASTIC_USE_AGENT_STORE"],
                ours["TORCHELASTIC_USE_AGENT_STORE"],
            ) == (
                "True",
                "False",
            )
            by_shape.add("TORCHELASTIC_USE_AGENT_STORE")
        assert {k: v for k, v in ours.items() if k not in by_shape} == {
            k: v for k, v in theirs.items() if k not in by_shape
        }
        for env in (theirs, ours):
            assert 0 < int(env["MASTER_PORT"]) < 65536
            assert UUID.fullmatch(env["TORCHELASTIC_RUN_ID"])
            assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
