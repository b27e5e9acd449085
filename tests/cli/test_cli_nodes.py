"""The nodes of a job on the command line: how many, and how they meet.

``--nnodes`` and ``--nproc-per-node``, ``--standalone`` and the bare single node, the static
rendezvous (``--master-addr``/``--master-port``) and its store, c10d with
``--rdzv-endpoint``, ``--rdzv-conf`` checked for torch's backends, and the warnings for
flags a backend ignores.
"""

from __future__ import annotations

import os
import re

import pytest

from aioelastic import LaunchConfig
from aioelastic._cli._cli_plan import resolve_nproc_per_node
from tests.support.cli_args import command, config, launch, refusal


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


@pytest.mark.parametrize("quote", ["'", '"'])
def test_rdzv_conf_in_quotes_that_no_shell_removed_is_read_without_them(
    quote: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An argument list carries them (torch's own launcher tests write it so).
    c10d = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "--nnodes=1:2"]
    given = f"--rdzv-conf={quote}join_timeout=5,last_call_timeout=1{quote}"
    c = config([*c10d, given])
    assert c.rdzv_configs == {"join_timeout": "5", "last_call_timeout": "1", "timeout": 900}
    # One matching pair around the whole only: a stray quote is still refused.
    stray = refusal([*c10d, "--rdzv-conf='join_timeout=5"], capsys)
    assert '"\'join_timeout" is not an option' in stray


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


def test_master_port_0_is_a_free_port_for_one_node() -> None:
    assert config(["--master-port", "0"])._derived().store == ("127.0.0.1", None)
