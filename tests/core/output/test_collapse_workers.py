"""Identical lines of real workers collapsed: through ``start_processes`` and ``aioelastic-run``.

The files and the output stream still get every line of every rank; a bad window is
refused before anything starts; at the console, a warning every rank printed is shown
once (``[ranks 0-7]: ...``), and without the flag every copy is, as torchrun shows them.
The collapser itself, on a fake clock: test_collapse.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import anyio
import pytest

from aioelastic import Std, run_processes, start_processes
from tests.children import collapse as child
from tests.support.cli_run import launcher
from tests.support.paths import CHILDREN
from tests.support.waits import ReadyFifo, make_fifo

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(CHILDREN / "collapse.py")


@pytest.mark.asyncio
async def test_files_and_output_get_every_line_of_every_rank(tmp_path: Path) -> None:
    nprocs = 4
    sh = "echo same; echo mine $0; echo same; echo err >&2"
    ctx = start_processes(
        name="w",
        entrypoint="/bin/sh",
        args={r: ("-c", sh, str(r)) for r in range(nprocs)},
        envs={r: {} for r in range(nprocs)},
        log_dir=tmp_path / "logs",
        redirects=Std.ALL,
        tee=Std.ALL,
        collapse_identical_lines=0.5,
    )
    seen: dict[tuple[int, Std], list[bytes]] = {}
    async with ctx:
        async for item in ctx.output():
            seen.setdefault((item.local_rank, item.stream), []).append(item.data)
        result = await ctx.wait()
    assert result is not None
    assert not result.is_failed()
    for rank in range(nprocs):
        out = b"same\nmine %d\nsame\n" % rank
        assert (tmp_path / "logs" / str(rank) / "stdout.log").read_bytes() == out
        assert (tmp_path / "logs" / str(rank) / "stderr.log").read_bytes() == b"err\n"
        assert seen[rank, Std.OUT] == out.splitlines()
        assert seen[rank, Std.ERR] == [b"err"]


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "collapse_identical_lines: 0 is not > 0 seconds"),
        (-1, ValueError, "collapse_identical_lines: -1 is not > 0 seconds"),
        (11, ValueError, "collapse_identical_lines: 11 seconds is longer than 10"),
        (float("nan"), ValueError, "nan is not a finite number of seconds"),
        ("soon", ValueError, "'soon' is not a number of seconds"),
        (True, TypeError, "True is a bool, not a number of seconds"),
    ],
)
@pytest.mark.asyncio
async def test_a_bad_window_is_refused_before_anything_starts(
    value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        await run_processes(
            "w",
            "/bin/true",
            {0: (), 1: ()},
            {0: {}, 1: {}},
            collapse_identical_lines=value,  # type: ignore[arg-type]
        )


def _cli_console(*extra: str, tmp_path: Path, nprocs: int = 8) -> tuple[bytes, bytes, int]:
    """``aioelastic-run`` of the collapse child on ``nprocs`` ranks; its stdout, stderr."""
    ready = ReadyFifo(tmp_path)
    go = make_fifo(tmp_path, "go")
    argv = ["--nproc-per-node", str(nprocs), *extra, SCRIPT, str(ready.path), str(go), "0"]
    try:
        with launcher(*argv) as run:
            anyio.run(ready.lines, nprocs, 60)
            # Opened read-write: never blocks, and lets every rank's open of it return.
            fd = os.open(go, os.O_RDWR)
            try:
                code = run.finish(90)
            finally:
                os.close(fd)
    finally:
        ready.close()
    return run.stdout.encode(), run.stderr.encode(), code


def _expected_own(prefix: str, nprocs: int) -> dict[int, list[str]]:
    return {r: [prefix % r + line for line in child.lines(r)[0][1:-1]] for r in range(nprocs)}


def test_the_cli_prints_a_warning_of_every_rank_once_and_the_files_keep_every_copy(
    tmp_path: Path,
) -> None:
    nprocs = 8
    stdout, stderr, code = _cli_console(
        "--tee", "3", "--log-dir", str(tmp_path / "logs"), "--collapse-identical-lines", "2",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert code == 0, stderr
    lines = stdout.decode().splitlines()
    assert lines.count(f"[ranks 0-7]: {child.WARNING}") == 1, lines
    assert lines.count(f"[ranks 0-7]: {child.LAST}") == 1, lines
    assert len(lines) == 2 + 3 * nprocs, lines
    first, last = (
        lines.index(f"[ranks 0-7]: {child.WARNING}"),
        lines.index(f"[ranks 0-7]: {child.LAST}"),
    )
    for own in _expected_own("[default%d]:", nprocs).values():
        # A rank's lines in order: the warning before them, the last line after them.
        at = [lines.index(line) for line in own]
        assert first < at[0] < at[1] < at[2] < last, lines
    assert f"[ranks 0-7]: {child.ERR_WARNING}" in stderr.decode().splitlines()
    # The log files are the ranks' own, every copy, untouched.
    for rank in range(nprocs):
        out, err = child.lines(rank)
        (attempt,) = (tmp_path / "logs").glob(f"*/attempt_0/{rank}")
        assert (attempt / "stdout.log").read_text() == "".join(f"{line}\n" for line in out)
        assert (attempt / "stderr.log").read_text() == "".join(f"{line}\n" for line in err)


def test_without_the_flag_every_copy_is_printed_as_torchrun_does(tmp_path: Path) -> None:
    nprocs = 4
    stdout, stderr, code = _cli_console("--tee", "3", tmp_path=tmp_path, nprocs=nprocs)
    assert code == 0, stderr
    lines = stdout.decode().splitlines()
    assert sorted(lines) == sorted(
        f"[default{rank}]:{line}" for rank in range(nprocs) for line in child.lines(rank)[0]
    )
    assert "[ranks" not in stdout.decode() + stderr.decode()
