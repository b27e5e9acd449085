"""Values on the command line: parsed and checked as the API's, and the config they make.

Per-rank output settings (``--tee`` implies files, as in torchrun), a bad value refused with
its flag named, the value parsers that read the command line's text and the API's typed
values alike, and a ``LaunchConfig`` parsed once per launch and checked again when changed.
"""

from __future__ import annotations

import asyncio
import pickle
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from aioelastic import LaunchConfig
from aioelastic._cli._cli_flags import flag_for
from aioelastic._core.output._std import Std
from tests.support.cli_args import config, refusal


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
        (["--rdzv-endpoint", ":5"], "gives a port alone, whose host only a SLURM step names"),
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


def test_empty_signals_to_handle_handles_none() -> None:
    assert config(["--signals-to-handle", ""])._derived().agent.signals == ()


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
