"""The torchrun-compatible command line: names, aliases, defaults, PET_* overrides, rules.

Each torchrun flag is checked against torch's own parser (torch.distributed.run), so a
difference in a name, an alias or a default fails here rather than in a user's job script.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

import pytest

from aioelastic._cli_args import (
    FLAGS,
    build_parser,
    parse_args,
    plan_from_args,
    resolve_nproc_per_node,
)
from aioelastic._std import Std

# Flags of torch's parser that torchrun marks private or that only torch.distributed.launch
# has; everything else must exist here under the same spellings.
_SCRIPT = ["train.py", "--lr", "0.1"]


def plan(argv: list[str], environ: Mapping[str, str] | None = None, **kw: Any) -> Any:
    env = {} if environ is None else dict(environ)
    return plan_from_args(parse_args([*argv, *_SCRIPT], env), env, **kw)


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str], **kw: Any) -> str:
    """Why the command line is refused: argparse's error (exit 2) or the plan's ValueError."""
    capsys.readouterr()
    try:
        plan(argv, **kw)
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


def test_defaults_without_flags_or_environment() -> None:
    p = plan([])
    assert (p.min_nodes, p.max_nodes, p.nproc_per_node) == (1, 1, 1)
    assert p.single_node
    assert p.max_restarts == 0
    assert p.monitor_interval == 0.1
    assert p.start_method == "spawn"
    assert p.role == "default"
    assert p.log_dir is None
    assert p.redirects == Std.NONE
    assert p.tee == Std.NONE
    assert p.local_ranks_filter is None
    assert p.shutdown_timeout == 30.0
    assert p.signals_to_handle == (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    assert p.entrypoint == sys.executable
    assert p.args == ("-u", "train.py", "--lr", "0.1")
    assert p.restart_backoff == 0.0
    assert p.no_retry_exit_codes == frozenset()
    assert p.warnings == ()


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
        (["--signals_to_handle", "SIGUSR1,SIGTERM,SIGINT"], "signals_to_handle", (10, 15, 2)),
    ],
)
def test_dashed_underscored_and_short_spellings(argv: list[str], dest: str, value: Any) -> None:
    assert getattr(plan(argv), dest) == value


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
    p = plan([], env)
    assert p.nproc_per_node == 4
    assert p.max_restarts == 5
    assert p.start_method == "forkserver"
    assert p.args[:3] == ("-u", "-m", "train.py")
    assert p.restart_backoff == 0.5
    assert p.no_retry_exit_codes == {2, 3}
    assert p.tee == Std.ALL
    p = plan(["--nproc-per-node", "2", "--max-restarts", "1"], env)
    assert (p.nproc_per_node, p.max_restarts) == (2, 1)


def test_switch_from_environment_accepts_zero() -> None:
    p = plan([], {"PET_MODULE": "0", "PET_STANDALONE": "false"})
    assert "-m" not in p.args
    assert p.warnings == ()


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PET_MAX_RESTARTS": "many"}, "PET_MAX_RESTARTS='many'"),
        ({"PET_START_METHOD": "thread"}, "PET_START_METHOD='thread'"),
        ({"PET_NO_PYTHON": "maybe"}, "PET_NO_PYTHON='maybe'"),
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
    assert plan([], env).log_line_prefix_template == "[${role_name}:${rank}]"
    assert plan(["--log-line-prefix-template", "<${local_rank}>"], env).log_line_prefix_template
    assert "${local_rank}" in refusal(["--log-line-prefix-template", "${nope}"], capsys)


def test_shutdown_timeout_falls_back_to_torch_env(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout == 7.0
    assert (
        plan(["--shutdown-timeout", "3"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout
        == 3.0
    )
    assert ">= 0" in refusal(["--shutdown-timeout", "-1"], capsys)
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'" in refusal(
        [], capsys, environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}
    )


@pytest.mark.parametrize(
    ("text", "expected"), [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3))]
)
def test_nnodes_forms(text: str, expected: tuple[int, int]) -> None:
    p = plan(["--nnodes", text, "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"])
    assert (p.min_nodes, p.max_nodes) == expected


@pytest.mark.parametrize("text", ["0", "2:1", "a", "1:2:3", "", "-1:2"])
def test_bad_nnodes_is_refused(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f"--nnodes={text}", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"]
    assert "--nnodes" in refusal(argv, capsys)


def test_nproc_per_node_cpu_counts_usable_cores() -> None:
    assert resolve_nproc_per_node("cpu") == len(os.sched_getaffinity(0))
    assert plan(["--nproc-per-node", "cpu"]).nproc_per_node == len(os.sched_getaffinity(0))


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

    assert plan(["--nproc-per-node", "auto"], nproc_resolver=resolver).nproc_per_node == 5
    assert seen == ["auto"]


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
        plan(argv)
    assert "cannot be honoured" in str(info.value)


def test_refused_flags_at_their_default_are_accepted() -> None:
    assert plan(["--event-log-handler", "null"]).single_node


def test_standalone_is_one_node_with_a_fresh_id_and_ignores_rendezvous_flags() -> None:
    p = plan(["--standalone", "--rdzv-backend", "etcd", "--rdzv-id", "job7"])
    assert p.single_node
    assert p.master_port is None
    assert p.run_id not in ("none", "job7")
    assert len(p.run_id) == 36
    assert plan(["--standalone"]).run_id != p.run_id
    assert any("--standalone ignores" in w and "job7" in w for w in p.warnings)
    assert plan(["--standalone"]).warnings == ()
    assert plan([], {"PET_STANDALONE": "1"}).single_node


def test_standalone_refuses_more_than_one_node() -> None:
    with pytest.raises(ValueError, match="--standalone runs a single node"):
        plan(["--standalone", "--nnodes", "1:2"])


def test_bare_single_node_is_like_standalone() -> None:
    p = plan(["--nproc-per-node", "2"])
    assert p.single_node
    assert p.master_port is None
    assert len(p.run_id) == 36


def test_single_node_with_master_port_keeps_it() -> None:
    p = plan(["--master-port", "29611", "--master-addr", "10.0.0.1"])
    assert p.single_node
    assert (p.master_addr, p.master_port, p.run_id) == ("10.0.0.1", 29611, "none")


def test_multi_node_static_uses_master_addr_and_port() -> None:
    p = plan(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "9"])
    assert not p.single_node
    assert p.rdzv_backend == "static"
    assert p.rdzv_endpoint == "h0:9"
    assert p.rdzv_configs == {"rank": 1}
    assert p.node_rank == 1
    assert plan(["--nnodes", "2"]).rdzv_endpoint == "127.0.0.1:29500"  # torchrun's port


def test_static_rendezvous_needs_fixed_node_count_and_rank_in_range() -> None:
    with pytest.raises(ValueError, match="fixed number of nodes"):
        plan(["--nnodes", "1:2"])
    with pytest.raises(ValueError, match="--node-rank=2 is out of range"):
        plan(["--nnodes", "2", "--node-rank", "2"])


def test_c10d_needs_an_endpoint_and_parses_rdzv_conf(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        plan(["--rdzv-backend", "c10d", "--nnodes", "1:2"])
    p = plan(
        [
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:29400",
            "--rdzv-id=job",
            "--nnodes=1:2",
            "--rdzv-conf=join_timeout=60, last_call_timeout=2",
        ]
    )
    assert not p.single_node
    assert p.rdzv_configs == {"join_timeout": "60", "last_call_timeout": "2"}
    assert (p.rdzv_backend, p.rdzv_endpoint, p.run_id) == ("c10d", "127.0.0.1:29400", "job")
    assert "KEY=VALUE" in refusal(["--rdzv-conf", "join_timeout"], capsys)


def test_warnings_for_flags_the_backend_ignores() -> None:
    p = plan(
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
    assert plan(["-m"]).args == ("-u", "-m", "train.py", "--lr", "0.1")
    assert plan(["--module"]).entrypoint == sys.executable
    p = plan(["--no-python"])
    assert (p.entrypoint, p.args) == ("train.py", ("--lr", "0.1"))
    with pytest.raises(ValueError, match="cannot be used together"):
        plan(["--no-python", "-m"])
    p = plan_from_args(parse_args(["--run-path", "/abs/train.py", "x"], {}), {})
    assert (p.run_path, p.entrypoint, p.args) == (True, "/abs/train.py", ("x",))
    with pytest.raises(ValueError, match="absolute path"):
        plan(["--run-path"])
    assert plan([], {"PYTHON_EXEC": "/opt/py"}).entrypoint == "/opt/py"


def test_script_arguments_that_look_like_our_flags_belong_to_the_script() -> None:
    ns = parse_args(["--nproc-per-node", "2", "train.py", "--nproc-per-node", "9", "-m"], {})
    assert ns.nproc_per_node == "2"
    assert ns.training_script_args == ["--nproc-per-node", "9", "-m"]
    assert not ns.module


def test_tee_implies_files_as_in_torchrun() -> None:
    p = plan(["--nproc-per-node", "3", "--tee", "0:1,2:2", "--redirects", "0:2"])
    assert p.tee == {0: Std.OUT, 2: Std.ERR}
    assert p.redirects == {0: Std.ALL, 1: Std.NONE, 2: Std.ERR}
    p = plan(["--tee", "1", "--redirects", "2"])
    assert p.redirects == Std.ALL


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--redirects", "4"], "argument -r/--redirects: invalid Std value '4'"),
        (["--tee", "0:1", "--nproc-per-node", "1", "--redirects", "5:1"], "local rank 5"),
        (["--local-ranks-filter", "a"], "comma-separated"),
        (["--local-ranks-filter", "3", "--nproc-per-node", "2"], "local rank 3"),
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
    assert fragment in refusal(argv, capsys)


def test_master_port_0_is_a_free_port_for_one_node() -> None:
    assert plan(["--master-port", "0"]).master_port is None


def test_empty_signals_to_handle_handles_none() -> None:
    assert plan(["--signals-to-handle", ""]).signals_to_handle == ()


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
    from aioelastic import _values as values

    # Text from the command line and typed values from the API parse to the same thing.
    assert values.port("0") == values.port(0) == 0
    assert values.exit_codes("2,-9") == values.exit_codes({2, -9}) == frozenset({2, -9})
    assert values.rank_filter("0,1", 2) == values.rank_filter([1, 0], 2) == frozenset({0, 1})
    assert values.rank_filter("", 2) is values.rank_filter(None, 2) is None
    assert values.duration("0.5") == values.duration(0.5) == 0.5
    assert values.nnodes("1:4") == values.node_range(1, 4) == (1, 4)
    assert values.nnodes(3) == (3, 3)
    assert values.signals("SIGTERM, SIGUSR1,SIGTERM") == (signal.SIGTERM, signal.SIGUSR1)
    assert values.signals("") == ()
    assert values.endpoint("[::1]:29400") == ("::1", 29400)
    assert values.endpoint("node0", 29500) == ("node0", 29500)
    assert values.name("trainer-é") == "trainer-é"
    assert values.shutdown_timeout(None, {}) == 30.0
    assert values.shutdown_timeout(None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "4"}) == 4.0
    assert values.shutdown_timeout(2, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "4"}) == 2.0
    with pytest.raises(TypeError, match="True is a bool"):
        values.positive_int(True)
    with pytest.raises(ValueError, match="inf is not a finite number of seconds"):
        values.duration("inf")
    with pytest.raises(TypeError, match="not a collection of exit codes"):
        values.exit_codes(2)
