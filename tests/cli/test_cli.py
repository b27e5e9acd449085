"""``aioelastic-run`` end to end, as a user runs it: a subprocess, real workers, real signals.

Workers run tests/children/cli.py as a plain script (no decorator, no aioelastic import),
or as ``-m tests.children.cli``. Tests that must signal the launcher wait for the workers'
``ready`` lines first; tests that check that processes are gone wait on their pidfds.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioelastic._core.output._std import Std
from aioelastic._elastic.agent._types import RestartBackoff
from tests.support.cli_run import Launcher, launch, launcher, with_env
from tests.support.paths import CHILDREN, REPO
from tests.support.ports import free_port
from tests.support.waits import wait_all_gone

SCRIPT = str(CHILDREN / "cli.py")
READY = re.compile(r"ready rank=(\d+) pid=(\d+)(?: child=(\d+))?")


def child_pids(pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def env_lines(run: Launcher) -> list[dict[str, str]]:
    return [json.loads(line[4:]) for line in run.out if line.startswith("ENV ")]


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


# -- usage errors ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--numa-binding", "node", SCRIPT], "--numa-binding='node' cannot be honoured"),
        (["--nnodes", "0", SCRIPT], "argument --nnodes: '0' is not N or MIN:MAX"),
        (["--no-python", "-m", SCRIPT], "cannot be used together"),
        (["--max-restarts", "x", SCRIPT], "'x' is not an integer"),
    ],
)
def test_usage_errors_exit_2_with_a_message(argv: list[str], fragment: str) -> None:
    run = launch(*argv)
    assert run.proc.returncode == 2, run.stderr
    assert fragment in run.stderr
    assert "Traceback" not in run.stderr


def _config(**kw: Any) -> None:
    from aioelastic import LaunchConfig

    LaunchConfig(**{"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, **kw})


def _spec(**kw: Any) -> None:
    from aioelastic import WorkerSpec

    WorkerSpec(**{"local_world_size": 1, "entrypoint": "/bin/true", **kw})


def _agent(**kw: Any) -> None:
    from aioelastic import LocalElasticAgent, WorkerSpec

    LocalElasticAgent(WorkerSpec(local_world_size=1, entrypoint="/bin/true"), **kw)


def _start(**kw: Any) -> None:
    import aioelastic

    aioelastic.start_processes(
        **{"name": "w", "entrypoint": "/bin/true", "args": {0: ()}, "envs": {0: {}}, **kw}
    )


_LONG = "r" * 300
_C10D = ["--rdzv-backend", "c10d", "--nnodes", "2"]

# (command line before the script, extra environment, the API calls given the same value,
# the message both must show). The CLI adds "argument --flag:" (or names the flag itself),
# the API the argument's name. Every flag with an API twin has a row, with every API that
# takes the value (LaunchConfig, WorkerSpec, LocalElasticAgent, start_processes,
# RestartBackoff).
BAD_VALUES: list[tuple[list[str], dict[str, str], list[Callable[[], None]], str]] = [
    (["--nproc-per-node", "0"], {}, [lambda: _config(nproc_per_node=0)], "0 is not >= 1"),
    (["--nnodes", "2:1"], {}, [lambda: _config(min_nodes=2, max_nodes=1)],
     "the fewest nodes (2) exceed the most (1)"),
    (["--max-restarts", "-1"], {}, [lambda: _config(max_restarts=-1),
                                    lambda: _spec(max_restarts=-1)], "-1 is not >= 0"),
    (["--max-restarts", "x"], {}, [lambda: _config(max_restarts="x")], "'x' is not an integer"),
    (["--monitor-interval", "0"], {}, [lambda: _config(monitor_interval=0),
                                       lambda: _spec(monitor_interval=0)], "0 is not > 0 seconds"),
    (["--shutdown-timeout", "-1"], {}, [lambda: _config(shutdown_timeout=-1),
                                        lambda: _agent(shutdown_timeout=-1),
                                        lambda: _start(grace_period=-1)], "-1 is not >= 0 seconds"),
    (["--shutdown-timeout", "nan"], {}, [lambda: _config(shutdown_timeout=float("nan"))],
     "nan is not a finite number of seconds"),
    ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, [_config],
     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon': 'soon' is not a number of seconds"),
    (["--master-port", "70000"], {}, [lambda: _spec(master_port=70000)],
     "70000 is not a port number 0..65535"),
    (["--master-port", "x"], {}, [lambda: _spec(master_port="x")], "'x' is not a port number"),
    ([], {"PET_MASTER_PORT": "x"}, [lambda: _spec(master_port="x")],
     "'x' is not a port number 0..65535"),
    ([], {"PET_SIGNALS_TO_HANDLE": "TERM"}, [lambda: _config(signals_to_handle="TERM"),
                                              lambda: _agent(signals_to_handle="TERM")],
     "'TERM' is not a signal name; write 'SIGTERM'"),
    (["--rdzv-endpoint", "h:1", "--rdzv-backend", "a b"], {},
     [lambda: _config(rdzv_backend="a b", rdzv_endpoint="h:1")],
     "'a b' is not a rendezvous backend name"),
    ([*_C10D, "--rdzv-endpoint", "[::1"], {}, [lambda: _config(rdzv_endpoint="[::1")],
     "'[::1' has no valid host"),
    ([*_C10D, "--rdzv-endpoint", "h:99999"], {}, [lambda: _config(rdzv_endpoint="h:99999")],
     "'h:99999' has no valid port"),
    ([*_C10D, "--rdzv-endpoint", "h1:29400,h2:29400"], {},
     [lambda: _config(rdzv_endpoint="h1:29400,h2:29400")],
     "'h1:29400,h2:29400' names several servers, and the 'c10d' rendezvous has one: give one "
     "HOST:PORT (a list is for the etcd backends, each a member of one cluster)"),
    (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h1:2379,"], {},
     [lambda: _config(rdzv_backend="etcd-v2", rdzv_endpoint="h1:2379,")],
     "'h1:2379,' has an empty member; give HOST:PORT,HOST:PORT"),
    (["--rdzv-conf", "join_timeout"], {}, [lambda: _config(rdzv_configs="join_timeout")],
     "item 'join_timeout' is not KEY=VALUE"),
    (["--signals-to-handle", "TERM"], {}, [lambda: _config(signals_to_handle="TERM"),
                                           lambda: _agent(signals_to_handle="TERM")],
     "'TERM' is not a signal name; write 'SIGTERM'"),
    (["--signals-to-handle", "SIGTERM,SIGKILL"], {},
     [lambda: _config(signals_to_handle="SIGTERM,SIGKILL")], "SIGKILL cannot be handled"),
    (["--ranks-filter", "5-2"], {},
     [lambda: _config(ranks_filter="5-2"), lambda: _agent(ranks_filter="5-2")],
     "'5-2' is not a comma-separated list of global ranks and ranges (e.g. 0,8-15)"),
    (["--local-ranks-filter", "a"], {}, [lambda: _config(local_ranks_filter="a"),
                                         lambda: _agent(local_ranks_filter="a")],
     "'a' is not a comma-separated list of local ranks"),
    (["--nproc-per-node", "2", "--local-ranks-filter", "5"], {},
     [lambda: _config(nproc_per_node=2, local_ranks_filter={5}),
      lambda: _agent(local_ranks_filter={5}),
      lambda: _start(local_ranks_filter={5})], "names local rank 5, but there are local ranks"),
    (["--tee", "5:1"], {}, [lambda: _config(tee={5: Std.OUT}), lambda: _agent(tee={5: Std.OUT}),
                            lambda: _start(tee={5: Std.OUT})],
     "local rank 5 in {5: <Std.OUT: 1>} is out of range: local ranks are 0..0"),
    (["--redirects", "5:1"], {},
     [lambda: _config(redirects={5: Std.OUT}), lambda: _agent(redirects={5: Std.OUT}),
      lambda: _start(redirects={5: Std.OUT})],
     "local rank 5 in {5: <Std.OUT: 1>} is out of range: local ranks are 0..0"),
    (["--no-retry-exit-codes", "0"], {}, [lambda: _config(no_retry_exit_codes={0}),
                                          lambda: _spec(no_retry_exit_codes={0})],
     "0 is success, not a failing exit code"),
    (["--no-retry-exit-codes", "300"], {}, [lambda: _config(no_retry_exit_codes={300})],
     "300 is not an exit code (1..255, or -N for signal N)"),
    (["--log-line-prefix-template", "${nope}"], {},
     [lambda: _config(log_line_prefix_template="${nope}"),
      lambda: _agent(log_line_prefix_template="${nope}"),
      lambda: _start(log_line_prefix="${nope}")], "'${nope}' is not a valid template"),
    (["--role", "a\nb"], {}, [lambda: _config(role="a\nb"), lambda: _spec(role="a\nb"),
                              lambda: _start(name="a\nb")], "contains a NUL, a line break"),
    (["--role", _LONG], {}, [lambda: _config(role=_LONG), lambda: _start(name=_LONG)],
     "is 300 bytes long; a file name allows 255"),
    (["--role", "a/b"], {}, [lambda: _spec(role="a/b")], "must not contain a path separator"),
    (["--start-method", "thread"], {}, [lambda: _config(start_method="thread"),
                                        lambda: _agent(start_method="thread"),
                                        lambda: _start(start_method="thread")],
     "'thread' is not one of 'spawn', 'fork', 'forkserver'"),
    (["--stall-timeout", "0"], {}, [lambda: _config(stall_timeout=0),
                                    lambda: _agent(stall_timeout=0),
                                    lambda: _start(stall_timeout=0)], "0 is not > 0 seconds"),
    (["--collapse-identical-lines", "0"], {},
     [lambda: _config(collapse_identical_lines=0), lambda: _agent(collapse_identical_lines=0),
      lambda: _start(collapse_identical_lines=0)], "0 is not > 0 seconds; give the window"),
    ([], {"PET_COLLAPSE_IDENTICAL_LINES": "60"},
     [lambda: _config(collapse_identical_lines=60), lambda: _agent(collapse_identical_lines=60),
      lambda: _start(collapse_identical_lines=60)], "60 seconds is longer than 10"),
    (["--metrics-port", "70000"], {}, [lambda: _config(metrics_port=70000),
                                       lambda: _agent(metrics_port=70000)],
     "70000 is not a port number 0..65535"),
    (["--metrics-host", ""], {}, [lambda: _config(metrics_host=""),
                                  lambda: _agent(metrics_host="")],
     "'' is not a host name or address"),
    (["--local-addr", "a b"], {}, [lambda: _config(local_addr="a b")],
     "'a b' is not a host name or address"),
    (["--preload", "json,3d"], {},
     [lambda: _config(forkserver_preload=("json", "3d")),
      lambda: _agent(forkserver_preload=("json", "3d")),
      lambda: _start(forkserver_preload=("json", "3d"))], "'3d' is not a module name"),
    ([], {"PET_PRELOAD": "a..b"}, [lambda: _config(forkserver_preload=("a..b",))],
     "'a..b' is not a module name"),
    (["--restart-backoff", "-1"], {}, [lambda: RestartBackoff(initial=-1)],
     "-1 is not >= 0 seconds"),
    (["--restart-backoff", "1", "--restart-backoff-max", "inf"], {},
     [lambda: RestartBackoff(initial=1, maximum=float("inf"))],
     "inf is not a finite number of seconds"),
    (["--master-addr", "a b"], {}, [lambda: _spec(master_addr="a b")],
     "'a b' is not a host name or address"),
    (["--local-addr", "a b"], {}, [lambda: _spec(local_addr="a b")],
     "'a b' is not a host name or address"),
]  # fmt: skip


# --rdzv-conf for torch's own backends, and --log-dir: rows of BAD_VALUES too.

_FILE = str(REPO / "pyproject.toml")
_C10D_HERE = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]


def _handler(backend: str, **options: Any) -> None:
    from aioelastic import create_rdzv_handler

    asyncio.run(create_rdzv_handler(backend, "127.0.0.1:0", "job", 1, 1, **options))


def _launched(**kw: Any) -> None:
    from aioelastic import LaunchConfig, elastic_launch

    config = LaunchConfig(**{"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, **kw})
    asyncio.run(elastic_launch(config, "/bin/true")())


BAD_VALUES += [
    ([*_C10D_HERE, "--rdzv-conf", "join_timeout=-5"], {},
     [lambda: _handler("c10d", join_timeout=-5), lambda: _handler("c10d", join_timeout="-5"),
      lambda: _launched(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                        rdzv_configs={"join_timeout": -5})],
     "join_timeout=-5 is not a whole number of seconds >= 1 (e.g. join_timeout=600)"),
    ([*_C10D_HERE, "--rdzv-conf", "timeout=abc"], {},
     [lambda: _handler("c10d", timeout="abc"),
      lambda: _launched(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                        rdzv_configs={"timeout": "abc"})],
     "timeout='abc' is not a whole number of seconds (e.g. timeout=900); the c10d backend "
     "ignores timeout anyway (its wait for nodes is join_timeout): drop it"),
    ([*_C10D_HERE, "--rdzv-conf", "heartbeat=5"], {},
     [lambda: _handler("c10d", heartbeat=5),
      lambda: _launched(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                        rdzv_configs={"heartbeat": 5})],
     "'heartbeat' is not an option of torch's c10d rendezvous backend, which reads "
     "close_timeout, heartbeat_timeout, is_host, join_timeout, keep_alive_interval, "
     "keep_alive_max_attempt, last_call_timeout, read_timeout, store_type: fix the name or "
     "drop it"),
    (["--master-port", "0", "--rdzv-conf", "join_timeout=60"], {},
     [lambda: _handler("static", rank=0, join_timeout=60)],
     "'join_timeout' is not an option of torch's static rendezvous backend, which reads "
     "rank, timeout: fix the name or drop it"),
    (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf",
      "protocol=ftp"], {}, [lambda: _handler("etcd-v2", protocol="ftp")],
     "protocol='ftp' is not one of 'http', 'https'"),
    (["--log-dir", _FILE], {},
     [lambda: _start(log_dir=_FILE), lambda: _agent(log_dir=_FILE),
      lambda: _launched(log_dir=Path(_FILE))],
     f"{_FILE!r} is a file, not a directory; give the path of a directory (made if missing)"),
    (["--log-dir", f"{_FILE}/logs"], {},
     [lambda: _start(log_dir=f"{_FILE}/logs"),
      lambda: _agent(log_dir=f"{_FILE}/logs"),
      lambda: _launched(log_dir=f"{_FILE}/logs")],
     f"'{_FILE}/logs' is under {_FILE!r}, a file, not a directory; give the path of a "
     "directory (made if missing)"),
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "env", "api", "message"), BAD_VALUES, ids=[row[3][:40] for row in BAD_VALUES]
)
def test_a_bad_value_reads_the_same_from_the_cli_and_the_api(
    argv: list[str],
    env: dict[str, str],
    api: list[Callable[[], None]],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "aioelastic.run", *argv, SCRIPT],
        cwd=REPO,
        env=with_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - started < 60
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("usage: aioelastic-run"), run.stderr
    error = run.stderr.splitlines()[-1]
    assert error.startswith("aioelastic-run: error: "), run.stderr
    named = [arg for arg in argv if arg.startswith("--")][-1:] or list(env)
    assert named[0] in error
    assert message in error
    assert "Traceback" not in run.stderr
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for call in api:
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        assert message in str(info.value)


@pytest.mark.timeout(60)
def test_a_garbage_rdzv_endpoint_is_refused_before_torch_is_imported() -> None:
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "aioelastic.run", *_C10D,
         "--rdzv-endpoint", "no such host!:29400", SCRIPT],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "argument --rdzv-endpoint/--rdzv_endpoint: 'no such host!:29400' has no valid host" in (
        run.stderr
    )
    assert re.search(r"\|\s+aioelastic\._cli\._cli_flags$", run.stderr, re.MULTILINE)
    imported = [line for line in run.stderr.splitlines() if re.search(r"\|\s+torch$", line)]
    assert imported == []


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


# -- signals --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigterm_stops_workers_and_their_children_within_the_shutdown_timeout() -> None:
    with launcher("--nproc-per-node", "2", "--shutdown-timeout", "1", SCRIPT, "hold") as run:
        ready = run.wait_for(READY, 2)
        pids = [int(m[2]) for m in ready] + [int(m[3]) for m in ready]
        started = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == 128 + signal.SIGTERM
        took = time.monotonic() - started
    assert wait_all_gone(pids, 0) == []
    # The children ignore SIGTERM, so they hold their groups for the whole grace period.
    assert 1.0 <= took < 15, took
    assert "stopped by SIGTERM" in run.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("flags", "saved"), [(["--stop-leader-first"], "saved step 0"), ([], "helper gone")]
)
def test_stop_leader_first_lets_a_trainer_checkpoint_with_its_helper_on_sigterm(
    tmp_path: Path, flags: list[str], saved: str
) -> None:
    """The trainer saves on SIGTERM through its helper child: with the flag the helper is
    still there to answer (and stopped right after); without it, as under torchrun, the
    helper got the SIGTERM too."""
    with launcher(*flags, SCRIPT, "checkpoint", "--out", str(tmp_path)) as run:
        (ready,) = run.wait_for(READY, 1)
        pids = [int(ready[2]), int(ready[3])]
        started = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == 128 + signal.SIGTERM, run.stderr
        took = time.monotonic() - started
    assert (tmp_path / "rank0").read_text() == saved
    assert wait_all_gone(pids, 0) == []
    assert took < 20, took  # far from the 30 s grace period: nothing waited it out


@pytest.mark.timeout(60)
def test_a_worker_child_that_left_its_process_group_is_stopped_too() -> None:
    with launcher("--nproc-per-node", "2", SCRIPT, "hold", "--escape") as run:
        ready = run.wait_for(READY, 2)
        children = [int(m[3]) for m in ready]
        assert all(os.getpgid(c) == c for c in children)  # out of the workers' groups
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == 128 + signal.SIGTERM, run.stderr
    # Orphaned when their worker stopped, re-parented to the launcher (a subreaper), and
    # swept by its teardown.
    assert wait_all_gone(children, 0) == []


@pytest.mark.timeout(60)
def test_sigint_exits_130_and_a_second_signal_kills_at_once() -> None:
    with launcher(
        "--nproc-per-node", "2", "--shutdown-timeout", "300", SCRIPT, "hold", "--ignore-signals",
        env=with_env(LOGLEVEL="INFO"),
    ) as run:  # fmt: skip
        ready = run.wait_for(READY, 2)
        pids = [int(m[2]) for m in ready] + [int(m[3]) for m in ready]
        run.proc.send_signal(signal.SIGINT)
        run.wait_for_stderr("received SIGINT")
        # The workers and their children ignore SIGTERM and SIGINT alike: only the second
        # signal's SIGKILL ends them, long before the 300 s grace period.
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 128 + signal.SIGINT
    assert wait_all_gone(pids, 0) == []


@pytest.mark.timeout(60)
def test_three_quick_sigterms_leave_nothing_alive() -> None:
    # The kernel merges a signal sent while the same one is still pending, so the launcher
    # may see one, two or three of these: whichever, it must stop everything and exit 143
    # (torchrun exits at the second with its workers still running).
    with launcher(
        "--nproc-per-node", "2", "--shutdown-timeout", "2", SCRIPT, "hold", "--ignore-signals"
    ) as run:
        ready = run.wait_for(READY, 2)
        pids = [int(m[2]) for m in ready] + [int(m[3]) for m in ready]
        for _ in range(3):
            run.proc.send_signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 128 + signal.SIGTERM
    assert wait_all_gone(pids, 0) == []


@pytest.mark.timeout(60)
def test_sigkill_to_the_launcher_leaves_no_worker_and_no_worker_child() -> None:
    with launcher("--nproc-per-node", "2", SCRIPT, "hold", "--ignore-signals") as run:
        ready = run.wait_for(READY, 2)
        workers = [int(m[2]) for m in ready]
        children = [int(m[3]) for m in ready]
        helpers = [p for p in child_pids(run.proc.pid) if p not in workers]
        run.proc.kill()
        assert run.finish() == -signal.SIGKILL
    # Workers die of PR_SET_PDEATHSIG; their children (re-parented to init) and the
    # watchdog go right after.
    assert wait_all_gone(workers + children + helpers, 10) == []


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("handled", "sent"), [("SIGTERM,SIGINT", signal.SIGINT), ("SIGUSR1", signal.SIGUSR1)]
)
def test_workers_receive_the_signal_the_launcher_received(handled: str, sent: int) -> None:
    with launcher(
        "--nproc-per-node", "2", "--signals-to-handle", handled, SCRIPT, "catch"
    ) as run:  # fmt: skip
        run.wait_for(READY, 2)
        run.proc.send_signal(sent)
        assert run.finish() == 128 + sent, run.stderr
    name = signal.Signals(sent).name
    assert sorted(re.findall(rf"caught {name} rank=(\d)", run.stdout)) == ["0", "1"], run.stdout


@pytest.mark.timeout(60)
def test_logs_specs_default_runs_the_job_in_torchs_own_layout() -> None:
    # 'default' is the torchrun.logs_specs entry point torch's wheel installs
    # (DefaultLogsSpecs): the layout aioelastic-run writes anyway.
    run = launch("--logs-specs", "default", "--nproc-per-node", "2", SCRIPT, "env")
    assert run.proc.returncode == 0, run.stderr
    assert len(env_lines(run)) == 2
