"""How a function worker's return value travels to the supervisor: one framed pipe message.

The worker writes an 8-byte length and then the pickled value. The supervisor reads the
pipe concurrently with everything else, so a large value (hundreds of MB) never blocks
the worker on a full pipe while the supervisor waits for its exit. Framing matters
because end-of-file cannot be trusted: a grandchild forked by the worker (a data-loader
process, say) inherits the write end and keeps the pipe open after the worker is gone.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

    from ..aio._reader_hub import ReaderHub

_HEADER = struct.Struct("=Q")
_CHUNK = 1 << 20


def send_result(fd: int, payload: bytes | memoryview) -> None:
    """Child side: write one framed message to ``fd`` (blocking) and close it."""
    try:
        for part in (_HEADER.pack(len(payload)), payload):
            view = memoryview(part)
            while view:
                written = os.write(fd, view)
                view = view[written:]
    finally:
        os.close(fd)


class ResultReceiver:
    """Supervisor side: collects the framed message from one worker's result pipe."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd: int | None = fd
        self._buffer = bytearray()
        self._expected: int | None = None
        #: Where the pipe is registered for reading, while it is (see :meth:`start`).
        self._hub: ReaderHub | None = None

    @property
    def complete(self) -> bool:
        """Whether the whole message has arrived."""
        return self._expected is not None and len(self._buffer) >= self._expected

    def incomplete_reason(self) -> str:
        """Why the message is not complete, for a worker that exited 0 without one."""
        if self._expected is None:
            return "exited with code 0 but sent no return value (did it call os._exit(0)?)"
        return (
            f"exited with code 0 but sent only {len(self._buffer)} of the {self._expected} "
            "bytes of its pickled return value (did something end it, or close its result "
            "pipe, while it was sending?)"
        )

    def payload(self) -> bytes:
        """The pickled value; only valid once :attr:`complete`."""
        assert self._expected is not None
        return bytes(self._buffer[: self._expected])

    def drain(self) -> bool:
        """Read everything available now; ``True`` once complete or at end-of-file."""
        while self._fd is not None and not self.complete:
            try:
                chunk = os.read(self._fd, _CHUNK)
            except BlockingIOError:
                return False
            if not chunk:
                self.close()
                return True
            self._buffer += chunk
            if self._expected is None and len(self._buffer) >= _HEADER.size:
                (self._expected,) = _HEADER.unpack_from(self._buffer)
                del self._buffer[: _HEADER.size]
        if self.complete:
            self.close()
        return True

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the pipe from ``loop``'s callbacks until the message is complete or ends.

        A reader callback, not a task: a task and its cancel scope cost more than the
        rest of a small function worker's start.
        """
        # Imported here: the worker side of this module (send_result) runs in every
        # spawned worker, which should not pay for importing asyncio.
        from ..aio._reader_hub import reader_hub

        if self._fd is None or self._hub is not None:
            return
        self._hub = reader_hub(loop)
        self._hub.add(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        self.drain()  # closes (and unregisters) the pipe once it is done

    def close(self) -> None:
        """Stop reading and close the read end (idempotent)."""
        hub, self._hub = self._hub, None
        if hub is not None and self._fd is not None:
            hub.remove(self._fd)  # while the number still names this pipe
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
