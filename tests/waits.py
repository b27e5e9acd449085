"""Event-driven synchronisation for tests: a child says "ready" through a FIFO.

The test creates the FIFO and opens its read end without blocking; a worker opens it for
writing and writes a line when it reached the state the test waits for. The test awaits
readability with a timeout — never a sleep.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio


class ReadyFifo:
    """A named pipe a worker writes ``ready``-style lines to."""

    def __init__(self, directory: Path, name: str = "ready") -> None:
        self.path = directory / f"{name}.fifo"
        os.mkfifo(self.path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        # Our own idle writer: without one, the FIFO reports hang-up (readable, empty)
        # after each worker closes it, and waiting on it would spin.
        self._keep_open = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self._buffer = b""

    async def lines(self, count: int, timeout: float = 30.0) -> list[str]:
        """Wait for ``count`` lines (each writer writes whole lines)."""
        with anyio.fail_after(timeout):
            while self._buffer.count(b"\n") < count:
                await anyio.wait_readable(self._fd)
                self._buffer += os.read(self._fd, 65536)
        lines = self._buffer.split(b"\n")
        taken, rest = lines[:count], lines[count:]
        self._buffer = b"\n".join(rest)
        return [line.decode() for line in taken]

    def close(self) -> None:
        """Close both ends."""
        os.close(self._keep_open)
        os.close(self._fd)


def process_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (``None`` when it no longer exists)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z", "X")
