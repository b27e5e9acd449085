"""The ready barrier: workers write one byte each to a FIFO, a waiter counts them.

One protocol for every waiter: a driver waiting for its N workers (blocking, or on its
event loop), and rank 0 of a failing job waiting for its siblings. The FIFO is opened
read-write and non-blocking: a reader that is also a writer never sees EOF between two
workers' writes, so waiting blocks in ``select`` or on the event loop instead of spinning,
and workers' write-only opens never block. The event-loop wait uses no helper thread,
which would show up in the supervisor's thread count (the idle measure reports it).

The worker programs written as standalone scripts (``_bin``'s code, ``_multinode_job``)
import nothing from the project and carry their own copy of :func:`signal_ready`'s three
lines; ``_bin``'s ``fail`` command also counts its siblings' bytes itself.

This module must stay importable without torch, aioelastic and anyio: workers import it.
"""

from __future__ import annotations

import os
import select
from collections.abc import Generator
from contextlib import closing
from pathlib import Path


def make_fifo(path: Path) -> Path:
    """Create the ready FIFO that workers write one byte to once they are running."""
    os.mkfifo(path)
    return path


def signal_ready(path: str) -> None:
    """Tell the reader of the FIFO at ``path`` that this worker is running."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"r")
    finally:
        os.close(fd)


def _barrier(path: str | os.PathLike[str], count: int) -> Generator[int, None, None]:
    """Count ``count`` bytes on the FIFO at ``path``; yield its fd whenever none is there.

    The caller waits until the fd is readable, in whatever way suits it, and resumes.
    """
    if count <= 0:
        return
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        got = 0
        while got < count:
            try:
                got += len(os.read(fd, count - got))
            except BlockingIOError:
                yield fd
    finally:
        os.close(fd)


def wait_ready(path: str | os.PathLike[str], count: int) -> None:
    """Block until ``count`` bytes (one per ready worker) arrived on the FIFO at ``path``."""
    with closing(_barrier(path, count)) as barrier:
        for fd in barrier:
            select.select([fd], [], [])


async def wait_ready_async(path: str | os.PathLike[str], count: int) -> None:
    """:func:`wait_ready` on the event loop, without a thread."""
    import anyio

    with closing(_barrier(path, count)) as barrier:
        for fd in barrier:
            await anyio.wait_readable(fd)
