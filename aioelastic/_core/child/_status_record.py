"""The exit-status record a fork server writes into a worker's status pipe."""

from __future__ import annotations

import struct

#: One native ``int``: the exit code, or minus the signal that killed the worker.
STATUS = struct.Struct("=i")


def encode_status(returncode: int) -> bytes:
    """The status-pipe message for ``returncode`` (the fork server's side)."""
    return STATUS.pack(returncode)


def decode_status(data: bytes) -> int | None:
    """The exit code in ``data``; ``None`` if it is not a whole record (the server died)."""
    if len(data) != STATUS.size:
        return None
    return int(STATUS.unpack(data)[0])
