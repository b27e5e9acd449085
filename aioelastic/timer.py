"""Countdown timers for workers, without torch: ``configure()`` then ``expires()``.

The same semantics as ``torch.distributed.elastic.timer`` and the same wire format as its
``FileTimerClient``, so the supervisor serves both through one FIFO. Use it in a function
or script worker started by aioelastic with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``::

    import aioelastic.timer

    aioelastic.timer.configure()
    with aioelastic.timer.expires(after=60, scope="allreduce"):
        all_reduce(...)

If the block is still running ``after`` seconds later, the supervisor captures the
worker's stacks, stops its process group and reports it as that rank's failure:
``timer expired after 60s (scope 'allreduce')``. A timer is armed per ``(pid, scope)``;
leaving the block releases it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal as _signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["configure", "expires"]

#: The variable the supervisor sets to its FIFO (torchrun's name).
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: torch's FileTimerClient refuses larger requests: a FIFO write is atomic up to PIPE_BUF.
_PIPE_BUF = 4096


@dataclass(frozen=True)
class _Client:
    path: str
    signal: int

    def send(self, scope: str, expiration: float, sig: int) -> None:
        line = json.dumps(
            {
                "version": 1,
                "pid": os.getpid(),
                "scope_id": scope,
                "expiration_time": expiration,
                "signal": sig,
            }
        ).encode()
        if len(line) + 1 > _PIPE_BUF:
            raise ValueError(
                f"timer scope {scope[:80]!r}... makes a request of {len(line)} bytes; "
                f"use a scope under {_PIPE_BUF - 200} characters"
            )
        try:
            # Non-blocking open fails at once when no supervisor reads the FIFO ...
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise BrokenPipeError(
                f"no timer server reads {self.path!r} ({exc.strerror}): run the worker "
                "under aioelastic with TORCHELASTIC_ENABLE_FILE_TIMER=1"
            ) from exc
        try:
            # ... and a blocking write then waits out a momentarily full pipe instead of
            # losing a release. One write of at most PIPE_BUF bytes is never interleaved
            # with another worker's request.
            os.set_blocking(fd, True)
            os.write(fd, line + b"\n")
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise BrokenPipeError(f"the timer server of {self.path!r} is gone") from exc
            raise
        finally:
            os.close(fd)


_client: _Client | None = None


def configure(file_path: str | None = None, signal: int = _signal.SIGKILL) -> None:
    """Point this process's timers at the supervisor's FIFO.

    Args:
        file_path: the FIFO; by default ``TORCHELASTIC_TIMER_FILE`` from the environment,
            which aioelastic sets for its workers when the file timer is enabled.
        signal: the signal the worker asks to be stopped with when a timer expires
            (torch's default, SIGKILL); 0 or less reports the expiry without stopping it.

    Raises:
        RuntimeError: no path given and ``TORCHELASTIC_TIMER_FILE`` is not set.
    """
    global _client
    path = file_path if file_path is not None else os.environ.get(TIMER_FILE_ENV)
    if not path:
        raise RuntimeError(
            f"{TIMER_FILE_ENV} is not set: start the worker with aioelastic-run (or the "
            "agent) and TORCHELASTIC_ENABLE_FILE_TIMER=1, or pass file_path="
        )
    _client = _Client(path, int(signal))


@contextlib.contextmanager
def expires(after: float, scope: str | None = None) -> Iterator[None]:
    """Arm a timer that expires ``after`` seconds from now unless the block finishes.

    Args:
        after: seconds (> 0).
        scope: the timer's name; by default the caller's ``file#line`` (as torch does).

    Raises:
        RuntimeError: :func:`configure` was not called.
        ValueError: ``after`` is not a positive number.
    """
    if _client is None:
        raise RuntimeError("call aioelastic.timer.configure() before expires()")
    if isinstance(after, bool) or not isinstance(after, (int, float)) or not after > 0:
        raise ValueError(f"after must be a positive number of seconds, got {after!r}")
    client = _client
    if scope is None:
        # 0: this generator, 1: contextmanager's __enter__, 2: the with statement.
        caller = sys._getframe(2)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
    client.send(scope, time.time() + after, client.signal)
    try:
        yield
    finally:
        client.send(scope, -1, 0)
