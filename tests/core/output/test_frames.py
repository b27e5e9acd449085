"""Framing: whole lines and frames whatever the chunking, and the framer's units.

A worker's bytes arrive in any pieces, at any pace; the console must show the lines and
progress-bar frames the worker wrote (``output/_frames.py``, fed by ``output/_logs.py``'s
pump).
"""

from __future__ import annotations

import io
import os
import random
import sys
import threading
import time
from typing import Any

import anyio
import pytest

from aioelastic._core.output import _logs
from aioelastic._core.output._console import ConsoleStream
from aioelastic._core.output._frames import Framer, Live
from aioelastic._core.output._logs import StreamPump

# -- whole lines whatever the chunking ----------------------------------------------------
#
# The pump is fed the same byte stream cut at random boundaries, with random pauses
# between writes (the pattern of a block-buffered program: nearly every read ends in the
# middle of a line, for many flush delays in a row), into a real console writer whose
# pipe is drained by a reader that may be slow enough to pause the pump. Every line must
# reach the console once, in order, whole and prefixed, exactly as if the stream had been
# read in one piece. Pauses are bounded so that no line waits for its newline longer than
# a fraction of the flush delay: a line held longer is *meant* to be shown early.

_DELAY = 0.5  # the flush delay in these tests: a wide margin over the pauses below
_LINE_BUDGET = 0.1  # the most a line may wait between its first byte and its newline


def _numbered_stream(rng: random.Random, lines: int) -> bytes:
    return b"".join(b"line %d %s\n" % (i, b"x" * rng.randrange(60)) for i in range(lines))


def _frames_stream(rng: random.Random, pieces: int) -> bytes:
    out = []
    for i in range(pieces):
        kind = rng.random()
        if kind < 0.5:
            out.append(b"line %d %s\n" % (i, b"x" * rng.randrange(40)))
        elif kind < 0.75:
            frames = rng.randint(1, 6)
            bar = b"".join(b"\rstep %d/%d" % (j, frames) for j in range(1, frames + 1))
            out.append(bar + rng.choice([b"\n", b"\r\n", b"\r", b""]))
        elif kind < 0.9:
            out.append(b"crlf %d\r\n" % i)
        else:
            out.append(rng.choice([b"\n", b"\r", b"\r\r"]))
    return b"".join(out) + b"\n"


def _big_line_stream(rng: random.Random) -> bytes:
    before, after = _numbered_stream(rng, 12_000), _numbered_stream(rng, 12_000)
    return before + b"<" + b"L" * (1 << 20) + b">\n" + after


def _cut(rng: random.Random, data: bytes, sizes: Any, pauses: Any) -> list[tuple[bytes, float]]:
    """``data`` as (chunk, pause before it) pairs, no line waiting past ``_LINE_BUDGET``."""
    chunks: list[tuple[bytes, float]] = []
    at, clock, line_began = 0, 0.0, 0.0
    while at < len(data):
        chunk = data[at : at + sizes()]
        pause = pauses()
        if at and data[at - 1 : at] != b"\n" and clock + pause - line_began > _LINE_BUDGET:
            pause = 0.0  # the line begun before this chunk must not be held any longer
        clock += pause
        chunks.append((chunk, pause))
        at += len(chunk)
        end = chunk.rfind(b"\n")
        if end >= 0 and end < len(chunk) - 1:
            line_began = clock  # this chunk begins a line it does not end
        elif end < 0 and data[at - len(chunk) - 1 : at - len(chunk)] in (b"\n", b""):
            line_began = clock
    return chunks


def _block_buffered(rng: random.Random, data: bytes) -> list[tuple[bytes, float]]:
    # 8 KiB writes, each ending wherever the buffer filled: ~10,000 lines/s.
    return _cut(rng, data, lambda: 8192, lambda: rng.uniform(0.01, 0.03))


