"""Workers for tests/test_terminal.py, run by ``aioelastic-run`` under a pseudo-terminal.

Plain scripts (standard library only), as a user's training script would be::

    aioelastic-run ... tests/children/terminal.py CMD [ARGS]
"""

from __future__ import annotations

import json
import os
import signal
import sys


def cmd_tty(args: list[str]) -> None:
    """Print what the worker sees: isatty of 0, 1, 2 and the window size."""
    del args
    size = os.get_terminal_size(1)
    seen = {
        "isatty": [os.isatty(fd) for fd in (0, 1, 2)],
        "size": [size.columns, size.lines],
        "rank": os.environ.get("RANK"),
    }
    print("TTY " + json.dumps(seen), flush=True)


def cmd_frames(args: list[str]) -> None:
    """Write ``\\r`` frames to stderr; after each, wait for a byte on the FIFO ``args[1]``.

    The test sends the byte only once it saw the frame on its terminal, so each frame
    must arrive while the next one is not written yet.
    """
    count, fifo = int(args[0]), args[1]
    with open(fifo, "rb", buffering=0) as go:
        for i in range(1, count + 1):
            sys.stderr.write(f"\r\x1b[32mframe {i}/{count}\x1b[0m")
            sys.stderr.flush()
            go.read(1)
    sys.stderr.write("\n")
    print("frames done", flush=True)


def cmd_input(args: list[str]) -> None:
    """Ask for a name with input(), greet it, then read to end-of-file."""
    del args
    name = input("name? ")
    print(f"hello {name}!", flush=True)
    rest = sys.stdin.read()
    print(f"then {rest!r} and end-of-file", flush=True)


def cmd_pdb(args: list[str]) -> None:
    """Stop in ``breakpoint()``; print what the debugger session left in ``answer``."""
    del args
    answer = 0
    breakpoint()
    print(f"answer is {answer}", flush=True)


def cmd_winch(args: list[str]) -> None:
    """Print the window size on each SIGWINCH; exit after ``args[0]`` of them."""
    left = int(args[0])

    def resized(signum: int, frame: object) -> None:
        nonlocal left
        size = os.get_terminal_size(1)
        print(f"resized {size.columns}x{size.lines}", flush=True)
        left -= 1

    signal.signal(signal.SIGWINCH, resized)
    print("ready for resizes", flush=True)
    while left > 0:
        signal.pause()


def cmd_lines(args: list[str]) -> None:
    """Write ``args[0]`` numbered lines to stdout, 64 lines (about 5 KB) per ``write``.

    Whole lines per write, so no line waits out the flush delay half-written while this
    process is descheduled; the pty still cuts the writes where its buffer is full.
    """
    rank = os.environ.get("RANK", "0")
    count = int(args[0])
    for start in range(0, count, 64):
        block = "".join(
            f"rank {rank} line {i} " + "x" * (i % 61) + "\n"
            for i in range(start, min(start + 64, count))
        ).encode()
        view = memoryview(block)
        while view:
            view = view[os.write(1, view) :]


def cmd_fail(args: list[str]) -> None:
    """Print a line to stderr and exit with ``args[0]``."""
    print("about to fail", file=sys.stderr, flush=True)
    sys.exit(int(args[0]))


if __name__ == "__main__":
    globals()[f"cmd_{sys.argv[1]}"](sys.argv[2:])
