"""``aioelastic-run`` end to end, as a user runs it: a subprocess, real workers, real exits.

What a run gives its workers (torchrun's environment, ``-m``, ``--no-python``,
``--run-path``, no torch in the launcher), how a failure is reported and retried, where
the logs go, and multi-process and two-node jobs. Workers run tests/children/cli.py as a
plain script (no decorator, no aioelastic import), or as ``-m tests.children.cli``. Tests
that wait for a failure to be set off wait for the workers' ``ready`` lines first. Signals
to the launcher: test_launcher_signals.py; values refused: test_bad_values.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_child import READY, SCRIPT
from tests.support.cli_run import env_lines, launch, launcher, with_env
from tests.support.paths import REPO
from tests.support.ports import free_port

# -- success, commands, environment ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_success_exits_0_with_torchrun_env_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    run = launch(SCRIPT, "env", env=with_env(PET_NPROC_PER_NODE="2", TMPDIR=str(tmp_path)))
    assert run.proc.returncode == 0, run.stderr
    envs = sorted(env_lines(run), key=lambda e: e["RANK"])
    assert [e["RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "2"
        assert e["LOCAL_RANK"] == e["RANK"]
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["OMP_NUM_THREADS"] == "1"
        assert e["MASTER_ADDR"]
        assert int(e["MASTER_PORT"]) > 0
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_module_and_no_python() -> None:
    run = launch("--nproc-per-node", "2", "-m", "tests.children.cli", "env")
    assert run.proc.returncode == 0, run.stderr
    assert len(env_lines(run)) == 2
    run = launch("--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "sh rank=$RANK"')
    assert run.proc.returncode == 0, run.stderr
    assert sorted(line.strip() for line in run.out) == ["sh rank=0", "sh rank=1"]


@pytest.mark.timeout(60)
def test_run_path_runs_the_script_in_a_worker_interpreter() -> None:
    run = launch("--nproc-per-node", "2", "--run-path", SCRIPT, "env")
    assert run.proc.returncode == 0, run.stderr
    assert len(env_lines(run)) == 2


@pytest.mark.timeout(60)
def test_standalone_ignores_rendezvous_flags_with_a_warning() -> None:
    run = launch("--standalone", "--rdzv-id", "job7", "--nproc-per-node", "2", SCRIPT, "env")
    assert run.proc.returncode == 0, run.stderr
    assert "--standalone ignores --rdzv-id='job7'" in run.stderr
    envs = env_lines(run)
    assert len(envs) == 2
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} != {"job7"}


@pytest.mark.timeout(60)
def test_the_launcher_does_not_import_torch_for_a_single_node_run() -> None:
    run = launch("--nproc-per-node", "2", SCRIPT, "env", env=with_env(PYTHONPROFILEIMPORTTIME="1"))
    assert run.proc.returncode == 0, run.stderr
    # Workers inherit the variable too, but this script imports no torch either, so any
    # torch in the profile is the launcher's.
    imported = [line for line in run.err if re.search(r"\|\s+torch$", line.rstrip())]
    assert imported == [], "".join(imported)
    assert any(
        re.search(r"\|\s+aioelastic\._elastic\.agent\._agent$", line.rstrip()) for line in run.err
    )


# -- failures -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "expected_code", "traceback_text"),
    [
        ("raise", 1, "ValueError: deliberate failure in rank 1"),
        ("exit", 7, "rank 1 exits with 7"),
        ("SIGKILL", 128 + 9, "killed by SIGKILL"),
    ],
)
def test_failure_exit_code_and_root_cause_table(
    tmp_path: Path, how: str, expected_code: int, traceback_text: str
) -> None:
    go = tmp_path / "go"
    with launcher(
        "--nproc-per-node", "3", SCRIPT, "fail", "--rank", "1", "--how", how, "--code", "7",
        "--wait-for-file", str(go),
    ) as run:  # fmt: skip
        run.wait_for(READY, 2)
        go.touch()
        assert run.finish() == expected_code, run.stderr
    err = run.stderr
    table = err[err.index("=" * 20) :]
    assert "FAILED" in table
    assert "<NO_OTHER_FAILURES>" in table  # siblings stopped by the launcher are no failures
    root = table[table.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root
    assert traceback_text in root
    if how == "raise":
        assert "Traceback (most recent call last)" in root  # a plain script, no @record
        assert 'cli.py", line' in root


@pytest.mark.timeout(60)
def test_a_nested_launcher_hands_its_root_cause_to_the_outer_error_file(tmp_path: Path) -> None:
    error_file = tmp_path / "outer_error.json"
    run = launch(
        SCRIPT, "fail", "--how", "raise", env=with_env(TORCHELASTIC_ERROR_FILE=str(error_file))
    )
    assert run.proc.returncode == 1, run.stderr
    data = json.loads(error_file.read_text())
    assert "deliberate failure in rank 0" in data["message"]["extraInfo"]["py_callstack"]


@pytest.mark.timeout(90)
def test_max_restarts_with_a_flaky_script() -> None:
    run = launch(
        "--nproc-per-node", "2", "--max-restarts", "2", SCRIPT, "flaky", "--fail-times", "2"
    )
    assert run.proc.returncode == 0, run.stderr
    counts = sorted(re.findall(r"restart_count=(\d) rank=0", run.stdout))
    assert counts == ["0", "1", "2"]
    run = launch("--max-restarts", "1", SCRIPT, "flaky", "--fail-times", "2")
    assert run.proc.returncode == 3, run.stderr
    assert "Root Cause" in run.stderr


@pytest.mark.timeout(60)
def test_no_retry_exit_codes_fail_at_once_and_backoff_is_accepted() -> None:
    run = launch(
        "--max-restarts", "5", "--no-retry-exit-codes", "3", "--restart-backoff", "0.05",
        SCRIPT, "flaky", "--fail-times", "5",
    )  # fmt: skip
    assert run.proc.returncode == 3, run.stderr
    assert re.findall(r"restart_count=(\d)", run.stdout) == ["0"]


# -- logs -----------------------------------------------------------------------------------


def _job_dir(base: Path) -> Path:
    (job,) = list(base.iterdir())
    return job


@pytest.mark.timeout(60)
def test_tee_prefixes_console_lines_and_writes_files(tmp_path: Path) -> None:
    run = launch(
        "--nproc-per-node", "2", "--tee", "3", "--log-dir", str(tmp_path), SCRIPT, "lines",
    )  # fmt: skip
    assert run.proc.returncode == 0, run.stderr
    for rank in (0, 1):
        for i in range(3):
            assert f"[default{rank}]:out rank={rank} line={i}\n" in run.out
            assert f"[default{rank}]:err rank={rank} line={i}\n" in run.err
        logs = _job_dir(tmp_path) / "attempt_0" / str(rank)
        assert (logs / "stdout.log").read_text().count(f"out rank={rank}") == 3
        assert (logs / "stderr.log").read_text().count(f"err rank={rank}") == 3


@pytest.mark.timeout(60)
def test_redirects_keep_output_off_the_console_and_the_log_dir_is_reusable(
    tmp_path: Path,
) -> None:
    for _ in range(2):
        run = launch("-r", "1", "--log-dir", str(tmp_path), SCRIPT, "lines")
        assert run.proc.returncode == 0, run.stderr
        assert "out rank=0" not in run.stdout
        assert "err rank=0 line=2" in run.stderr  # stderr was not redirected
    jobs = list(tmp_path.iterdir())
    assert len(jobs) == 2  # one <run_id>_<random> directory per run, as torchrun
    for job in jobs:
        assert (job / "attempt_0" / "0" / "stdout.log").read_text().count("out rank=0") == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tee", [True, False])
def test_local_ranks_filter_still_reports_a_filtered_ranks_failure(
    tmp_path: Path, tee: bool
) -> None:
    extra = ["--tee", "3", "--log-dir", str(tmp_path)] if tee else []
    run = launch(
        "--nproc-per-node", "2", "--local-ranks-filter", "0", *extra, SCRIPT, "lines",
        "--fail-rank", "1", "--sync-dir", str(tmp_path / "sync"),
    )  # fmt: skip
    assert run.proc.returncode == 1, run.stderr
    assert "out rank=0 line=2" in run.stdout
    assert "out rank=1" not in run.stdout
    root = run.stderr[run.stderr.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "RuntimeError: filtered rank 1 failed" in root
    assert "Traceback (most recent call last)" in root


@pytest.mark.timeout(60)
def test_logs_specs_default_runs_the_job_in_torchs_own_layout() -> None:
    # 'default' is the torchrun.logs_specs entry point torch's wheel installs
    # (DefaultLogsSpecs): the layout aioelastic-run writes anyway.
    run = launch("--logs-specs", "default", "--nproc-per-node", "2", SCRIPT, "env")
    assert run.proc.returncode == 0, run.stderr
    assert len(env_lines(run)) == 2


# -- multi-process jobs ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_gives_the_same_parameters_as_torchrun(tmp_path: Path, nproc: int) -> None:
    ours, theirs = tmp_path / "ours.json", tmp_path / "torchrun.json"
    run = launch(f"--nproc-per-node={nproc}", SCRIPT, "ddp", "--out", str(ours), timeout=200)
    assert run.proc.returncode == 0, run.stderr
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         SCRIPT, "ddp", "--out", str(theirs)],
        cwd=REPO, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stderr
    a, b = json.loads(ours.read_text()), json.loads(theirs.read_text())
    assert a["world_size"] == b["world_size"] == nproc
    assert a["params"] == b["params"]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_two_launchers_form_a_two_node_c10d_job(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "params.json"
    common = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cli-two-nodes",
        "--rdzv-conf", "join_timeout=120",
    ]  # fmt: skip
    argv = [*common, SCRIPT, "ddp", "--steps", "5", "--out", str(out)]
    with launcher(*argv) as first, launcher(*argv) as second:
        assert first.finish(200) == 0, first.stderr
        assert second.finish(200) == 0, second.stderr
    seen = sorted(re.findall(r"ddp rank=(\d) world=(\d)", first.stdout + second.stdout))
    assert seen == [("0", "4"), ("1", "4"), ("2", "4"), ("3", "4")]
    assert json.loads(out.read_text())["world_size"] == 4