def _random_cuts(rng: random.Random, data: bytes) -> list[tuple[bytes, float]]:
    sizes = lambda: int(2 ** rng.uniform(0, 13))  # noqa: E731 - 1 B to 8 KiB, log-uniform
    return _cut(rng, data, sizes, lambda: rng.choice([0.0, 0.0, rng.uniform(0, 0.02)]))


def rendered(console: bytes, prefix: bytes) -> list[list[bytes]]:
    """What each console line shows, frame by frame; every frame must carry ``prefix``.

    A redrawn line is the list of its frames; empty frames and a bare prefix (a
    redrawing ``\\r`` at the start of a line) draw nothing and are left out.
    """
    assert console.endswith(b"\n"), console[-200:]
    lines = []
    for line in console.split(b"\n")[:-1]:
        frames = [frame for frame in line.split(b"\r") if frame and frame != prefix]
        for frame in frames:
            assert frame.startswith(prefix), f"a piece without its prefix: {frame[:200]!r}"
        lines.append(frames)
    return lines


@pytest.mark.parametrize("seed", range(300))
def test_the_framer_shows_the_same_whatever_the_chunking(seed: int) -> None:
    rng = random.Random(seed)
    data = _frames_stream(rng, 60)
    reference = Framer(b"[p]", console=True, keep_tail=True)
    whole = reference.feed(data) + reference.end()
    framer = Framer(b"[p]", console=True, keep_tail=True)
    pieces, at = [], 0
    while at < len(data):
        size = rng.randint(1, 12)
        pieces.append(framer.feed(data[at : at + size]))
        at += size
    shown = b"".join(pieces) + framer.end()
    assert rendered(shown, b"[p]") == rendered(whole, b"[p]")
    assert framer.tail_lines() == reference.tail_lines()


class PipeConsole:
    """A real console writer whose stream is a pipe drained by a thread, maybe slowly."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, high_water: int, slow: bool) -> None:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        self._stream = io.TextIOWrapper(io.FileIO(write_end, "w"))
        monkeypatch.setattr(sys, "stdout", self._stream)
        self.stream = ConsoleStream("stdout", high_water=high_water)
        self.received = bytearray()
        pause = 0.001 if slow else 0.0

        def read() -> None:
            with io.FileIO(read_end, "r") as pipe:
                while chunk := pipe.read(4096 if slow else 1 << 20):
                    self.received += chunk
                    if pause:
                        time.sleep(pause)  # a slow terminal: the pace, not a synchronisation

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    async def close(self) -> bytes:
        """Wait until everything queued is written; return what the reader received."""
        await self.stream.flush()
        self._stream.close()
        self._reader.join(30)
        assert not self._reader.is_alive()
        return bytes(self.received)


async def pump_chunks(
    chunks: list[tuple[bytes, float]], console: PipeConsole, prefix: bytes
) -> None:
    """Write ``chunks`` into a pipe from a thread, pausing as told, through a pump."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pump = StreamPump(
        read_end, log_path=None, console=console.stream, prefix=prefix, keep_tail=True
    )

    def write() -> None:
        try:
            for chunk, pause in chunks:
                if pause:
                    time.sleep(pause)  # the writer's pace, not a synchronisation
                view = memoryview(chunk)
                while view:
                    view = view[os.write(write_end, view) :]
        except BrokenPipeError:
            pass  # the pump failed and closed its end; the assertions below say so
        finally:
            os.close(write_end)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    with anyio.fail_after(60):
        await pump.run()
    writer.join(10)
    assert pump.log_fault() is None


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stream", "cut", "slow_console"),
    [
        pytest.param("numbered", _block_buffered, False, id="block-buffered"),
        pytest.param("numbered", _random_cuts, False, id="random-cuts"),
        pytest.param("numbered", _block_buffered, True, id="block-buffered-slow-console"),
        pytest.param("frames", _random_cuts, False, id="frames-random-cuts"),
        pytest.param("frames", _random_cuts, True, id="frames-slow-console"),
        pytest.param("big-line", _random_cuts, False, id="megabyte-line"),
    ],
)
async def test_console_lines_are_the_written_lines_whatever_the_chunking(
    monkeypatch: pytest.MonkeyPatch, stream: str, cut: Any, slow_console: bool
) -> None:
    monkeypatch.setattr(_logs, "FLUSH_DELAY", _DELAY)
    seed = f"{stream}-{cut.__name__}-{slow_console}"
    rng = random.Random(seed)
    if stream == "numbered":
        data = _numbered_stream(rng, 20_000)
    elif stream == "frames":
        data = _frames_stream(rng, 20_000)
    else:
        data = _big_line_stream(rng)
    chunks = cut(rng, data)
    # Long runs of reads that all end mid-line, for several flush delays in a row: the
    # pattern that cut a line in two every flush delay.
    mid_line = [chunk[-1:] != b"\n" for chunk, _ in chunks]
    assert sum(pause for _, pause in chunks) > 3 * _DELAY
    assert sum(mid_line) > 0.9 * len(chunks)
    prefix = b"[w3]:"
    console = PipeConsole(
        monkeypatch, high_water=8192 if slow_console else 1 << 24, slow=slow_console
    )
    await pump_chunks(chunks, console, prefix)
    shown = await console.close()
    reference = Framer(prefix, console=True, keep_tail=False)
    whole = reference.feed(data) + reference.end()
    assert rendered(shown, prefix) == rendered(whole, prefix), f"seed {seed}"
    if b"\r" not in data:
        assert shown == b"".join(prefix + line + b"\n" for line in data.split(b"\n")[:-1])


