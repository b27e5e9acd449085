"""A rank whose stdout reaches its pipe as a block-buffered program's does: in full buffers.

A plain script (standard library only), run by every rank alike::

    python tests/children/block_buffered.py MODE READY GO_DIR [SEED]

Each rank writes :func:`lines` to stdout, which reaches the pipe in *rounds*, each one
write that (nearly always) ends in the middle of a line:

* ``blocks``: what C's stdio (``setvbuf`` 8 KiB), Go's ``bufio.Writer`` or Java's
  ``BufferedOutputStream`` write to a pipe: the buffer is filled to the brim and written
  whole, 8192 bytes, cutting a line anywhere; a round ends at each such write;
* ``print``: ``print()`` through the stack Python puts on a stdout pipe (a text layer on
  an 8 KiB ``BufferedWriter``), the raw writes counted. Python flushes about 8 KiB at the
  end of one of its ``write()`` calls: after a line's newline, or between a line's text
  and its newline (``print()`` writes them apart), never inside the text;
* ``random``: the same bytes cut into :data:`ROUNDS` writes at random places (from
  ``SEED`` and the rank), each at least 4 KiB, as a buffer's flush is.

After each round the rank writes ``(waiting K)`` to stderr without a newline — a prompt,
which the launcher shows as a line of its own after its flush delay, so the test knows
that delay has passed for this round's partial line too — tells the FIFO ``READY``
``RANK K SIZE`` (``SIZE`` the bytes of the round's write) and waits for a byte on the FIFO
``GO_DIR/go.RANK``. After the last round it tells ``RANK end`` and exits.
"""

from __future__ import annotations

import io
import os
import random
import sys
from collections.abc import Iterator

#: How many writes the ``random`` mode cuts the text into.
ROUNDS = 5
#: The buffer of the ``blocks`` mode.
BLOCK = 8192
#: The smallest write of the ``random`` mode: a full buffer of C's stdio on a pipe.
MIN_WRITE = 4096


def lines(rank: int) -> list[str]:
    """What ``rank`` writes to stdout, in order: a line of its own, then one every rank
    writes alike, over and over, of lengths that vary (the same for ranks 0 to 9)."""
    out = []
    for i in range(150):
        filler = "." * (20 + (i * 53) % 300)
        out += [f"rank {rank} step {i} {filler}", f"shared {i} {filler}"]
    return out


def waiting(round_: int) -> str:
    """What a rank writes to stderr after round ``round_`` (no newline)."""
    return f"(waiting {round_})"


class _CountedFileIO(io.FileIO):
    """The raw file under the buffer, remembering the size of each write it is given."""

    sizes: list[int]

    def write(self, data: object) -> int:
        written = super().write(data)  # type: ignore[arg-type]
        self.sizes.append(written)
        return written


def _printed(rank: int) -> Iterator[int]:
    """``print()`` every line; the size of each flush, as it happens."""
    raw = _CountedFileIO(1, "w", closefd=False)
    raw.sizes = []
    out = io.TextIOWrapper(io.BufferedWriter(raw, buffer_size=8192), encoding="utf-8")
    for line in lines(rank):
        print(line, file=out)
        while raw.sizes:
            yield raw.sizes.pop(0)
    out.flush()
    yield from raw.sizes


def _blocks(rank: int) -> Iterator[int]:
    """Every line into a buffer written out whole each time it fills; each write's size."""
    buffer = bytearray()
    for line in lines(rank):
        buffer += f"{line}\n".encode()
        while len(buffer) >= BLOCK:
            _write_all(buffer[:BLOCK])
            del buffer[:BLOCK]
            yield BLOCK
    _write_all(buffer)  # the flush at exit
    yield len(buffer)


def _write_all(data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]


def _cut(rank: int, seed: int) -> Iterator[int]:
    """The text in :data:`ROUNDS` writes of random sizes; the size of each."""
    data = "".join(f"{line}\n" for line in lines(rank)).encode()
    rng = random.Random(seed * 1000 + rank)
    step = len(data) // ROUNDS
    assert step // 2 >= MIN_WRITE, "the text is too short to cut"
    at = 0
    for k in range(1, ROUNDS + 1):
        end = len(data) if k == ROUNDS else k * step + rng.randrange(-step // 4, step // 4)
        _write_all(data[at:end])
        yield end - at
        at = end


def main(argv: list[str]) -> None:
    mode, ready, go_dir = argv[0], argv[1], argv[2]
    seed = int(argv[3]) if len(argv) > 3 else 0
    rank = int(os.environ["RANK"])
    go = os.open(os.path.join(go_dir, f"go.{rank}"), os.O_RDONLY)
    if mode == "random":
        rounds = _cut(rank, seed)
    else:
        rounds = {"print": _printed, "blocks": _blocks}[mode](rank)
    with open(ready, "w", buffering=1) as tell:
        for k, size in enumerate(rounds):
            os.write(2, waiting(k).encode())
            tell.write(f"{rank} {k} {size}\n")
            if os.read(go, 1) != b"g":
                return  # the test gave up
        tell.write(f"{rank} end\n")
    os.close(go)


if __name__ == "__main__":
    main(sys.argv[1:])
