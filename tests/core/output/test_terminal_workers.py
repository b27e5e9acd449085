"""Workers of ``aioelastic-run`` at a terminal: what they see and what the terminal shows.

Run under a real pseudo-terminal (tests/support/terminal.py): the workers' terminal size
and its changes, one worker's input and debugger, progress frames, identical lines of
eight workers collapsed, many lines whole, failure and restart lines in colour; and when a
worker gets a pty at all (not at a terminal, a stream that is not plain, the console
probe). The keyboard shared among several ranks: test_terminal_keyboard.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from tests.support.paths import CHILDREN, REPO
from tests.support.terminal import SCRIPT, Terminal, take_terminal as _take_terminal
from tests.support.waits import ReadyFifo, make_fifo

pytestmark = pytest.mark.timeout(120)


def test_workers_see_a_terminal_of_the_real_size(terminal: type[Terminal]) -> None:
    term = terminal(["--nproc-per-node", "2", SCRIPT, "tty"], columns=123, lines=45)
    assert term.finish() == 0, term.text()
    seen = sorted(
        (json.loads(m[1]) for m in re.finditer(rb"TTY (.*?)\r\n", term.data)),
        key=lambda s: s["rank"],
    )
    assert [s["rank"] for s in seen] == ["0", "1"], term.text()
    for s in seen:
        # stdin too: each worker's is its stdout pty, fed by the stdin router.
        assert s["isatty"] == [True, True, True]
        assert s["size"] == [123, 45]


def test_a_single_worker_reads_the_terminal_with_input(terminal: type[Terminal]) -> None:
    term = terminal(["--nproc-per-node", "1", SCRIPT, "input"])
    term.wait_for(rb"name\? ")
    term.type(b"Alice\r")
    # The prompt was shown at once and stayed on its line: the typed name follows it.
    term.wait_for(rb"name\? Alice\r\nhello Alice!\r\n")
    term.type(b"more\r\x04")
    term.wait_for(rb"then 'more\\n' and end-of-file")
    assert term.finish() == 0, term.text()
    # Typed once, echoed once (by the terminal), not a second time by the worker's pty.
    assert term.data.count(b"Alice") == 2, term.text()


def test_each_frame_reaches_the_terminal_before_the_next_is_written(
    terminal: type[Terminal], tmp_path: Path
) -> None:
    fifo = make_fifo(tmp_path, "go")
    term = terminal(["--nproc-per-node", "1", SCRIPT, "frames", "5", str(fifo)])
    with open(fifo, "wb", buffering=0) as go:
        for i in range(1, 6):
            # Colours unchanged, the frame as written; only then is the next one written.
            term.wait_for(rb"\r\x1b\[32mframe %d/5\x1b\[0m" % i, timeout=30)
            go.write(b".")
    term.wait_for(rb"frames done")
    assert term.finish() == 0, term.text()
    bar = term.data[: term.data.index(b"frame 5/5")]
    # No line per frame: the bar stays on one terminal line.
    assert bar.count(b"\n") == 0, bar


def test_identical_lines_of_eight_workers_are_shown_once_while_they_run(
    terminal: type[Terminal], tmp_path: Path
) -> None:
    from tests.children import collapse as child

    nprocs = 8
    ready = ReadyFifo(tmp_path)
    go = make_fifo(tmp_path, "go")
    term = terminal(
        ["--nproc-per-node", str(nprocs), "--collapse-identical-lines", "2",
         str(CHILDREN / "collapse.py"), str(ready.path), str(go), "1"]
    )  # fmt: skip
    try:
        anyio.run(ready.lines, nprocs, 60)
    finally:
        ready.close()
    # Opened read-write: never blocks, and lets every worker's open of it return. The
    # workers stay until it is closed: what is checked is shown while they run.
    fd = os.open(go, os.O_RDWR)
    try:
        term.wait_for(rb"\[ranks 0-7\]: " + child.LAST.encode() + rb"\r\n")
        term.wait_for(rb"\[ranks 0-7\]: " + child.ERR_WARNING.encode() + rb"\r\n")
    finally:
        os.close(fd)
    assert term.finish() == 0, term.text()
    lines = bytes(term.data).decode().split("\r\n")
    assert lines.count(f"[ranks 0-7]: {child.WARNING}") == 1, lines
    first = lines.index(f"[ranks 0-7]: {child.WARNING}")
    last = lines.index(f"[ranks 0-7]: {child.LAST}")
    for rank in range(nprocs):
        # Each rank's own lines once, unprefixed as without collapsing, in order, after
        # the warning every rank wrote before them and before the line after them.
        own = child.lines(rank)[0][1:-1]
        at = [lines.index(line) for line in own]
        assert first < at[0] < at[1] < at[2] < last, lines
        assert sum(lines.count(line) for line in own) == len(own), lines
    assert len(lines) == 3 + 3 * nprocs + 1, lines  # and the empty piece after the last


def test_a_window_resize_reaches_the_worker(terminal: type[Terminal]) -> None:
    term = terminal(["--nproc-per-node", "1", SCRIPT, "winch", "2"], columns=80, lines=24)
    term.wait_for(rb"ready for resizes")
    term.resize(132, 50)
    term.wait_for(rb"resized 132x50")
    term.resize(90, 30)
    term.wait_for(rb"resized 90x30")
    assert term.finish() == 0, term.text()


def test_lines_of_four_workers_through_ptys_are_whole_and_all_there(
    terminal: type[Terminal],
) -> None:
    count = 20_000
    started = time.monotonic()
    term = terminal(["--nproc-per-node", "4", SCRIPT, "lines", str(count)])
    assert term.finish(timeout=90) == 0, term.text()
    took = time.monotonic() - started
    lines = bytes(term.data).split(b"\r\n")
    assert lines[-1] == b""
    by_rank: dict[int, list[int]] = {r: [] for r in range(4)}
    for line in lines[:-1]:
        match = re.fullmatch(rb"rank (\d) line (\d+) (x*)", line)
        assert match is not None, line[:200]
        assert len(match[3]) == int(match[2]) % 61
        by_rank[int(match[1])].append(int(match[2]))
    for numbers in by_rank.values():
        assert numbers == list(range(count))
    assert took < 60, took


def test_a_block_buffered_writer_never_has_a_line_cut_at_a_terminal(
    terminal: type[Terminal],
) -> None:
    # Two workers (a partial line is held), each writing 8 KiB blocks that end mid-line,
    # the rest of the line coming 4 flush delays later: the rule for a block-buffered
    # writer (docs/logs.md, partial lines), through a terminal. Over a pipe a read returns
    # the whole 8 KiB; a pty's master hands it over as 4095 + 4095 + 2 bytes, or in
    # tty_write's 2048-byte pieces, the last often a few bytes that end mid-line: the rule
    # must count the write over the batches of reads it came in (PTY_PIECE in _logs.py).
    from aioelastic._core.output._logs import FLUSH_DELAY

    count, pause = 1200, 4 * FLUSH_DELAY
    term = terminal(["--nproc-per-node", "2", SCRIPT, "blocks", str(count), str(pause)])
    assert term.finish(timeout=90) == 0, term.text()
    lines = bytes(term.data).split(b"\r\n")
    assert lines[-1] == b""
    by_rank: dict[int, list[int]] = {r: [] for r in range(2)}
    for line in lines[:-1]:
        match = re.fullmatch(rb"rank (\d) line (\d+) (x*)", line)
        assert match is not None, line[:200]
        assert len(match[3]) == int(match[2]) % 61
        by_rank[int(match[1])].append(int(match[2]))
    for numbers in by_rank.values():
        assert numbers == list(range(count))


def test_the_failure_report_still_quotes_stderr_at_a_terminal(
    terminal: type[Terminal],
) -> None:
    term = terminal(["--nproc-per-node", "1", SCRIPT, "fail", "7"])
    assert term.finish() == 7, term.text()
    report = bytes(term.data)
    # Once as the worker wrote it to the terminal, once quoted in the report.
    assert report.count(b"about to fail") == 2, report


def test_failure_and_restart_lines_at_the_default_level_in_colour(
    terminal: type[Terminal],
) -> None:
    term = terminal(
        ["--max-restarts", "1", "--nproc-per-node", "1",
         str(CHILDREN / "cli.py"), "flaky", "--fail-times", "1", "--code", "5"]
    )  # fmt: skip
    assert term.finish() == 0, term.text()
    term.wait_for(
        rb"\x1b\[31m\[aioelastic-run\] ERROR:\x1b\[0m \[default\] failed \(exitcode: 5\) "
        rb"local_rank: 0 \(global rank: 0, pid: \d+\)\r\n"
    )
    term.wait_for(
        rb"\x1b\[33m\[aioelastic-run\] WARNING:\x1b\[0m \[default\] Worker group FAILED\. "
        rb"1/1 attempts left; will restart worker group \(restart 1 of 1\)\r\n"
    )
    term.wait_for(rb"\[default\] run succeeded after 1 restart\(s\)")


def test_breakpoint_in_a_single_worker_is_a_working_debugger(terminal: type[Terminal]) -> None:
    term = terminal(["--nproc-per-node", "1", SCRIPT, "pdb"])
    term.wait_for(rb"\(Pdb\) ")
    term.type(b"p 6 * 7\r")
    term.wait_for(rb"\r\n42\r\n")
    term.type(b"answer = 42\r")
    term.type(b"c\r")
    term.wait_for(rb"answer is 42")
    assert term.finish() == 0, term.text()


def test_not_at_a_terminal_several_workers_read_dev_null(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aioelastic.run", "--nproc-per-node", "2", SCRIPT, "stdin"],
        cwd=REPO,
        capture_output=True,
        input=b"nobody reads this\n",
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [b"STDIN /dev/null ''"] * 2


@pytest.mark.parametrize(
    ("stdout_tty", "stderr_tty"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_a_plain_stream_gets_a_pty_exactly_when_the_group_saw_a_terminal_there(
    stdout_tty: bool, stderr_tty: bool
) -> None:
    # The group's one look at the console decides for every worker, whatever this test
    # process's own descriptors are.
    from aioelastic._core.output._frames import Live
    from aioelastic._core.output._terminal import ConsoleTerminals, open_worker_stdio

    terminals = ConsoleTerminals(stdin=False, stdout=stdout_tty, stderr=stderr_tty)
    stdio = open_worker_stdio(
        stdout_plain=True, stderr_plain=True, single_worker=False, terminals=terminals
    )
    try:
        assert os.isatty(stdio.stdout_w) is stdout_tty
        assert os.isatty(stdio.stderr_w) is stderr_tty
        assert stdio.live_stdout is (Live.FRAMES if stdout_tty else Live.OFF)
        assert stdio.live_stderr is (Live.FRAMES if stderr_tty else Live.OFF)
        assert stdio.uses_terminal is (stdout_tty or stderr_tty)
        assert stdio.stdin is None
    finally:
        for fd in [*stdio.child_ends(), *stdio.parent_ends()]:
            os.close(fd)
    # A stream that is not plain (tee'd or redirected) is a pipe even at a terminal.
    stdio = open_worker_stdio(
        stdout_plain=False, stderr_plain=False, single_worker=False, terminals=terminals
    )
    try:
        assert not os.isatty(stdio.stdout_w)
        assert not os.isatty(stdio.stderr_w)
    finally:
        for fd in [*stdio.child_ends(), *stdio.parent_ends()]:
            os.close(fd)


@pytest.mark.parametrize("foreground", [True, False])
def test_the_console_probe_reports_each_of_the_three_streams(foreground: bool) -> None:
    master, slave = os.openpty()
    try:
        probe = (
            "from aioelastic._core.output._terminal import ConsoleTerminals as T; "
            "t = T.probe(); print(t.stdin, t.stdout, t.stderr)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", probe],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=slave,
            timeout=60,
            check=True,
            start_new_session=True,
            preexec_fn=_take_terminal if foreground else None,
        )
    finally:
        os.close(slave)
        os.close(master)
    # stdin counts only as the foreground job's terminal: what is typed there is ours.
    assert proc.stdout.split() == [str(foreground).encode(), b"False", b"True"]
