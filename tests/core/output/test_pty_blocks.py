"""A block-buffered writer at a pty: every line whole, and a prompt after it still shown.

A pipe hands a write of 8 KiB to one read; a pty's master in pieces (``tty_write``'s
2048-byte chunks while the reader keeps up, or 4095 + 4095 + 2 bytes through the line
discipline), the last of them often a few bytes that end mid-line. The rule for a
block-buffered writer (``BLOCK_WRITE``, ``PTY_PIECE`` in ``_logs.py``) must see the write
whole all the same.

Here the pump itself, fed by a child through a pty; the same through the launcher at a
terminal is ``test_terminal_workers.py``'s block-buffered test.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import anyio
import pytest

from aioelastic._core.output import _logs
from aioelastic._core.output._logs import StreamPump
from aioelastic._core.output._terminal import _open
from tests.support.paths import CHILDREN

SCRIPT = str(CHILDREN / "terminal.py")

pytestmark = pytest.mark.timeout(120)


_DELAY = 0.1  # the flush delay in these tests


class Recorder:
    """A console that keeps what it is given, with the time each block came.

    Once a block ending with ``cue`` comes, a byte is written to ``go`` (if given), after
    the pump's callback: the pump has read all the pty held by then.
    """

    def __init__(self, cue: bytes = b"", go: int | None = None) -> None:
        self.blocks: list[tuple[float, bytes]] = []
        self._cue, self._go = cue, go

    def put(self, data: bytes) -> None:
        self.blocks.append((time.monotonic(), data))
        if self._go is not None and data.endswith(self._cue):
            asyncio.get_running_loop().call_soon(os.write, self._go, b"g")
            self._go = None

    def room(self, loop: Any) -> None:
        return None

    def end(self) -> None:
        pass

    def text(self) -> bytes:
        return b"".join(data for _, data in self.blocks)


async def _pump_child(
    argv: list[str],
    prefix: bytes,
    console: Recorder,
    pass_fds: tuple[int, ...] = (),
    go_each_read: int | None = None,
) -> None:
    """Run ``terminal.py ARGV`` with stdout on a pty set up as a worker's, into ``console``.

    ``go_each_read``: where a byte is written after each wake-up of the pump that read
    something, once it has read all the pty held.
    """
    opened: list[int] = []
    master, slave, _ = _open(True, opened)
    try:
        proc = subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=slave, pass_fds=pass_fds)
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    os.close(slave)
    pump = StreamPump(master, log_path=None, console=console, prefix=prefix, keep_tail=False)
    if go_each_read is not None:
        go, due = go_each_read, [False]

        def send() -> None:
            due[0] = False
            os.write(go, b"g")

        def read(_: bytes) -> None:
            if not due[0]:
                due[0] = True
                asyncio.get_running_loop().call_soon(send)

        pump.on_chunk = read
    try:
        with anyio.fail_after(60):
            await pump.run()  # to EIO: the child exited, closing the slave side
    finally:
        pump.finish()
        proc.kill()
        proc.wait()


@pytest.mark.asyncio
async def test_each_piece_of_a_block_at_a_pty_joins_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 8 KiB writes ending mid-line, 4 flush delays apart, read from a pty's master: each
    # reaches the pump in pieces, the last often a few bytes, and none may start a delay
    # that cuts its line before the next write.
    monkeypatch.setattr(_logs, "FLUSH_DELAY", _DELAY)
    count = 1200
    console = Recorder()
    await _pump_child(["blocks", str(count), str(4 * _DELAY)], b"[w0]:", console)
    text = "".join(f"[w0]:rank 0 line {i} " + "x" * (i % 61) + "\n" for i in range(count))
    assert console.text() == text.encode()


@pytest.mark.asyncio
async def test_a_block_read_piece_by_piece_at_a_pty_joins_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same blocks, each written as 2048-byte pieces, the next only once the pump read
    # the last: the reader keeping up with the writer, as on a loaded machine, where
    # tty_write yields the CPU between its chunks. The last piece of a block is under
    # BLOCK_WRITE and read on its own.
    monkeypatch.setattr(_logs, "FLUSH_DELAY", _DELAY)
    count = 1200
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    console = Recorder()
    try:
        argv = ["blocks_in_pieces", str(count), str(4 * _DELAY), str(go_r)]
        await _pump_child(argv, b"[w0]:", console, (go_r,), go_each_read=go_w)
    finally:
        os.close(go_r)
        os.close(go_w)
    text = "".join(f"[w0]:rank 0 line {i} " + "x" * (i % 61) + "\n" for i in range(count))
    assert console.text() == text.encode()


@pytest.mark.asyncio
async def test_a_prompt_after_a_block_of_whole_lines_is_shown_after_the_flush_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The prompt comes right after an 8 KiB write was read (within the gap that still
    # joins the pieces of one write), but as a write of its own after a newline: a
    # prompt, not the tail of the block, so it is shown after the flush delay, as a line
    # of its own, long before its line ends.
    monkeypatch.setattr(_logs, "FLUSH_DELAY", _DELAY)
    wait = 30 * _DELAY
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    # Cued by the block's last line: the pump read all of the block before the prompt.
    last = b"line 199 " + b"x" * (199 % 61) + b"\n"
    console = Recorder(cue=last, go=go_w)
    try:
        await _pump_child(["block_then_prompt", str(go_r), str(wait)], b"[w0]:", console, (go_r,))
    finally:
        os.close(go_r)
        os.close(go_w)
    assert console.text().endswith(b"[w0]:name? \n[w0]:done\n"), console.text()[-300:]
    shown = next(at for at, data in console.blocks if data.endswith(b"[w0]:name? \n"))
    asked = next(at for at, data in console.blocks if data.endswith(last))
    # The delay plus an allowance for a loaded machine; the line ends `wait` later.
    assert shown - asked < _DELAY + 10 * _DELAY, console.text()[-300:]
