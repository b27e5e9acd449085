"""GroupOptions: one record of a group's options, taken whole or field by field."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import re
from typing import Any

import pytest

import aioelastic
from aioelastic import GroupOptions, LaunchConfig, LocalElasticAgent, Std, WorkerSpec
from aioelastic._core.group._options import option_names
from tests.children import core

pytestmark = pytest.mark.timeout(60)


def _start(**kw: Any) -> aioelastic.PContext:
    return aioelastic.start_processes("w", core.add, {0: (1, 2), 1: (3, 4)}, {0: {}, 1: {}}, **kw)


def test_the_record_parses_each_field_and_names_it() -> None:
    options = GroupOptions(
        local_ranks_filter="0,1", ranks_filter="0,8-9", forkserver_preload=["json"]
    )
    assert options.local_ranks_filter == frozenset({0, 1})
    assert options.ranks_filter == frozenset({0, 8, 9})
    assert options.forkserver_preload == ("json",)
    with pytest.raises(ValueError, match=r"^grace_period: -1 is not >= 0 seconds$"):
        GroupOptions(grace_period=-1)
    with pytest.raises(TypeError, match=r"^stop_leader_first: 'yes' \(str\) is not True or False$"):
        GroupOptions(stop_leader_first="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of module names"):
        GroupOptions(forkserver_preload="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.grace_period = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(options)) == options
    for f in dataclasses.fields(GroupOptions):
        assert f"        {f.name}: " in (GroupOptions.__doc__ or ""), f.name


def test_start_processes_takes_the_record_or_its_fields_and_a_conflict_is_an_error() -> None:
    record = GroupOptions(grace_period=5, tee=Std.ERR, stop_leader_first=True)
    spec = _start(options=record)._spec
    assert (spec.options.grace_period, spec.tee, spec.options.stop_leader_first) == (
        5,
        {0: Std.ERR, 1: Std.ERR},
        True,
    )
    assert _start(grace_period=5)._spec.options.grace_period == 5
    # A keyword argument at its default leaves the record's value; another value sets it.
    assert _start(options=record, grace_period=30.0)._spec.options.grace_period == 5
    merged = _start(options=record, collapse_identical_lines=0.5)._spec.options
    assert (merged.grace_period, merged.collapse_identical_lines) == (5, 0.5)
    assert _start(options=record, grace_period=5)._spec.options.grace_period == 5
    with pytest.raises(TypeError, match=r"^grace_period=7 and options\.grace_period=5\.0 disagree"):
        _start(options=record, grace_period=7)
    with pytest.raises(TypeError, match=r"^tee=<Std\.OUT: 1> and options\.tee=<Std\.ERR: 2>"):
        _start(tee=Std.OUT, options=record)
    with pytest.raises(
        TypeError, match=r"^start_processes\(\) got an unexpected keyword argument 'grace'$"
    ):
        _start(grace=5)
    with pytest.raises(TypeError, match="options must be a GroupOptions, got dict"):
        _start(options={"grace_period": 5})
    with pytest.raises(ValueError, match=r"^local_ranks_filter: 5 names local rank 5"):
        _start(options=GroupOptions(local_ranks_filter={5}))


def test_run_processes_has_the_signature_of_start_processes() -> None:
    start = inspect.signature(aioelastic.start_processes)
    run = inspect.signature(aioelastic.run_processes)
    assert run.parameters == start.parameters
    assert run.return_annotation == "RunProcsResult"
    assert inspect.iscoroutinefunction(aioelastic.run_processes)
    assert aioelastic.run_processes.__name__ == "run_processes"
    keywords = [p.name for p in start.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert keywords == [
        "options",
        *(n for n in option_names(torch=False) if n not in ("redirects", "tee")),
    ]
    agent = inspect.signature(LocalElasticAgent)
    assert set(option_names(torch=True)) <= set(agent.parameters)


@pytest.mark.asyncio
async def test_run_processes_runs_with_the_record() -> None:
    result = await aioelastic.run_processes(
        "w", core.add, {0: (1, 2)}, {0: {}}, options=GroupOptions(grace_period=1)
    )
    assert result.return_values == {0: 3}


def test_the_agent_carries_the_record_whole_and_takes_torch_names() -> None:
    spec = WorkerSpec(local_world_size=2, entrypoint="/bin/true")
    record = GroupOptions(grace_period=4, ranks_filter={1})
    agent = LocalElasticAgent(spec, options=record, log_line_prefix_template="<${rank}> ")
    assert agent._config.options == dataclasses.replace(
        record.for_ranks(2), log_line_prefix="<${rank}> "
    )
    assert LocalElasticAgent(spec, shutdown_timeout=4)._config.options.grace_period == 4
    with pytest.raises(TypeError, match=r"^shutdown_timeout=2 and options\.grace_period=4\.0"):
        LocalElasticAgent(spec, shutdown_timeout=2, options=record)
    with pytest.raises(TypeError, match="unexpected keyword argument 'grace_period'"):
        LocalElasticAgent(spec, grace_period=2)


def test_launch_config_writes_the_record_to_its_torch_named_fields() -> None:
    record = GroupOptions(grace_period=4, tee=Std.ALL, stop_leader_first=True)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, options=record)
    assert (config.shutdown_timeout, config.tee, config.stop_leader_first) == (4, Std.ALL, True)
    assert config._derived().agent.options == record.for_ranks(2)
    config.redirects = Std.OUT  # a field the record leaves alone may change
    assert config._derived().agent.options.redirects == {0: Std.OUT, 1: Std.OUT}
    config.tee = Std.ERR  # one it sets may not, silently
    with pytest.raises(TypeError, match=re.escape("tee=<Std.ERR: 2> and options.tee=<Std.ALL: 3>")):
        config._derived()
    with pytest.raises(TypeError, match=r"^shutdown_timeout=2 and options\.grace_period=4\.0"):
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, shutdown_timeout=2, options=record)


def test_both_console_filters_must_allow_a_rank() -> None:
    options = GroupOptions(local_ranks_filter={0, 1}, ranks_filter={1, 9})
    assert [options.shows(r) for r in range(3)] == [False, True, False]
    assert [options.shows(r, {0: 8, 1: 9, 2: 10}) for r in range(3)] == [False, True, False]
    assert GroupOptions().shows(5, {5: 40})
