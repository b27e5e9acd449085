"""The torchrun-compatible command line: names, aliases, defaults, PET_* overrides, rules.

Each torchrun flag is checked against torch's own parser (torch.distributed.run), so a
difference in a name, an alias or a default fails here rather than in a user's job script.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from aioelastic import LaunchConfig
from aioelastic._cli._cli_flags import FLAGS, flag_for
from aioelastic._cli._cli_parser import build_parser, parse_args
from aioelastic._cli._cli_plan import CommandLine, config_from_args, resolve_nproc_per_node
from aioelastic._core.output._std import Std

# Flags of torch's parser that torchrun marks private or that only torch.distributed.launch
# has; everything else must exist here under the same spellings.
_SCRIPT = ["train.py", "--lr", "0.1"]


def launch(
    argv: list[str], environ: Mapping[str, str] | None = None, **kw: Any
) -> tuple[LaunchConfig, CommandLine]:
    env = {} if environ is None else dict(environ)
    return config_from_args(parse_args([*argv, *_SCRIPT], env), env, **kw)


def config(argv: list[str], environ: Mapping[str, str] | None = None, **kw: Any) -> LaunchConfig:
    return launch(argv, environ, **kw)[0]


def command(argv: list[str], environ: Mapping[str, str] | None = None) -> CommandLine:
    return launch(argv, environ)[1]


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str], **kw: Any) -> str:
    """Why the command line is refused: argparse's error (exit 2) or the launch's ValueError."""
    capsys.readouterr()
    try:
        launch(argv, **kw)
    except ValueError as e:
        return str(e)
    except SystemExit as e:
        code = e.code
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith("usage: aioelastic-run")
        return err
    raise AssertionError(f"{argv} was accepted")


def torch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: action for action in parser._actions for opt in action.option_strings}


@pytest.mark.torch
def test_every_torchrun_flag_has_the_same_spellings_and_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    theirs = _options(torch_parser())
    ours = _options(build_parser({}))
    missing = sorted(set(theirs) - set(ours) - {"-h", "--help"})
    assert not missing, f"torchrun flags not accepted: {missing}"
    for option, action in theirs.items():
        if option in ("-h", "--help"):
            continue
        mine = ours[option]
        assert mine.dest == action.dest, option
        assert set(mine.option_strings) == set(action.option_strings), option
        if action.dest in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            assert action.default == []
            assert mine.default == ""
        elif action.dest == "shutdown_timeout":
            assert action.default is None
            assert mine.default is None
        else:
            assert mine.default == action.default, option
        if action.choices is not None and action.dest != "numa_binding":
            assert list(mine.choices or ()) == list(action.choices), option


def test_defaults_without_flags_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    c, cmd = launch([])
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node) == (1, 1, 1)
    assert (c.rdzv_backend, c.rdzv_endpoint) == ("c10d", "")  # single node, no store
    assert c.max_restarts == 0
    assert c.monitor_interval == 0.1
    assert c.start_method == "spawn"
    assert c.role == "default"
    assert c.log_dir is None
    assert cmd.log_dir is None
    assert c.redirects == Std.NONE
    assert c.tee == Std.NONE
    assert c.local_ranks_filter is None
    assert c.shutdown_timeout == 30.0
    assert c.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert c._derived().agent.signals == (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    assert cmd.entrypoint == sys.executable
    assert cmd.args == ("-u", "train.py", "--lr", "0.1")
    assert c.restart_backoff is None
    assert c.no_retry_exit_codes == frozenset()
    assert c.stop_leader_first is False

    assert c.collapse_identical_lines is None
    assert cmd.warnings == ()


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["--nproc-per-node", "3"], "nproc_per_node", 3),
        (["--nproc_per_node=3"], "nproc_per_node", 3),
        (["--max_restarts", "2"], "max_restarts", 2),
        (["--max-restarts=2"], "max_restarts", 2),
        (["--start_method", "fork"], "start_method", "fork"),
        (["--role", "trainer"], "role", "trainer"),
        (["--shutdown_timeout", "2.5"], "shutdown_timeout", 2.5),
        (["--log_dir", "/tmp/x"], "log_dir", "/tmp/x"),
        (["-r", "3"], "redirects", Std.ALL),
        (["--redirects", "1"], "redirects", Std.OUT),
        (["--local_ranks_filter", "0"], "local_ranks_filter", frozenset({0})),
        (["--signals_to_handle", "SIGUSR1,SIGTERM"], "signals_to_handle", "SIGUSR1,SIGTERM"),
        (["--stop-leader-first"], "stop_leader_first", True),
    ],
)
def test_dashed_underscored_and_short_spellings(argv: list[str], dest: str, value: Any) -> None:
    if dest == "log_dir":
        assert command(argv).log_dir == value
    else:
        assert getattr(config(argv), dest) == value


def test_pet_environment_sets_defaults_and_the_command_line_wins() -> None:
    env = {
        "PET_NPROC_PER_NODE": "4",
        "PET_MAX_RESTARTS": "5",
        "PET_NNODES": "1",
        "PET_START_METHOD": "forkserver",
        "PET_MODULE": "1",
        "PET_RESTART_BACKOFF": "0.5",
        "PET_NO_RETRY_EXIT_CODES": "2,3",
        "PET_TEE": "3",
    }
    c, cmd = launch([], env)
    assert c.nproc_per_node == 4
    assert c.max_restarts == 5
    assert c.start_method == "forkserver"
    assert cmd.args[:3] == ("-u", "-m", "train.py")
    assert c.restart_backoff is not None
    assert c.restart_backoff.initial == 0.5
    assert c.no_retry_exit_codes == {2, 3}
    assert c.tee == Std.ALL
    c = config(["--nproc-per-node", "2", "--max-restarts", "1"], env)
    assert (c.nproc_per_node, c.max_restarts) == (2, 1)


def test_stop_leader_first_reaches_the_agent_and_takes_only_a_bool() -> None:
    from aioelastic import LocalElasticAgent, WorkerSpec

    assert config([], {"PET_STOP_LEADER_FIRST": "1"})._derived().agent.options.stop_leader_first
    assert not config([], {"PET_STOP_LEADER_FIRST": "0"}).stop_leader_first
    spec = WorkerSpec(local_world_size=1, entrypoint="/bin/true")
    for bad in ("yes", 1, None):
        message = f"stop_leader_first: {bad!r} ({type(bad).__name__}) is not True or False"
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, stop_leader_first=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            LocalElasticAgent(spec, stop_leader_first=bad)  # type: ignore[arg-type]


def test_collapse_identical_lines_reaches_the_agent_from_the_flag_or_the_environment() -> None:
    for c in (
        config(["--collapse-identical-lines", "0.25"]),
        config([], {"PET_COLLAPSE_IDENTICAL_LINES": "0.25"}),
    ):
        assert c.collapse_identical_lines == 0.25
        assert c._derived().agent.options.collapse_identical_lines == 0.25
    # An empty variable is as good as none: every line is shown.
    assert config([], {"PET_COLLAPSE_IDENTICAL_LINES": ""}).collapse_identical_lines is None


def test_switch_from_environment_accepts_zero() -> None:
    cmd = command([], {"PET_MODULE": "0", "PET_STANDALONE": "false"})
    assert "-m" not in cmd.args
    assert cmd.warnings == ()


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PET_MAX_RESTARTS": "many"}, "PET_MAX_RESTARTS='many'"),
        ({"PET_START_METHOD": "thread"}, "PET_START_METHOD='thread'"),
        ({"PET_NO_PYTHON": "maybe"}, "PET_NO_PYTHON='maybe'"),
        ({"PET_STOP_LEADER_FIRST": "maybe"}, "PET_STOP_LEADER_FIRST='maybe'"),
    ],
)
def test_bad_pet_value_names_the_variable(
    env: dict[str, str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(_SCRIPT, env)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_torchrun_prefix_template_env_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}:${rank}]"}
    assert config([], env).log_line_prefix_template == "[${role_name}:${rank}]"
    assert config(["--log-line-prefix-template", "<${local_rank}>"], env).log_line_prefix_template
    assert "${local_rank}" in refusal(["--log-line-prefix-template", "${nope}"], capsys)


def test_shutdown_timeout_falls_back_to_torch_env(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read by LaunchConfig, from the process environment, and nowhere else.
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert config([]).shutdown_timeout == 7.0
    assert config(["--shutdown-timeout", "3"]).shutdown_timeout == 3.0
    assert ">= 0" in refusal(["--shutdown-timeout", "-1"], capsys)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    assert refusal([], capsys) == (
        "argument --shutdown-timeout/--shutdown_timeout: TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon': "
        "'soon' is not a number of seconds (e.g. 30 or 0.5); fix or unset it"
    )


@pytest.mark.parametrize(
    ("text", "expected"), [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3))]
)
def test_nnodes_forms(text: str, expected: tuple[int, int]) -> None:
    c = config(["--nnodes", text, "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"])
    assert (c.min_nodes, c.max_nodes) == expected


@pytest.mark.parametrize("text", ["0", "2:1", "a", "1:2:3", "", "-1:2"])
def test_bad_nnodes_is_refused(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f"--nnodes={text}", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"]
    assert "--nnodes" in refusal(argv, capsys)


def test_nproc_per_node_cpu_counts_usable_cores() -> None:
    assert resolve_nproc_per_node("cpu") == len(os.sched_getaffinity(0))
    assert config(["--nproc-per-node", "cpu"]).nproc_per_node == len(os.sched_getaffinity(0))


def test_nproc_per_node_int_and_refusals() -> None:
    assert resolve_nproc_per_node(" 7 ") == 7
    with pytest.raises(ValueError, match=">= 1"):
        resolve_nproc_per_node("0")
    with pytest.raises(ValueError, match="int, cpu, auto"):
        resolve_nproc_per_node("2.5")


@pytest.mark.torch
def test_nproc_per_node_auto_matches_torchrun() -> None:
    from torch.distributed.run import determine_local_world_size

    assert resolve_nproc_per_node("auto") == determine_local_world_size("auto")


def test_nproc_per_node_names_are_resolved_lazily() -> None:
    seen: list[str] = []

    def resolver(text: str) -> int:
        seen.append(text)
        return 5

    assert config(["--nproc-per-node", "auto"], nproc_resolver=resolver).nproc_per_node == 5
    assert seen == ["auto"]


@pytest.mark.timeout(60)
def test_logs_specs_default_is_torchs_own_layout_and_is_accepted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 'default' is the torchrun.logs_specs entry point torch's wheel installs
    # (DefaultLogsSpecs): the layout aioelastic-run writes anyway.
    assert command(["--logs-specs", "default"]).warnings == ()
    assert command([], {"PET_LOGS_SPECS": "default"}).warnings == ()
    refused = refusal(["--logs_specs", "mine"], capsys)
    assert refused.startswith("--logs-specs='mine' cannot be honoured")
    assert "only 'default' (torch's DefaultLogsSpecs" in refused


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--logs-specs", "custom"], "LogsSpecs"),
        (["--numa-binding", "node"], "NUMA"),
        (["--duplicate-stdout-filters", "loss"], "duplicating"),
        (["--duplicate_stderr_filters", "loss"], "duplicating"),
        (["--event-log-handler", "console"], "event log"),
    ],
)
def test_flags_we_cannot_honour_are_refused(argv: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        launch(argv)
    assert "cannot be honoured" in str(info.value)


def test_refused_flags_at_their_default_are_accepted() -> None:
    assert config(["--event-log-handler", "null"]).event_log_handler == "null"


def _standalone(c: LaunchConfig) -> bool:
    """LaunchConfig's single-node launch without a rendezvous store (torchrun's standalone)."""
    return c.rdzv_endpoint == "" and c.max_nodes == 1 and c._derived().store is None


def test_standalone_is_one_node_with_a_fresh_id_and_ignores_rendezvous_flags() -> None:
    c, cmd = launch(["--standalone", "--rdzv-backend", "etcd", "--rdzv-id", "job7"])
    assert _standalone(c)
    assert c.run_id not in ("none", "job7")
    assert len(c.run_id) == 36
    assert config(["--standalone"]).run_id != c.run_id
    assert any("--standalone ignores" in w and "job7" in w for w in cmd.warnings)
    assert command(["--standalone"]).warnings == ()
    assert _standalone(config([], {"PET_STANDALONE": "1"}))


def test_standalone_refuses_more_than_one_node() -> None:
    with pytest.raises(ValueError, match="--standalone runs a single node"):
        launch(["--standalone", "--nnodes", "1:2"])


def test_bare_single_node_is_like_standalone() -> None:
    c = config(["--nproc-per-node", "2"])
    assert _standalone(c)
    assert len(c.run_id) == 36


def test_single_node_with_master_port_keeps_it() -> None:
    c = config(["--master-port", "29611", "--master-addr", "10.0.0.1"])
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == ("static", "10.0.0.1:29611", "none")
    assert c._derived().store == ("10.0.0.1", 29611)
    assert c.rdzv_configs["rank"] == 0


def test_multi_node_static_uses_master_addr_and_port() -> None:
    c = config(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "9"])
    assert c.rdzv_backend == "static"
    assert c.rdzv_endpoint == "h0:9"
    assert c.rdzv_configs == {"rank": 1, "timeout": 900}
    assert c._derived().store == ("h0", 9)
    assert config(["--nnodes", "2"]).rdzv_endpoint == "127.0.0.1:29500"  # torchrun's port


def test_static_rendezvous_needs_fixed_node_count_and_rank_in_range() -> None:
    with pytest.raises(ValueError, match="fixed number of nodes"):
        launch(["--nnodes", "1:2"])
    with pytest.raises(ValueError, match="--node-rank=2 is out of range"):
        launch(["--nnodes", "2", "--node-rank", "2"])


@pytest.mark.parametrize(
    ("endpoint", "nodes", "store"),
    [
        ("h0:29400", 2, ("h0", 29400)),
        ("[::1]:29400", 2, ("::1", 29400)),
        ("h0:29400", 1, ("h0", 29400)),
        ("h0:0", 1, ("h0", None)),
        ("h0", 1, ("h0", None)),
    ],
)
def test_the_static_store_address_is_decided_once_for_the_cli_and_the_api(
    endpoint: str, nodes: int, store: tuple[str, int | None]
) -> None:
    from aioelastic._elastic.launch._elastic_launch import static_store

    assert static_store(endpoint, nodes) == store
    api = LaunchConfig(
        min_nodes=nodes, max_nodes=nodes, nproc_per_node=1, rdzv_backend="static",
        rdzv_endpoint=endpoint,
    )  # fmt: skip
    cli = config(["--nnodes", str(nodes), "--rdzv-endpoint", endpoint])
    assert api._derived().store == cli._derived().store == store


@pytest.mark.parametrize("endpoint", ["h0:0", "h0"])
def test_a_static_store_of_several_nodes_needs_a_fixed_port(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = (
        "the static rendezvous of 2 nodes needs a fixed port every node can reach, "
        f"got {endpoint!r}"
    )
    with pytest.raises(ValueError, match=re.escape(f"rdzv_endpoint: {message}")):
        LaunchConfig(
            min_nodes=2, max_nodes=2, nproc_per_node=1, rdzv_backend="static",
            rdzv_endpoint=endpoint,
        )  # fmt: skip
    assert f"argument --rdzv-endpoint/--rdzv_endpoint: {message}" in refusal(
        ["--nnodes", "2", "--rdzv-endpoint", endpoint], capsys
    )


def test_c10d_needs_an_endpoint_and_parses_rdzv_conf(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        launch(["--rdzv-backend", "c10d", "--nnodes", "1:2"])
    c = config(
        [
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:29400",
            "--rdzv-id=job",
            "--nnodes=1:2",
            "--rdzv-conf=join_timeout=60, last_call_timeout=2",
        ]
    )
    assert c.rdzv_configs == {"join_timeout": "60", "last_call_timeout": "2", "timeout": 900}
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == ("c10d", "127.0.0.1:29400", "job")
    assert c._derived().store is None
    assert "KEY=VALUE" in refusal(["--rdzv-conf", "join_timeout"], capsys)


def test_rdzv_conf_is_checked_for_torchs_backends_and_passed_as_is_to_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    given = "join_timeout=-5,heartbeat=x,timeout=abc"
    mine = config(["--rdzv-backend", "mine", "--rdzv-endpoint", "h:1", "--rdzv-conf", given])
    assert mine.rdzv_configs == {"join_timeout": "-5", "heartbeat": "x", "timeout": "abc"}
    for argv, message in [
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"],
         "join_timeout=-5 is not a whole number of seconds >= 1 (e.g. join_timeout=600)"),
        (["--standalone"], "join_timeout=-5 is not a whole number of seconds >= 1"),
        ([], "join_timeout=-5 is not a whole number of seconds >= 1"),  # c10d, as torchrun
        (["--nnodes", "2"], "'join_timeout' is not an option of torch's static rendezvous "
         "backend, which reads rank, timeout: fix the name or drop it"),
    ]:  # fmt: skip
        refused = refusal([*argv, "--rdzv-conf", given], capsys)
        assert "argument --rdzv-conf/--rdzv_conf: " + message in refused


def test_a_timeout_the_backend_ignores_is_said_to_be_ignored() -> None:
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"]
    warnings = command([*c10d, "--rdzv-conf", "timeout=60"]).warnings
    assert warnings == (
        "--rdzv-conf timeout=60 is ignored by the c10d rendezvous backend (as in torchrun); "
        "its wait for nodes is join_timeout",
    )
    assert command([*c10d, "--rdzv-conf", "join_timeout=60"]).warnings == ()
    assert command(["--nnodes", "2", "--rdzv-conf", "timeout=60"]).warnings == ()  # static


def test_warnings_for_flags_the_backend_ignores() -> None:
    p = command(
        [
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=h:1",
            "--nnodes=2",
            "--node-rank=1",
            "--master-addr=h0",
        ]
    )
    assert len(p.warnings) == 2
    assert any("--master-addr" in w for w in p.warnings)
    assert any("--node-rank" in w for w in p.warnings)


def test_module_no_python_and_run_path_commands() -> None:
    from aioelastic.run import run_script_path

    assert command(["-m"]).args == ("-u", "-m", "train.py", "--lr", "0.1")
    assert command(["--module"]).entrypoint == sys.executable
    p = command(["--no-python"])
    assert (p.entrypoint, p.args) == ("train.py", ("--lr", "0.1"))
    assert p.target() == ("train.py", ("--lr", "0.1"))
    with pytest.raises(ValueError, match="cannot be used together"):
        launch(["--no-python", "-m"])
    _, p = config_from_args(parse_args(["--run-path", "/abs/train.py", "x"], {}), {})
    assert (p.run_path, p.entrypoint, p.args) == (True, "/abs/train.py", ("x",))
    assert p.target() == (run_script_path, ("/abs/train.py", "x"))
    with pytest.raises(ValueError, match="absolute path"):
        launch(["--run-path"])
    assert command([], {"PYTHON_EXEC": "/opt/py"}).entrypoint == "/opt/py"
    # Our own interpreter runs the script through the stack hook; PYTHON_EXEC's as is.
    assert command([]).target() == (
        sys.executable,
        ("-u", "-m", "aioelastic.stack_hook", "train.py", "--lr", "0.1"),
    )
    assert command([], {"PYTHON_EXEC": "/opt/py"}).target()[1][:2] == ("-u", "train.py")


def test_script_arguments_that_look_like_our_flags_belong_to_the_script() -> None:
    ns = parse_args(["--nproc-per-node", "2", "train.py", "--nproc-per-node", "9", "-m"], {})
    assert ns.nproc_per_node == "2"
    assert ns.training_script_args == ["--nproc-per-node", "9", "-m"]
    assert not ns.module


def test_tee_implies_files_as_in_torchrun() -> None:
    c = config(["--nproc-per-node", "3", "--tee", "0:1,2:2", "--redirects", "0:2"])
    assert c.tee == {0: Std.OUT, 2: Std.ERR}
    assert c.redirects == {0: Std.ALL, 1: Std.NONE, 2: Std.ERR}
    c = config(["--tee", "1", "--redirects", "2"])
    assert c.redirects == Std.ALL


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--redirects", "4"], "argument -r/--redirects: invalid Std value '4'"),
        (["--tee", "0:1", "--nproc-per-node", "1", "--redirects", "5:1"], "local rank 5"),
        (["--local-ranks-filter", "a"], "comma-separated"),
        (["--nproc-per-node", "2", "--local-ranks-filter", "3"], "local rank 3"),
        (["--signals-to-handle", "SIGNOPE"], "'SIGNOPE' is not a signal"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
        (["--no-retry-exit-codes", "0"], "0 is success"),
        (["--no-retry-exit-codes", "x"], "comma-separated"),
        (["--max-restarts", "-1"], ">= 0"),
        (["--monitor-interval", "0"], "> 0"),
        (["--restart-backoff", "-1"], ">= 0"),
        (["--master-port", "70000"], "0..65535"),
        (["--rdzv-endpoint", ":5"], "no valid host"),
        (["--rdzv-endpoint", "[::1"], "no valid host"),
        (["--nnodes", "2", "--master-port", "0"], "needs a fixed port"),
    ],
)
def test_bad_values_are_refused_with_the_flag_named(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = refusal(argv, capsys)
    assert fragment in message
    # The flag given last is the one at fault, and the message names it.
    flag = flag_for([arg for arg in argv if arg.startswith("--")][-1][2:].replace("-", "_"))
    assert "/".join(flag.names) in message


def test_master_port_0_is_a_free_port_for_one_node() -> None:
    assert config(["--master-port", "0"])._derived().store == ("127.0.0.1", None)


def test_empty_signals_to_handle_handles_none() -> None:
    assert config(["--signals-to-handle", ""])._derived().agent.signals == ()


def test_help_marks_our_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"], {})
    assert info.value.code == 0
    out = capsys.readouterr().out
    ours = [flag for flag in FLAGS if flag.ours]
    assert len(ours) >= 3
    for flag in ours:
        assert flag.names[0] in out
    assert out.count("[aioelastic]") == len(ours) + 1  # one more: the epilog explains it
    assert "PET_" in out


def test_missing_script_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args([], {})
    assert info.value.code == 2
    assert "training_script" in capsys.readouterr().err


def test_the_value_parsers_accept_both_spellings_of_a_value() -> None:
    from aioelastic._core.process import _values as values
    from aioelastic._elastic.settings import _node_values as node_values

    # Text from the command line and typed values from the API parse to the same thing.
    assert values.port("0") == values.port(0) == 0
    assert node_values.exit_codes("2,-9") == node_values.exit_codes({2, -9}) == frozenset({2, -9})
    assert values.rank_filter("0,1", 2) == values.rank_filter([1, 0], 2) == frozenset({0, 1})
    assert values.rank_filter("", 2) is values.rank_filter(None, 2) is None
    assert values.duration("0.5") == values.duration(0.5) == 0.5
    assert node_values.nnodes("1:4") == node_values.node_range(1, 4) == (1, 4)
    assert node_values.nnodes(3) == (3, 3)
    assert node_values.signals("SIGTERM, SIGUSR1,SIGTERM") == (signal.SIGTERM, signal.SIGUSR1)
    assert node_values.signals("") == ()
    assert node_values.endpoint("[::1]:29400") == ("::1", 29400)
    assert node_values.endpoint("node0", 29500) == ("node0", 29500)
    assert values.name("trainer-é") == "trainer-é"
    assert node_values.shutdown_timeout(None, {}) == 30.0
    assert node_values.shutdown_timeout(None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "4"}) == 4.0
    assert node_values.shutdown_timeout(2, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "4"}) == 2.0
    with pytest.raises(TypeError, match="True is a bool"):
        values.positive_int(True)
    with pytest.raises(ValueError, match="inf is not a finite number of seconds"):
        values.duration("inf")
    with pytest.raises(TypeError, match="not a collection of exit codes"):
        node_values.exit_codes(2)


@pytest.mark.timeout(60)
def test_a_launch_parses_its_config_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    from aioelastic import elastic_launch
    from aioelastic._elastic.settings import _node_values as node_values
    from aioelastic._elastic.settings._config import AgentConfig

    builds: list[dict[str, Any]] = []
    shutdown_reads: list[object] = []
    build, read = AgentConfig.build.__func__, node_values.shutdown_timeout  # type: ignore[attr-defined]

    def counted_build(cls: type[AgentConfig], **kw: Any) -> AgentConfig:
        builds.append(kw)
        return build(cls, **kw)  # type: ignore[no-any-return]

    def counted_read(value: object, environ: Mapping[str, str] | None = None) -> float:
        shutdown_reads.append(value)
        return read(value, environ)

    monkeypatch.setattr(AgentConfig, "build", classmethod(counted_build))
    monkeypatch.setattr(node_values, "shutdown_timeout", counted_read)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "4")
    c = config(["--nproc-per-node", "2"])
    c.log_dir = tmp_path  # set per run by the launcher: applied, not parsed
    assert asyncio.run(elastic_launch(c, "/bin/true")()) == {0: None, 1: None}
    assert len(builds) == 1
    assert shutdown_reads == [None]
    assert c.shutdown_timeout == 4.0
    assert (tmp_path / "attempt_0" / "0").is_dir()


def test_a_changed_config_is_checked_and_resolved_again() -> None:
    c = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, tee={1: Std.OUT})
    first = c._derived()
    assert c._derived() is first
    assert isinstance(c.tee, dict)
    c.tee[5] = Std.OUT  # a change in place is seen too
    with pytest.raises(ValueError, match=r"^tee: local rank 5 in .* local ranks are 0\.\.1$"):
        c._derived()
    c.tee = Std.ALL
    assert c._derived().agent.options.tee == {0: Std.ALL, 1: Std.ALL}
    c.rdzv_backend, c.rdzv_endpoint = "static", "h0:0"
    assert c._derived().store == ("h0", None)
    copy = pickle.loads(pickle.dumps(c))
    assert copy == c
    assert copy._derived().store == ("h0", None)
