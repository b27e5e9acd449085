"""A block-buffered writer at a pty: every line whole, and a prompt after it still shown.

A pipe hands a write of 8 KiB to one read; a pty's master in pieces (``tty_write``'s
2048-byte chunks while the reader keeps up, or 4095 + 4095 + 2 bytes through the line
discipline), the last of them often a few bytes that end mid-line. The rule for a
block-buffered writer (``BLOCK_WRITE``, ``PTY_PIECE`` in ``_logs.py``) must see the write
whole all the same.

The first test is ``test_terminal.py``'s test of the same name, run here without its
``xfail`` marker while that file is being split (its ``Terminal`` helper is copied as is,
minus what the test does not use); once the marker is gone there, the copy can go.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from aioelastic._core.output import _logs
from aioelastic._core.output._logs import StreamPump
from aioelastic._core.output._terminal import _open
from tests.support.paths import CHILDREN, REPO

SCRIPT = str(CHILDREN / "terminal.py")

pytestmark = pytest.mark.timeout(120)


def _set_size(fd: int, columns: int, lines: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))


def _take_terminal() -> None:
    # In the child, after setsid and the dup2s: fd 0 becomes the controlling terminal
    # and this process group its foreground job, as a shell arranges for a command.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


#: How the launcher is run: ``aioelastic-run``.
LAUNCHER = [sys.executable, "-m", "aioelastic.run"]


class Terminal:
    """``aioelastic-run ARGV`` on a pty of ``columns`` x ``lines`` (``test_terminal.py``'s)."""

    def __init__(self, argv: list[str], *, columns: int = 101, lines: int = 37) -> None:
        self.master, slave = os.openpty()
        _set_size(slave, columns, lines)
        env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "LOGLEVEL")}
        try:
            self.proc = subprocess.Popen(
                [*LAUNCHER, *argv],
                cwd=REPO,
                env=env,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                start_new_session=True,
                preexec_fn=_take_terminal,
            )
        finally:
            os.close(slave)
        self.data = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError as exc:
                if exc.errno != errno.EIO:  # EIO: every slave side is closed
                    raise
                chunk = b""
            if not chunk:
                return
            self.data += chunk

    def text(self) -> bytes:
        return bytes(self.data[-3000:])

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._reader.join(30)
        os.close(self.master)


@pytest.fixture
def terminal() -> Iterator[type[Terminal]]:
    started: list[Terminal] = []

    class Started(Terminal):
        def __init__(self, argv: list[str], **options: Any) -> None:
            super().__init__(argv, **options)
            started.append(self)

    yield Started
    for term in started:
        term.close()


def test_a_block_buffered_writer_never_has_a_line_cut_at_a_terminal(
    terminal: type[Terminal],
) -> None:
    # Two workers (a partial line is held), each writing 8 KiB blocks that end mid-line,
    # the rest of the line coming 4 flush delays later: the rule for a block-buffered
    # writer (docs/logs.md, partial lines), through a terminal. Over a pipe a read returns
    # the whole 8 KiB; a pty's master hands it over as 4095 + 4095 + 2 bytes, or in
    # tty_write's 2048-byte pieces, so the rule's "read of 4 KiB or more" is never the read
    # that ends mid-line.
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


# -- one pump over a real pty ------------------------------------------------------------

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
