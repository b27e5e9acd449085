"""The torchrun-compatible command line: names, aliases, defaults, PET_* overrides, commands.

Each torchrun flag is checked against torch's own parser (torch.distributed.run), so a
difference in a name, an alias or a default fails here rather than in a user's job script;
so are the flags refused because they cannot be honoured, the forms of the command run
(``-m``, ``--no-python``, ``--run-path``) and ``--help``. The nodes of a job:
test_cli_nodes.py; values and the config they make: test_cli_values.py.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from typing import Any

import pytest

from aioelastic import LaunchConfig
from aioelastic._cli._cli_flags import FLAGS
from aioelastic._cli._cli_parser import build_parser, parse_args
from aioelastic._cli._cli_plan import config_from_args
from aioelastic._core.output._std import Std
from tests.support.cli_args import SCRIPT_ARGS as _SCRIPT, command, config, launch, refusal


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
