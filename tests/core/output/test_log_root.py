"""Log directories (``output/_log_root.py``): refused when used, temporary ones removed or kept.

A temporary log root is removed when nothing was written to it, and kept (and named) when
a worker's files are in it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from aioelastic import Std, run_processes, start_processes
from tests.children import logs as children


@pytest.mark.parametrize("existing", ["stdout.log", "stderr.log", "error.json"])
def test_log_dir_with_earlier_output_is_refused_before_anything_starts(
    tmp_path: Path, existing: str
) -> None:
    log_dir = tmp_path / "logs"
    (log_dir / "1").mkdir(parents=True)
    (log_dir / "1" / existing).write_text("an earlier run")
    with pytest.raises(ValueError, match="already holds output") as info:
        start_processes(
            name="w",
            entrypoint=children.one_line,
            args={0: (0, "x"), 1: (1, "x")},
            envs={0: {}, 1: {}},
            log_dir=log_dir,
            redirects=Std.ALL,
        )
    assert str(log_dir / "1" / existing) in str(info.value)
    assert (log_dir / "1" / existing).read_text() == "an earlier run"
    assert sorted(p.relative_to(log_dir).as_posix() for p in log_dir.rglob("*")) == [
        "1",
        f"1/{existing}",
    ]


@pytest.mark.asyncio
async def test_temporary_log_dir_is_removed_when_nothing_was_redirected(
    private_tmp: Path,
) -> None:
    result = await run_processes(
        name="w",
        entrypoint=children.one_line,
        args={0: (0, "not kept"), 1: (1, "not kept")},
        envs={0: {}, 1: {}},
        start_method="fork",
    )
    assert not result.failures
    assert list(private_tmp.iterdir()) == []


@pytest.mark.asyncio
async def test_tee_also_logs_to_files_like_torch(private_tmp: Path) -> None:
    result = await run_processes(
        name="w",
        entrypoint=children.one_line,
        args={0: (0, "kept")},
        envs={0: {}},
        start_method="fork",
        tee=Std.OUT,
    )
    (kept,) = private_tmp.iterdir()
    assert result.stdouts == {0: str(kept / "0" / "stdout.log")}
    assert result.stderrs == {0: ""}
    assert "kept" in (kept / "0" / "stdout.log").read_text()


@pytest.mark.asyncio
async def test_temporary_log_dir_is_kept_when_a_worker_wrote_an_error_file(
    private_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aioelastic")
    result = await run_processes(
        name="w",
        entrypoint=children.fail_after_output,
        args={0: (0, "/nonexistent/fifo")},
        envs={0: {}},
        start_method="fork",
    )
    (kept,) = private_tmp.iterdir()
    failure = result.failures[0]
    assert failure.error_file == str(kept / "0" / "error.json")
    assert "FileNotFoundError" in failure.message
    assert str(kept) in caplog.text


@pytest.mark.asyncio
async def test_temporary_log_dir_is_kept_and_logged_when_redirected(
    private_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aioelastic")
    result = await run_processes(
        name="w",
        entrypoint=children.one_line,
        args={0: (0, "kept")},
        envs={0: {}},
        start_method="fork",
        redirects=Std.OUT,
    )
    (kept,) = private_tmp.iterdir()
    assert result.stdouts == {0: str(kept / "0" / "stdout.log")}
    assert (kept / "0" / "stdout.log").read_text() == "kept from 0\n"
    assert str(kept) in caplog.text
