"""Workers for the terminal tests, run by ``aioelastic-run`` under a pty.

tests/core/output/test_terminal_workers.py and test_terminal_keyboard.py run them.

Plain scripts (standard library only), as a user's training script would be::

    aioelastic-run ... tests/children/terminal.py CMD [ARGS]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


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


def cmd_stdin(args: list[str]) -> None:
    """Print what stdin is and what reading it gives."""
    del args
    print(f"STDIN {os.readlink('/proc/self/fd/0')} {sys.stdin.read()!r}", flush=True)


def cmd_rank1_asks(args: list[str]) -> None:
    """Rank 1 asks for a name with input() and greets it; rank 0 waits for it meanwhile.

    Rank 0 prints that it waits, then tells rank 1 to ask through the FIFO ``args[0]``
    (so its line is out before the prompt), and stays running, not reading stdin, until
    rank 1 sends the name through the FIFO ``args[1]``. With ``args[2]``, rank 1 works
    that many seconds between its prompt and its read, as a program that asks first and
    reads later does (and as a loaded machine makes any program do).
    """
    if os.environ["RANK"] == "1":
        with open(args[0]) as go:
            go.read()
        if len(args) > 2:
            sys.stderr.write("name? ")
            sys.stderr.flush()
            time.sleep(float(args[2]))
            name = input()
        else:
            name = input("name? ")
        print(f"rank 1 got {name!r}", flush=True)
        with open(args[1], "w") as fifo:
            fifo.write(name)
    else:
        print("rank 0 waits for rank 1", flush=True)
        with open(args[0], "w") as go:
            go.write("ask")
        with open(args[1]) as fifo:
            print(f"rank 0 heard {fifo.read()!r}", flush=True)


def cmd_rank1_pdb(args: list[str]) -> None:
    """Rank 1 stops in ``breakpoint()``; what the session leaves in ``answer`` is printed.

    Rank 0 waits on the FIFO ``args[0]`` until rank 1 has continued.
    """
    if os.environ["RANK"] == "1":
        x = 6
        answer = 0
        breakpoint()
        print(f"answer is {answer + x}", flush=True)
        with open(args[0], "w") as fifo:
            fifo.write("continued")
    else:
        with open(args[0]) as fifo:
            print(f"rank 0 heard {fifo.read()!r}", flush=True)


def cmd_both_ask(args: list[str]) -> None:
    """Each rank asks once, after printing ``asks``; rank 1 only once rank 0 is asking.

    Rank 0 prints ``rank 0 asks``, then asks; rank 1 waits for the FIFO ``args[0]`` (which
    the test opens once rank 0's prompt is up), then asks too. Each prints what it got.
    """
    rank = os.environ["RANK"]
    if rank == "1":
        with open(args[0]) as fifo:
            fifo.read()
    line = input(f"rank {rank} asks? ")
    print(f"rank {rank} got {line!r}", flush=True)


def cmd_owner_dies(args: list[str]) -> None:
    """Both ranks ask; rank 0 dies (exit 0) while it asks, once ``args[1]`` says so.

    Rank 0 asks at once, and exits from a thread when the FIFO ``args[1]`` is written,
    its question unanswered. Rank 1 asks once the FIFO ``args[0]`` is written, and
    prints what it got.
    """
    if os.environ["RANK"] == "0":

        def die() -> None:
            with open(args[1]) as fifo:
                fifo.read()
            os._exit(0)

        threading.Thread(target=die, daemon=True).start()
        input("rank 0 asks? ")
        print("rank 0 got an answer", flush=True)
    else:
        with open(args[0]) as fifo:
            fifo.read()
        line = input("rank 1 asks? ")
        print(f"rank 1 got {line!r}", flush=True)


def cmd_late_ask(args: list[str]) -> None:
    """Rank 1 asks only once the FIFO ``args[0]`` is written; rank 0 never reads stdin.

    Rank 0 prints that it waits and waits for rank 1's answer on the FIFO ``args[1]``.
    """
    if os.environ["RANK"] == "1":
        with open(args[0]) as go:
            go.read()
        line = input("rank 1 asks? ")
        print(f"rank 1 got {line!r}", flush=True)
        with open(args[1], "w") as fifo:
            fifo.write(line)
    else:
        print("rank 0 waits", flush=True)
        with open(args[1]) as fifo:
            print(f"rank 0 heard {fifo.read()!r}", flush=True)


def cmd_owner_goes_on(args: list[str]) -> None:
    """Both ranks ask; rank 0 first, and after its answer it lives on, not reading.

    Rank 0 asks at once; once answered it prints so and holds (alive, not reading stdin)
    until the FIFO ``args[1]`` is written. Rank 1 asks once the FIFO ``args[0]`` is
    written.
    """
    rank = os.environ["RANK"]
    if rank == "1":
        with open(args[0]) as fifo:
            fifo.read()
    line = input(f"rank {rank} asks? ")
    print(f"rank {rank} got {line!r}", flush=True)
    if rank == "0":
        with open(args[1]) as fifo:
            fifo.read()


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


def cmd_blocks(args: list[str]) -> None:
    """Write ``args[0]`` numbered lines as a block-buffered writer does: 8 KiB at a time.

    Each ``write`` is 8192 bytes of the lines' text, so it ends mid-line, and the rest of
    that line comes with the next one, ``args[1]`` seconds later (a training step between
    two flushes of a full buffer); the last ``write`` is what is left.
    """
    rank = os.environ.get("RANK", "0")
    count, pause = int(args[0]), float(args[1])
    text = "".join(f"rank {rank} line {i} " + "x" * (i % 61) + "\n" for i in range(count))
    data = text.encode()
    for start in range(0, len(data), 8192):
        if start:
            time.sleep(pause)
        view = memoryview(data)[start : start + 8192]
        while view:
            view = view[os.write(1, view) :]


def cmd_blocks_in_pieces(args: list[str]) -> None:
    """``cmd_blocks``' output (``args[0]`` lines, ``args[1]`` s between 8 KiB blocks), each
    block written in 2048-byte pieces, each piece after a byte came on fd ``args[2]``:
    the pieces of one write a pty's reader gets when it keeps up with the writer."""
    rank = os.environ.get("RANK", "0")
    count, pause, go = int(args[0]), float(args[1]), int(args[2])
    text = "".join(f"rank {rank} line {i} " + "x" * (i % 61) + "\n" for i in range(count))
    data = text.encode()
    for start in range(0, len(data), 8192):
        if start:
            time.sleep(pause)
        for piece in range(start, min(start + 8192, len(data)), 2048):
            if piece:
                os.read(go, 1)
            view = memoryview(data)[piece : min(piece + 2048, start + 8192)]
            while view:
                view = view[os.write(1, view) :]


def cmd_block_then_prompt(args: list[str]) -> None:
    """Write 200 whole lines (7.7 KB) in one ``write``; once a byte comes on fd
    ``args[0]``, ``name? `` (a prompt, a write of its own); ``args[1]`` s later ``done``."""
    data = memoryview("".join(f"line {i} " + "x" * (i % 61) + "\n" for i in range(200)).encode())
    while data:
        data = data[os.write(1, data) :]
    os.read(int(args[0]), 1)
    os.write(1, b"name? ")
    time.sleep(float(args[1]))
    os.write(1, b"done\n")


def cmd_fail(args: list[str]) -> None:
    """Print a line to stderr and exit with ``args[0]``."""
    print("about to fail", file=sys.stderr, flush=True)
    sys.exit(int(args[0]))


if __name__ == "__main__":
    globals()[f"cmd_{sys.argv[1]}"](sys.argv[2:])
