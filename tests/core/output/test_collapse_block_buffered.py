"""Identical lines collapsed from block-buffered writers: full 8 KiB flushes that end mid-line.

Workers run tests/children/block_buffered.py through ``aioelastic-run --tee 3
--collapse-identical-lines``, in rounds the test lets go one by one; every line must come
out whole and once, a shared one collapsed, each rank's in its order.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import anyio
import pytest

from tests.children import block_buffered
from tests.support.cli_run import launcher
from tests.support.paths import CHILDREN
from tests.support.waits import ReadyFifo, make_fifo

pytestmark = pytest.mark.timeout(120)


# -- block-buffered writers: full buffers that end mid-line, far apart --------------------
#
# What a training script's print() does when its stdout is a pipe: the text reaches the
# launcher in 8 KiB writes that end wherever the buffer filled, usually mid-line, and the
# rest of that line comes with the next flush — seconds or minutes later. Each round ends
# with a prompt on stderr that the launcher shows after its flush delay: once it is on the
# console, the round's partial stdout line has waited that long too, and the next round
# is let go. So every partial line is held across at least one flush delay, in every
# round, with no sleep anywhere.

BUFFERED = str(CHILDREN / "block_buffered.py")


def _run_in_rounds(
    mode: str, tmp_path: Path, *, nprocs: int, window: float, seed: int = 0
) -> tuple[list[str], list[str], dict[int, list[int]]]:
    """The block-buffered child on ``nprocs`` ranks: stdout and stderr lines, and the
    size of each write of each rank."""
    ready = ReadyFifo(tmp_path)
    go_fds = []
    for rank in range(nprocs):
        # Read-write: never blocks, and lets the rank's open for reading return at once.
        go_fds.append(os.open(make_fifo(tmp_path, f"go.{rank}"), os.O_RDWR))
    argv = [
        "--nproc-per-node", str(nprocs), "--tee", "3", "--log-dir", str(tmp_path / "logs"),
        "--collapse-identical-lines", str(window),
        BUFFERED, mode, str(ready.path), str(tmp_path), str(seed),
    ]  # fmt: skip
    sizes: dict[int, list[int]] = {rank: [] for rank in range(nprocs)}
    try:
        with launcher(*argv) as run:
            for k in itertools.count():
                told = [line.split() for line in anyio.run(ready.lines, nprocs, 60)]
                if all(words[1:] == ["end"] for words in told):
                    break
                assert sorted(int(words[1]) for words in told) == [k] * nprocs, told
                for words in told:
                    sizes[int(words[0])].append(int(words[2]))
                waited = f"[ranks 0-{nprocs - 1}]: {block_buffered.waiting(k)}\n"
                run.wait_for_stderr(waited, 30)
                for fd in go_fds:
                    os.write(fd, b"g")
            code = run.finish(60)
    finally:
        ready.close()
        for fd in go_fds:
            os.close(fd)
    assert code == 0, run.stderr
    # The files keep every rank's bytes as written: every copy, no prompt turned into a line.
    for rank in range(nprocs):
        (logs,) = (tmp_path / "logs").glob(f"*/attempt_0/{rank}")
        text = "".join(f"{line}\n" for line in block_buffered.lines(rank))
        assert (logs / "stdout.log").read_text() == text
        prompts = "".join(map(block_buffered.waiting, range(k)))
        assert (logs / "stderr.log").read_text() == prompts
    return run.stdout.splitlines(), run.stderr.splitlines(), sizes


def _mid_line(rank: int, sizes: list[int]) -> int:
    """How many of ``sizes`` (the rank's writes, in order) end inside a line."""
    text = "".join(f"{line}\n" for line in block_buffered.lines(rank)).encode()
    ends = itertools.accumulate(sizes)
    return sum(text[end - 1 : end] != b"\n" for end in ends)


def _check_console(stdout: list[str], nprocs: int) -> None:
    """Each line whole and once: a rank's own with its prefix, a shared one collapsed once
    for every rank; and each rank's lines, its share of the collapsed ones included, in the
    order it wrote them."""
    expected = {rank: block_buffered.lines(rank) for rank in range(nprocs)}
    shared = {line for line in expected[0] if line.startswith("shared ")}
    own = {f"[default{rank}]:{line}" for rank in range(nprocs) for line in expected[rank]}
    everyone = f"[ranks 0-{nprocs - 1}]: "
    collapsed = [line[len(everyone) :] for line in stdout if line.startswith(everyone)]
    assert sorted(collapsed) == sorted(shared), "a shared line not collapsed exactly once"
    mine = [line for line in stdout if not line.startswith(everyone)]
    assert not set(mine) - own, f"lines cut, merged or mislabelled: {sorted(set(mine) - own)[:3]}"
    assert len(mine) + len(collapsed) == len(stdout)
    for rank in range(nprocs):
        prefix = f"[default{rank}]:"
        shown = [
            line[len(prefix) :] if line.startswith(prefix) else line[len(everyone) :]
            for line in stdout
            if line.startswith((prefix, everyone))
        ]
        assert shown == expected[rank], f"rank {rank}'s lines"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["blocks", "print"])
def test_8k_flushes_rounds_apart_keep_lines_whole_and_collapsed(tmp_path: Path, mode: str) -> None:
    nprocs = 4
    stdout, stderr, sizes = _run_in_rounds(mode, tmp_path, nprocs=nprocs, window=1.0)
    rounds = len(sizes[0])
    assert rounds >= 5
    for rank, written in sizes.items():
        # Rounds of real buffer flushes, each a full buffer (the last, at exit, aside).
        assert len(written) == rounds, sizes
        if mode == "blocks":
            assert written[:-1] == [8192] * (rounds - 1), written
            assert _mid_line(rank, written[:-1]) == rounds - 1, "every flush cuts a line"
        else:
            assert all(size >= 8000 for size in written[:-1]), written
    _check_console(stdout, nprocs)
    # The prompts are still shown after the flush delay, once, collapsed: a small write
    # that ends mid-line is not held for the rest of its line.
    assert [line for line in stderr if line.startswith("[")] == [
        f"[ranks 0-{nprocs - 1}]: {block_buffered.waiting(k)}" for k in range(rounds)
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [1, 2])
def test_full_buffers_cut_at_random_places_keep_lines_whole_and_collapsed(
    tmp_path: Path, seed: int
) -> None:
    # Each rank's writes end at places of their own, so a shared line is whole on one
    # rank a round before another: the window (10 s) spans the whole run, so every copy
    # still joins its group.
    nprocs = 4
    stdout, _, sizes = _run_in_rounds("random", tmp_path, nprocs=nprocs, window=10.0, seed=seed)
    for rank, written in sizes.items():
        assert len(written) == block_buffered.ROUNDS
        assert min(written) >= block_buffered.MIN_WRITE
        assert _mid_line(rank, written[:-1]) == block_buffered.ROUNDS - 1, written
    ends = {tuple(itertools.accumulate(written)) for written in sizes.values()}
    assert len(ends) == nprocs, "each rank's writes should end at places of its own"
    _check_console(stdout, nprocs)
