"""The keyboard of a terminal shared among ranks: each typed line to the rank that reads.

Run under a real pseudo-terminal (tests/support/terminal.py), on every start path: the
rank that asks gets what is typed, with a note saying where typing goes; one rank owns the
keyboard at a time (pdb and ``torch.distributed.breakpoint`` included), ranks asking take
turns, and the keyboard passes on when its owner dies or stops reading, within bounds;
Ctrl-C still stops the job.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import CHILDREN
from tests.support.terminal import SCRIPT, Terminal
from tests.support.waits import make_fifo

pytestmark = pytest.mark.timeout(120)


#: The ways a worker is started: a script through the watchdog (python), a function
#: worker of each start method running it (--run-path), and a fork of a warm server.
START_PATHS = {
    "python": [],
    "run-path-spawn": ["--run-path", "--start-method", "spawn"],
    "run-path-fork": ["--run-path", "--start-method", "fork"],
    "run-path-forkserver": ["--run-path", "--start-method", "forkserver"],
    "preload": ["--preload", "json"],
}


@pytest.fixture
def fifo(tmp_path: Path) -> str:
    path = make_fifo(tmp_path, "rank0")
    return str(path)


@pytest.fixture
def fifos(tmp_path: Path) -> list[str]:
    paths = [make_fifo(tmp_path, "go"), make_fifo(tmp_path, "answer")]
    return [str(path) for path in paths]


def _note(rank: int) -> bytes:
    """The line that says where typing goes, as a regex."""
    return rb"\[aioelastic\] stdin: typing goes to rank %d \(local rank %d\)\r\n" % (rank, rank)


@pytest.mark.parametrize("start", START_PATHS.values(), ids=START_PATHS.keys())
def test_the_rank_that_asks_for_input_gets_what_is_typed(
    terminal: type[Terminal], fifos: list[str], start: list[str]
) -> None:
    term = terminal(["--nproc-per-node", "2", *start, SCRIPT, "rank1_asks", *fifos])
    # Rank 0's line, the note, then rank 1's prompt (input() writes it to stderr) on its
    # line.
    term.wait_for(rb"rank 0 waits for rank 1\r\n" + _note(1) + rb"name\? $")
    term.type(b"Bob\r")
    # The two ranks' lines come through two ptys: either may be shown first.
    term.wait_for(rb"name\? Bob\r\n(rank 0 heard 'Bob'\r\n)?rank 1 got 'Bob'\r\n")
    term.wait_for(rb"rank 0 heard 'Bob'\r\n")
    assert term.finish() == 0, term.text()
    # Typed once, echoed once by the terminal; no empty line after the prompt's line.
    assert term.data.count(b"Bob") == 3, term.text()
    assert b"\r\n\r\n" not in term.data, term.text()


def test_a_prompt_read_seconds_after_it_is_written_still_gets_the_keyboard(
    terminal: type[Terminal], fifos: list[str]
) -> None:
    # Rank 1 reads 1.5 s after its prompt, past the quick looks that follow a prompt: the
    # note still comes before anything is typed (the prompt keeps being looked at).
    term = terminal(["--nproc-per-node", "2", SCRIPT, "rank1_asks", *fifos, "1.5"])
    term.wait_for(rb"rank 0 waits for rank 1\r\n(name\? \r\n)?" + _note(1) + rb"name\? $")
    term.type(b"Bob\r")
    term.wait_for(rb"rank 1 got 'Bob'\r\n")
    term.wait_for(rb"rank 0 heard 'Bob'\r\n")
    assert term.finish() == 0, term.text()


def test_breakpoint_in_rank_1_of_two_is_a_working_debugger(
    terminal: type[Terminal], fifo: str
) -> None:
    term = terminal(["--nproc-per-node", "2", SCRIPT, "rank1_pdb", fifo])
    term.wait_for(_note(1) + rb"\(Pdb\) $")
    term.type(b"p x * 7\r")
    term.wait_for(rb"\(Pdb\) p x \* 7\r\n42\r\n\(Pdb\) $")
    term.type(b"answer = 36\r")
    term.wait_for(rb"\(Pdb\) answer = 36\r\n\(Pdb\) $")
    term.type(b"c\r")
    term.wait_for(rb"answer is 42\r\n")
    term.wait_for(rb"rank 0 heard 'continued'\r\n")
    assert term.finish() == 0, term.text()
    # One session, one note: the debugger kept the keyboard between its commands.
    assert term.data.count(b"typing goes to") == 1, term.text()


@pytest.mark.torch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("start", [[], ["--preload", "torch"]], ids=["python", "preload"])
def test_torch_distributed_breakpoint_on_rank_1_of_a_gloo_job(
    terminal: type[Terminal], start: list[str]
) -> None:
    script = str(CHILDREN / "dist_breakpoint.py")
    term = terminal(["--nproc-per-node", "2", *start, script])
    # torch's debugger reads open("/dev/stdin"): a descriptor of its own on rank 1's pty.
    term.wait_for(_note(1) + rb"\(Pdb\) $", timeout=180)
    term.type(b"up\r")
    term.wait_for(rb"dist\.breakpoint\(rank=1\)\r\n\(Pdb\) $")
    term.type(b"p secret.item(), dist.get_rank()\r")
    term.wait_for(rb"\r\n\(14\.0, 1\)\r\n\(Pdb\) $")
    term.type(b"c\r")
    # Rank 0 waited in the barrier after the breakpoint; both finish the all-reduce.
    term.wait_for(rb"rank 0 sum 21\r\n", timeout=120)
    term.wait_for(rb"rank 1 sum 21\r\n")
    assert term.finish(timeout=120) == 0, term.text()


def test_two_ranks_asking_take_turns_first_come_first_served(
    terminal: type[Terminal], fifo: str
) -> None:
    term = terminal(["--nproc-per-node", "2", SCRIPT, "both_ask", fifo])
    term.wait_for(_note(0) + rb"rank 0 asks\? $")
    # Rank 1 asks too, while rank 0 owns the keyboard: its prompt waits on a line of its own.
    with open(fifo, "w") as go:
        go.write("ask")
    term.wait_for(rb"rank 1 asks\? \r\n")
    term.type(b"first\r")
    term.wait_for(rb"rank 0 got 'first'\r\n")
    # Rank 0 is done: the keyboard goes to rank 1, whose prompt is shown again.
    term.wait_for(_note(1) + rb"rank 1 asks\? $")
    term.type(b"second\r")
    term.wait_for(rb"rank 1 got 'second'\r\n")
    assert term.finish() == 0, term.text()


#: Seconds the keyboard router may take beyond what its mechanism waits (a grace, a look's
#: backoff): the worker's exit or read to be seen and the note to reach this test's
#: reader, on 2 cores shared with other test runs.
ROUTER_ALLOWANCE = 4.0


def _write(fifo: str, text: str = "go") -> None:
    with open(fifo, "w") as f:
        f.write(text)


@pytest.fixture
def three_fifos(tmp_path: Path) -> list[str]:
    return [str(make_fifo(tmp_path, name)) for name in ("go", "answer", "hold")]


def test_when_the_rank_holding_the_keyboard_dies_the_next_reader_gets_it(
    terminal: type[Terminal], three_fifos: list[str]
) -> None:
    go, _, die = three_fifos
    term = terminal(["--nproc-per-node", "2", SCRIPT, "owner_dies", go, die])
    term.wait_for(_note(0) + rb"rank 0 asks\? $")
    _write(go)
    # Held while rank 0 owns the keyboard, then shown as a line of its own: after rank 0's
    # prompt, which stands on the terminal as written.
    term.wait_for(rb"rank 0 asks\? rank 1 asks\? \r\n")
    died = time.monotonic()
    _write(die)
    # No grace for an owner that is gone: the end of its output wakes the router. (The
    # empty line: the note starts a line after the previous owner's prompt, as if that
    # prompt still ended the terminal's last line, which rank 1's line already ended.)
    term.wait_for(rb"rank 1 asks\? \r\n\r\n" + _note(1) + rb"rank 1 asks\? $")
    took = time.monotonic() - died
    assert took < ROUTER_ALLOWANCE, took
    term.type(b"second\r")
    term.wait_for(_note(1) + rb"rank 1 asks\? second\r\nrank 1 got 'second'\r\n")
    assert term.finish() == 0, term.text()
    assert b"rank 0 got" not in term.data, term.text()
    assert term.data.count(b"typing goes to") == 2, term.text()
    assert term.data.count(b"second") == 2, term.text()  # the echo, rank 1's line


def test_a_line_typed_while_no_rank_reads_goes_to_the_first_that_does(
    terminal: type[Terminal], three_fifos: list[str]
) -> None:
    from aioelastic._core.output._stdin_router import _WAITING_LINE_LOOKS

    go, answer, _ = three_fifos
    term = terminal(["--nproc-per-node", "2", SCRIPT, "late_ask", go, answer])
    term.wait_for(rb"rank 0 waits\r\n")
    term.type(b"early\r")
    term.wait_for(rb"early\r\n")  # the terminal's echo; nobody reads it yet
    asked = time.monotonic()
    _write(go)
    # While a line waits, the router looks at the workers at least every
    # _WAITING_LINE_LOOKS[1] seconds (and at once after a prompt): the line is rank 1's
    # within that of its read. Typed ahead, it was echoed before the prompt was shown.
    term.wait_for(_note(1) + rb"rank 1 asks\? rank 1 got 'early'\r\n")
    took = time.monotonic() - asked
    assert took < _WAITING_LINE_LOOKS[1] + ROUTER_ALLOWANCE, took
    term.wait_for(rb"rank 0 heard 'early'\r\n")
    assert term.finish() == 0, term.text()
    assert term.data.count(b"early") == 3, term.text()  # the echo, rank 1's, rank 0's
    assert term.data.count(b"typing goes to") == 1, term.text()


def test_the_keyboard_passes_between_two_live_readers_after_the_grace(
    terminal: type[Terminal], three_fifos: list[str]
) -> None:
    from aioelastic._core.output._stdin_router import OWNER_GRACE

    go, _, hold = three_fifos
    term = terminal(["--nproc-per-node", "2", SCRIPT, "owner_goes_on", go, hold])
    term.wait_for(_note(0) + rb"rank 0 asks\? $")
    _write(go)
    term.wait_for(rb"rank 0 asks\? rank 1 asks\? \r\n")  # as in the test above
    typed = time.monotonic()
    term.type(b"first\r")
    term.wait_for(rb"rank 1 asks\? \r\nfirst\r\nrank 0 got 'first'\r\n")
    # Rank 0 lives on without reading: it keeps the keyboard OWNER_GRACE seconds after
    # it was given the line (a line typed during its command is not given away), then
    # rank 1, which reads all along, gets it.
    term.wait_for(rb"rank 0 got 'first'\r\n" + _note(1) + rb"rank 1 asks\? $")
    took = time.monotonic() - typed
    assert OWNER_GRACE <= took < OWNER_GRACE + ROUTER_ALLOWANCE, took
    term.type(b"second\r")
    term.wait_for(rb"rank 1 asks\? second\r\nrank 1 got 'second'\r\n")
    _write(hold)
    assert term.finish() == 0, term.text()
    assert term.data.count(b"typing goes to") == 2, term.text()
    assert term.data.count(b"first") == 2, term.text()  # the echo, rank 0's line
    assert term.data.count(b"second") == 2, term.text()


def test_where_proc_cannot_tell_a_worker_left_at_a_prompt_counts_as_reading(
    terminal: type[Terminal], fifos: list[str]
) -> None:
    from aioelastic._core.output._stdin_router import _PROMPT_LOOKS

    # Rank 1 writes its prompt and reads only `pause` seconds later. /proc would give it
    # the keyboard at its read; the fallback, at the first look after the prompt.
    pause = 2 * ROUTER_ALLOWANCE
    launcher = [sys.executable, str(CHILDREN / "cannot_tell.py")]
    term = terminal(
        ["--nproc-per-node", "2", SCRIPT, "rank1_asks", *fifos, str(pause)], launcher=launcher
    )
    term.wait_for(rb"rank 0 waits for rank 1\r\n")
    asked = time.monotonic()
    term.wait_for(rb"rank 0 waits for rank 1\r\n" + _note(1) + rb"name\? $")
    took = time.monotonic() - asked
    assert took < _PROMPT_LOOKS[-1] + ROUTER_ALLOWANCE < pause, took
    term.type(b"Bob\r")
    term.wait_for(rb"name\? Bob\r\nrank 1 got 'Bob'\r\n")
    term.wait_for(rb"rank 0 heard 'Bob'\r\n")
    assert term.finish() == 0, term.text()
    assert term.data.count(b"typing goes to") == 1, term.text()


def test_ctrl_c_still_stops_the_job_while_a_rank_waits_for_input(
    terminal: type[Terminal], fifos: list[str]
) -> None:
    term = terminal(["--nproc-per-node", "2", SCRIPT, "rank1_asks", *fifos])
    term.wait_for(_note(1) + rb"name\? $")
    term.type(b"\x03")  # the terminal makes it SIGINT for the launcher's process group
    assert term.finish() == 130, term.text()
    assert b"rank 1 got" not in term.data
