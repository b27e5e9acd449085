"""``aioelastic-run`` refusing what it is given: exit 2 with a message, no traceback.

Usage errors, and one table of bad values that read the same from the command line and
from the API that takes the same value (``LaunchConfig``, ``WorkerSpec``,
``LocalElasticAgent``, ``start_processes``, ``RestartBackoff``, the rendezvous handlers);
a bad endpoint is refused before torch is imported.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioelastic._core.output._std import Std
from aioelastic._elastic.agent._types import RestartBackoff
from tests.support.cli_child import SCRIPT
from tests.support.cli_run import launch, with_env
from tests.support.paths import REPO

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
    (["--forward-signals", "HUP"], {},
     [lambda: _config(forward_signals="HUP"), lambda: _agent(forward_signals="HUP")],
     "SIGHUP both stops the run (signals_to_handle) and is forwarded to the workers "
     "(forward_signals): a signal does one or the other; drop it from one"),
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