# -- framing, unit ------------------------------------------------------------------------


def _feed_all(framer: Framer, pieces: list[bytes | None]) -> bytes:
    """Feed ``pieces``; ``None`` stands for the flush delay expiring."""
    out = b""
    for piece in pieces:
        out += framer.flush() if piece is None else framer.feed(piece)
    return out + framer.end()


@pytest.mark.parametrize(
    ("pieces", "console", "tail"),
    [
        pytest.param(
            [b"\ra 1", b"\ra 2", b"\ra 3", b"\nok\n"],
            b"\r[p]a 1\r[p]a 2\r[p]a 3\n[p]ok\n",
            [b"a 3", b"ok"],
            id="frames-in-one-go",
        ),
        pytest.param(
            [b"\ra 1", None, None, b"\ra 2", None, b"\n"],
            b"\r[p]a 1\r[p]a 2\r\n",
            [b"a 2"],
            id="each-frame-shown-once-by-the-delay",
        ),
        pytest.param(
            [b"\ra 1", None, b"0", None, b"\n"],
            b"\r[p]a 1\r[p]a 10\r\n",
            [b"a 10"],
            id="a-shown-frame-that-grows-is-drawn-again-whole",
        ),
        pytest.param(
            [b"loss=", None, b"0.5\n"],
            b"[p]loss=\n[p]0.5\n",
            [b"loss=", b"0.5"],
            id="plain-partial-text-is-still-a-line",
        ),
        pytest.param(
            [b"a\r", b"\nb\r", b"x\n"],
            b"[p]a\r\n[p]b\r[p]x\n",
            [b"a", b"x"],
            id="crlf-is-a-line-end-split-across-reads",
        ),
        pytest.param(
            [b"\ra 1", None, b"\ra 2"],
            b"\r[p]a 1\r[p]a 2\n",
            [b"a 2"],
            id="a-frame-held-at-the-end-gets-a-newline",
        ),
    ],
)
def test_framer_cuts_lines_and_frames(
    pieces: list[bytes | None], console: bytes, tail: list[bytes]
) -> None:
    framer = Framer(b"[p]", console=True, keep_tail=True)
    assert _feed_all(framer, pieces) == console
    assert framer.tail_lines() == tail


