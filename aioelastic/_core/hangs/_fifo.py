"""A FIFO owned by the supervisor: made, held open, drained without blocking, removed.

Workers write to it (a stack dump, a timer request) by opening its path. The supervisor
holds it open for reading *and* writing: with a writer of its own the FIFO never reports
end-of-file when a worker closes its end (each timer request is an open/write/close), so
it never reads as always-readable and no loop spins on it. Its descriptor is
non-blocking: :meth:`OwnedFifo.drain` takes what is there and returns.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["OwnedFifo"]


class OwnedFifo:
    """The FIFO at ``path``, once :meth:`open` made it (its directory must exist)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"<OwnedFifo {str(self.path)!r} {'open' if self._fd is not None else 'closed'}>"

    def open(self) -> None:
        """Create the FIFO (mode 0600) and open it; before any worker writes to it."""
        os.mkfifo(self.path, 0o600)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def fd(self) -> int | None:
        """The supervisor's descriptor of the FIFO (``None`` before open or after close)."""
        return self._fd

    def drain(self) -> bytes:
        """Everything written to the FIFO so far, without waiting for more."""
        assert self._fd is not None
        chunks = []
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Close and remove the FIFO; idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
