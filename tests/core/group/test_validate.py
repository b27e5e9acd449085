"""Bad input to start_processes is refused before anything starts, with a clear message."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic import Std
from tests.children import core


def call(**overrides: Any) -> aioelastic.PContext:
    kwargs: dict[str, Any] = {
        "name": "trainer",
        "entrypoint": core.add,
        "args": {0: (1, 2), 1: (3, 4)},
        "envs": {0: {}, 1: {}},
    }
    kwargs.update(overrides)
    return aioelastic.start_processes(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"args": {}, "envs": {}}, ValueError, "no workers"),
        (
            {"args": {0: (), 2: ()}, "envs": {0: {}, 2: {}}},
            ValueError,
            r"exactly the local ranks 0\.\.1",
        ),
        ({"args": {1: ()}, "envs": {1: {}}}, ValueError, "exactly the local ranks"),
        ({"envs": {0: {}}}, ValueError, "must be the same as args keys"),
        ({"envs": {0: {}, 1: {}, 2: {}}}, ValueError, "must be the same as args keys"),
        ({"envs": {0: {"X": 1.5}, 1: {}}}, TypeError, r"envs\[0\]\['X'\] = 1.5 is a float"),
        ({"envs": {0: {"X": None}, 1: {}}}, TypeError, "environment values must be str"),
        ({"envs": {0: {"A=B": "1"}, 1: {}}}, ValueError, "invalid variable name"),
        ({"args": {0: 5, 1: ()}}, TypeError, r"args\[0\] must be a tuple"),
        ({"entrypoint": 42}, TypeError, "must be a callable .* or a str"),
        ({"entrypoint": "no-such-binary-aioelastic"}, ValueError, "not on PATH"),
        ({"entrypoint": "/no/such/binary"}, ValueError, "does not exist or is not executable"),
        ({"start_method": "threads"}, ValueError, "start_method: 'threads' is not one of"),
        ({"name": "../escape"}, ValueError, "must not contain a path separator"),
        ({"name": ""}, ValueError, "name: '' is empty"),
        ({"name": "a\nb"}, ValueError, "line break"),
        ({"name": "a\0b"}, ValueError, "NUL"),
        ({"name": "x" * 256}, ValueError, "256 bytes long; a file name allows 255"),
        ({"redirects": "3"}, TypeError, "Std"),
        ({"tee": {5: Std.ALL}}, ValueError, "5"),
        ({"grace_period": -1}, ValueError, "grace_period: -1 is not >= 0 seconds"),
        ({"forkserver_preload": "torch"}, TypeError, "sequence of module names"),
        ({"forkserver_preload": ("no_such_module_aioelastic",)}, ValueError, "not installed"),
        ({"local_ranks_filter": {0, 7}}, ValueError, "names local rank 7"),
        ({"log_line_prefix": "${nope}"}, ValueError, r"may use \$\{role_name\}"),
        ({"stop_leader_first": "yes"}, TypeError, r"stop_leader_first: 'yes' \(str\) is not True"),
        ({"stop_leader_first": None}, TypeError, "stop_leader_first: None .* is not True or False"),
    ],
)
def test_bad_input_is_refused(overrides: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call(**overrides)


def test_int_env_values_are_converted() -> None:
    ctx = call(envs={0: {"N": 3}, 1: {}})
    assert ctx._spec.envs[0] == {"N": "3"}


def test_log_dir_that_is_a_file_or_under_one_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    # The message of aioelastic-run --log-dir and of every API that takes a log_dir.
    is_a_file = (
        f"log_dir: {str(file)!r} is a file, not a directory; give the path of a directory "
        "(made if missing)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(is_a_file)}$"):
        call(log_dir=file)
    under_a_file = (
        f"log_dir: {str(file / 'logs')!r} is under {str(file)!r}, a file, not a directory; "
        "give the path of a directory (made if missing)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(under_a_file)}$"):
        call(log_dir=file / "logs")
    assert file.read_text() == "x"


def test_log_dir_with_a_file_where_a_rank_directory_goes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "1").write_text("not a directory")
    with pytest.raises(ValueError, match="holds a file named '1' where worker 1's log dir"):
        call(log_dir=tmp_path)
    assert (tmp_path / "1").read_text() == "not a directory"
    assert not (tmp_path / "0").exists()


def test_log_dir_with_earlier_output_is_refused(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "stderr.log").write_text("earlier run")
    with pytest.raises(ValueError, match="already holds output of an earlier run"):
        call(log_dir=tmp_path)
    assert (tmp_path / "1" / "stderr.log").read_text() == "earlier run"
    assert not (tmp_path / "0").exists()


@pytest.mark.asyncio
async def test_unpicklable_entrypoint_for_spawn_is_refused_before_start() -> None:
    ctx = call(entrypoint=lambda a, b: a + b)
    with pytest.raises(ValueError, match="cannot be pickled for start_method='spawn'"):
        async with ctx:
            pass
    assert ctx.pids() == {}


@pytest.mark.asyncio
async def test_a_file_put_where_a_rank_directory_goes_after_validation_fails_the_start(
    tmp_path: Path,
) -> None:
    ctx = call(log_dir=tmp_path)  # validated: the directory is empty
    (tmp_path / "1").write_text("put here since")
    with anyio.fail_after(30), pytest.raises(FileExistsError, match=str(tmp_path / "1")):
        async with ctx:
            pass
    assert ctx.pids() == {}
    assert (tmp_path / "1").read_text() == "put here since"


@pytest.mark.asyncio
async def test_lambda_runs_with_fork() -> None:
    result = await aioelastic.run_processes(
        "lambda", lambda a, b: a * b, {0: (6, 7)}, {0: {}}, start_method="fork"
    )
    assert result.return_values == {0: 42}