def test_a_bars_first_carriage_return_read_alone_leads_the_next_piece() -> None:
    # The worker writes "\rprogress   0%"; a busy reader may take it before the next
    # write, and then its \r is a block of its own. Printed alone, that \r would be a
    # console piece without our prefix, and another rank's piece could follow it.
    framer = Framer(b"[w1]:", console=True, keep_tail=True)
    pieces = [framer.feed(b"\rprogress   0%"), framer.feed(b"\rprogress  25%"), framer.end()]
    assert pieces == [b"", b"\r[w1]:progress   0%\r", b"[w1]:progress  25%\n"]


def test_live_frames_are_shown_as_they_arrive() -> None:
    framer = Framer(b"", console=True, keep_tail=True, live=Live.FRAMES)
    assert framer.feed(b"\r 10%|#") == b"\r 10%|#\r"
    assert not framer.holding
    assert framer.feed(b"#") == b" 10%|##\r"
    assert framer.feed(b"\r 20%|###") == b" 20%|###\r"
    assert framer.feed(b"\n") == b"\n"
    assert framer.tail_lines() == [b" 20%|###"]
    assert framer.feed(b"name? ") == b""  # plain text: a line of its own, later
    assert framer.flush() == b"name? \n"


def test_alone_at_a_terminal_a_prompt_is_shown_at_once_on_its_line() -> None:
    framer = Framer(b"", console=True, keep_tail=True, live=Live.EVERYTHING)
    assert framer.feed(b"name? ") == b"name? "
    assert framer.flush() == b""
    assert framer.feed(b"Alice\nhello") == b"Alice\nhello"
    assert framer.feed(b"\r 10%") == b"\r 10%\r"
    assert framer.feed(b"\r 20%") == b" 20%\r"
    assert framer.end() == b"\n"
    assert framer.tail_lines() == [b"name? Alice", b" 20%"]
    with pytest.raises(ValueError, match="prefix"):
        Framer(b"[w0]:", console=True, keep_tail=False, live=Live.EVERYTHING)


def test_a_prompt_held_back_is_shown_at_once_when_its_worker_gets_the_keyboard() -> None:
    # One of several workers at a terminal: its prompt waits, like any partial line,
    # until the stdin router finds it reading and raises it to Live.EVERYTHING.
    framer = Framer(b"", console=True, keep_tail=True, live=Live.FRAMES)
    assert framer.feed(b"(Pdb) ") == b""
    assert framer.set_live(Live.EVERYTHING) == b"(Pdb) "
    assert not framer.holding
    assert framer.raw_text_shown
    # The typed line's Enter was echoed by the terminal: the prompt's line is over, and
    # the worker's answer is not printed after an empty line.
    framer.end_shown_line()
    assert not framer.raw_text_shown
    assert framer.feed(b"42\n(Pdb) ") == b"42\n(Pdb) "
    # Back to Live.FRAMES (it went on, another worker reads): text shown stays shown,
    # and only the rest of its line follows, once complete or at the flush delay.
    assert framer.set_live(Live.FRAMES) == b""
    assert framer.feed(b"c") == b""
    assert framer.flush() == b"c\n"
    assert framer.feed(b"more\n") == b"more\n"
    assert framer.tail_lines() == [b"(Pdb) ", b"42", b"(Pdb) c", b"more"]


def test_a_prefixed_stream_never_shows_partial_lines_raw() -> None:
    framer = Framer(b"[w1]:", console=True, keep_tail=False, live=Live.FRAMES)
    assert framer.feed(b"name? ") == b""
    assert framer.set_live(Live.EVERYTHING) == b""
    assert framer.live is Live.FRAMES
    assert framer.flush() == b"[w1]:name? \n"


def test_a_thousand_frames_leave_one_line_in_the_tail() -> None:
    framer = Framer(b"", console=False, keep_tail=True)
    for i in range(1000):
        assert framer.feed(b"\rstep %d" % i) == b""
        if i % 7 == 0:
            framer.flush()
    framer.feed(b"\nTraceback\n")
    assert framer.tail_lines() == [b"step 999", b"Traceback"]
