"""A SLURM step's variables as the flags' defaults: what is derived, what wins, what is refused.

Everything runs through the launcher's own parser (`tests.support.cli_args`), with the
environment ``srun --ntasks-per-node=1`` gives the task on node 1 of a 3-node step.
"""

from __future__ import annotations

import pytest

from aioelastic._cli.schedulers._slurm import port
from tests.support.cli_args import launch, refusal

pytestmark = pytest.mark.timeout(30)

STEP = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NODELIST": "n[1-3]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    "SLURM_NNODES": "3",
    "SLURM_NTASKS": "3",
}
PORT = port(1234, 0)


def test_a_step_gives_nodes_a_c10d_store_on_its_first_host_and_an_id() -> None:
    config, command = launch([], STEP)
    assert (config.min_nodes, config.max_nodes) == (3, 3)
    assert config.rdzv_backend == "c10d"
    assert config.rdzv_endpoint == f"n1:{PORT}"
    assert config.run_id == "slurm-1234.0-r0"
    # Node 1 is not the store's host, whatever its addresses say; node 0 is.
    assert config.rdzv_configs["is_host"] == "0"
    assert launch([], {**STEP, "SLURM_NODEID": "0"})[0].rdzv_configs["is_host"] == "1"
    assert command.notes == (
        f"from SLURM job 1234 step 0: --nnodes 3 --rdzv-backend c10d --rdzv-endpoint "
        f"n1:{PORT} --rdzv-id slurm-1234.0-r0 --rdzv-conf is_host=0 --lost-node end",
    )


def test_flags_win_over_pet_variables_which_win_over_slurm() -> None:
    env = {**STEP, "PET_NNODES": "2:3", "PET_RDZV_ID": "from-pet", "PET_RDZV_BACKEND": "c10d"}
    config, command = launch(["--rdzv-id", "from-flag", "--rdzv-endpoint", "h9:7"], env)
    assert (config.min_nodes, config.max_nodes) == (2, 3)
    assert config.run_id == "from-flag"
    assert config.rdzv_endpoint == "h9:7"
    # Another host than the first: torch decides who hosts it, as without SLURM.
    assert "is_host" not in config.rdzv_configs
    # What was left unsaid still comes from the step: its nodes never come back.
    assert command.notes == ("from SLURM job 1234 step 0: --lost-node end",)
    assert config.replace_lost_nodes is False
    assert launch([], env)[0].run_id == "from-pet"
    assert launch(["--lost-node", "wait"], env)[0].replace_lost_nodes is True
    assert launch([], {**env, "PET_LOST_NODE": "wait"})[0].replace_lost_nodes is True


def test_an_endpoint_with_only_a_host_or_only_a_port_is_completed_from_the_step() -> None:
    assert launch(["--rdzv-endpoint", "n7"], STEP)[0].rdzv_endpoint == f"n7:{PORT}"
    config = launch(["--rdzv-endpoint", ":29600"], STEP)[0]
    assert config.rdzv_endpoint == "n1:29600"
    assert config.rdzv_configs["is_host"] == "0"
    given = launch(["--rdzv-conf", "is_host=1"], STEP)[0]
    assert given.rdzv_configs["is_host"] == "1"


def test_the_static_backend_takes_the_node_rank_and_the_store_from_the_step() -> None:
    config, command = launch(["--rdzv-backend", "static"], STEP)
    assert config.rdzv_endpoint == f"n1:{PORT}"
    assert config.rdzv_configs["rank"] == 1
    assert command.notes == (
        f"from SLURM job 1234 step 0: --nnodes 3 --node-rank 1 --rdzv-id slurm-1234.0-r0 "
        f"--master-addr n1 --master-port {PORT} --lost-node end",
    )


def test_every_step_and_requeue_has_its_own_id_and_the_port_is_the_steps() -> None:
    second = launch([], {**STEP, "SLURM_STEP_ID": "1", "SLURM_RESTART_COUNT": "2"})[0]
    assert second.run_id == "slurm-1234.1-r2"
    assert second.rdzv_endpoint == f"n1:{port(1234, 1)}"
    ports = {port(job, step) for job in range(5000, 5500) for step in range(16)}
    assert len(ports) == 500 * 16, "nearby jobs' steps share no port"
    assert all(20000 <= p < 29010 and not 32768 <= p <= 60999 for p in ports)
    assert {port(j, 0) for j in range(20000)}.isdisjoint({23456, 27017, 29400, 29500})


@pytest.mark.parametrize(
    ("layout", "said"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "SLURM_STEP_TASKS_PER_NODE=2(x3)"),
        ({"SLURM_STEP_TASKS_PER_NODE": "1,2"}, "SLURM_STEP_TASKS_PER_NODE=1,2"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_STEP_NUM_TASKS": "6"},
            "SLURM_STEP_NUM_TASKS=6 on 3 nodes",
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_NTASKS_PER_NODE": "2"},
            "SLURM_NTASKS_PER_NODE=2, SLURM_NTASKS=3 on 3 nodes",
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_NTASKS": "4"},
            "SLURM_NTASKS_PER_NODE=1, SLURM_NTASKS=4 on 3 nodes",
        ),
    ],
)
def test_a_step_of_several_launchers_per_node_is_refused_naming_the_fix(
    layout: dict[str, str | None], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {k: v for k, v in {**STEP, **layout}.items() if v is not None}
    message = refusal([], capsys, environ=env)
    assert f"this SLURM step runs more than one task per node ({said})" in message
    assert "srun --ntasks-per-node=1 aioelastic-run" in message


def test_the_steps_own_layout_wins_over_the_batch_jobs_tasks_per_node() -> None:
    # sbatch --ntasks-per-node=8, then srun --ntasks-per-node=1: the step has one per node.
    config = launch([], {**STEP, "SLURM_NTASKS_PER_NODE": "8", "SLURM_NTASKS": "24"})[0]
    assert config.rdzv_backend == "c10d"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_STEP_NODELIST": "n[3-1]"}, "SLURM_STEP_NODELIST is not a SLURM host list: "),
        ({"SLURM_NODEID": "3"}, "SLURM_NODEID='3' is not a node of this 3-node step"),
        ({"SLURM_STEP_NUM_NODES": "three"}, "SLURM_STEP_NUM_NODES='three' is not a whole"),
    ],
)
def test_a_malformed_step_variable_is_a_usage_error_naming_it(
    change: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refusal([], capsys, environ={**STEP, **change})


def test_outside_a_step_nothing_is_derived_and_a_batch_shell_of_several_nodes_warns() -> None:
    assert launch([], {})[0].rdzv_backend == "c10d"  # torchrun's private single node
    assert launch([], {})[1].notes == ()
    batch = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "4", "SLURM_PROCID": "0"}
    for shell in (batch, {**batch, "SLURM_STEP_ID": str(0xFFFFFFFB)}):
        config, command = launch([], shell)
        assert (config.max_nodes, command.notes) == (1, ())
        (warning,) = command.warnings
        assert "SLURM job 77 outside a step of srun: only this node of its 4" in warning
        assert "srun --ntasks-per-node=1" in warning
    one_node = launch([], {**batch, "SLURM_JOB_NUM_NODES": "1"})[1]
    assert one_node.warnings == ()


def test_standalone_takes_nothing_from_the_step() -> None:
    config, command = launch(["--standalone"], STEP)
    assert (config.max_nodes, command.notes, config.rdzv_endpoint) == (1, (), "")
