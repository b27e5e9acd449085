"""The server side of torch's file timer, as an async task woken by the pipe.

Workers arm and release countdown timers by writing one JSON line per request into a FIFO
(torch 2.13's ``FileTimerClient``, or :mod:`aioelastic.timer`)::

    {"version": 1, "pid": 123, "scope_id": "step", "expiration_time": 1.7e9, "signal": 9}

``expiration_time`` is wall-clock (``time.time()``) seconds; a negative one releases the
timer ``(pid, scope_id)``. torch's ``FileTimerServer`` reads this with a polling thread,
kills only the pid (never its children) and then SIGKILLs its own process, the agent. Here
the loop sleeps until the pipe is readable or the earliest timer is due, and an expiry is
handed to the supervisor (:class:`Expiry`), which captures the stack, stops that worker's
process group and reports it as that rank's failure.

The FIFO is a local, writable-by-the-owner file, but what comes through it is still
untrusted: a request for a pid that is not one of our workers, a malformed line, or a
flood of timers is ignored with a warning; nothing read from it can crash the server or
make it signal a process that is not ours.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from ._fifo import OwnedFifo

logger = logging.getLogger("aioelastic")

#: The environment variable torchrun reads to enable the file timer.
ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
#: The environment variable naming the FIFO (set for workers; may be preset by the user).
FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: A line longer than this is not a timer request (torch's client refuses > PIPE_BUF).
MAX_LINE = 16 * 1024
#: Armed timers kept at most; beyond it new ones are refused with a warning.
MAX_TIMERS = 100_000


@dataclass(frozen=True)
class Expiry:
    """A timer that expired: whose, which scope, how long it was armed for."""

    rank: int
    pid: int
    scope: str
    #: Seconds from the request's arrival to its expiration time.
    after: float
    #: The signal the client asked to be killed with (> 0).
    signal: int

    def reason(self) -> str:
        """The failure text: ``timer expired after 2s (scope 'step')``."""
        # To a tenth: the request reaches us a few ms after the worker computed its
        # deadline, and "after 0.981s" for expires(after=1) would only puzzle.
        return f"timer expired after {round(self.after, 1):g}s (scope {self.scope!r})"


@dataclass
class _Timer:
    rank: int
    expiration: float
    armed_at: float
    signal: int


class TimerServer:
    """Serve timer requests from the FIFO at ``path``.

    Args:
        path: the FIFO to create (an existing FIFO there is replaced; anything else is an
            error, never deleted).
        owner: maps a requesting pid to the local rank it belongs to, or ``None`` when
            the pid is not one of ours (its requests are then ignored).
    """

    def __init__(self, path: Path, owner: Callable[[int], int | None]) -> None:
        self.path = path
        self._owner = owner
        self._fifo = OwnedFifo(path)
        self._buffer = b""
        #: Inside an overlong line: everything up to its newline is dropped.
        self._discarding = False
        self._timers: dict[tuple[int, str], _Timer] = {}
        #: CLOCK_MONOTONIC time of the last valid request (a heartbeat for stall checks).
        self.last_request: float | None = None
        #: Expiries seen so far (for metrics).
        self.expired_count = 0
        self._changed = anyio.Event()

    def open(self) -> None:
        """Create the FIFO and open it for reading."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISFIFO(mode):
                raise ValueError(
                    f"{FILE_ENV}={str(self.path)!r} exists and is not a FIFO; point it at "
                    "a new path (aioelastic creates the FIFO) or remove that file"
                )
            os.unlink(self.path)
        self._fifo.open()

    @property
    def fd(self) -> int | None:
        """The server's descriptor of the FIFO (``None`` before open or after close)."""
        return self._fifo.fd

    def forget(self, pid: int) -> None:
        """Drop every timer of ``pid`` (call when that worker exits)."""
        for key in [k for k in self._timers if k[0] == pid]:
            del self._timers[key]

    def armed(self) -> dict[tuple[int, str], float]:
        """The armed timers: ``{(pid, scope): expiration_time}``."""
        return {key: timer.expiration for key, timer in self._timers.items()}

    async def changed(self) -> None:
        """Wait until the next valid request was applied."""
        await self._changed.wait()

    async def serve(self, on_expired: Callable[[Expiry], Coroutine[Any, Any, None]]) -> None:
        """Read requests and report expiries until cancelled.

        Each expiry's handler runs in its own task, so one slow handler (a stack capture)
        does not hold back the timers of other workers.
        """
        fd = self._fifo.fd
        if fd is None:
            raise RuntimeError("TimerServer.serve() needs open() first")
        async with anyio.create_task_group() as tg:
            while True:
                delay = self._until_next(time.time())
                with anyio.move_on_after(delay):
                    await anyio.wait_readable(fd)
                    self._take(self._fifo.drain())
                for expiry in self._pop_expired(time.time()):
                    self.expired_count += 1
                    tg.start_soon(on_expired, expiry)

    def _until_next(self, now: float) -> float:
        if not self._timers:
            return math.inf
        return max(0.0, min(t.expiration for t in self._timers.values()) - now)

    def _take(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if lines and self._discarding:
            lines.pop(0)  # the end of an overlong line already reported
            self._discarding = False
        if len(self._buffer) > MAX_LINE:
            self._drop_overlong()
            self._buffer = b""
            self._discarding = True
        for line in lines:
            if len(line) > MAX_LINE:
                self._drop_overlong()
            elif line.strip():
                self._apply(line)

    def _drop_overlong(self) -> None:
        logger.warning(
            "aioelastic: timer FIFO %s: dropped a line of more than %d bytes (not a timer request)",
            self.path,
            MAX_LINE,
        )

    def _apply(self, line: bytes) -> None:
        try:
            request = _parse(line)
        except ValueError as exc:
            logger.warning(
                "aioelastic: timer FIFO %s: ignored a malformed request %r: %s",
                self.path,
                line[:200],
                exc,
            )
            return
        pid, scope, expiration, sig = request
        rank = self._owner(pid)
        if rank is None:
            logger.warning(
                "aioelastic: timer FIFO %s: ignored a request from pid %d, which is not a "
                "worker of this group",
                self.path,
                pid,
            )
            return
        self.last_request = time.monotonic()
        self._changed.set()
        self._changed = anyio.Event()
        key = (pid, scope)
        if expiration < 0:
            self._timers.pop(key, None)
            return
        if key not in self._timers and len(self._timers) >= MAX_TIMERS:
            logger.warning(
                "aioelastic: timer FIFO %s: refused a timer of pid %d: %d timers are armed",
                self.path,
                pid,
                MAX_TIMERS,
            )
            return
        self._timers[key] = _Timer(rank, expiration, time.time(), sig)

    def _pop_expired(self, now: float) -> list[Expiry]:
        due = sorted(
            ((key, t) for key, t in self._timers.items() if t.expiration <= now),
            key=lambda item: item[1].expiration,
        )
        expiries = []
        reported: set[int] = set()
        for (pid, scope), timer in due:
            del self._timers[(pid, scope)]
            if timer.signal <= 0:
                # torch's contract: a timer without a signal is reported, never reaped.
                logger.warning(
                    "aioelastic: timer of pid %d (scope %r) expired; it asked for no "
                    "signal, so the worker is left running",
                    pid,
                    scope,
                )
                continue
            if pid in reported:
                continue  # one expiry per worker: its first-due timer is the cause
            reported.add(pid)
            after = timer.expiration - timer.armed_at
            expiries.append(Expiry(timer.rank, pid, scope, max(after, 0.0), timer.signal))
        for pid in reported:
            self.forget(pid)
        return expiries

    def close(self) -> None:
        """Close and remove the FIFO; idempotent."""
        self._fifo.close()


def _parse(line: bytes) -> tuple[int, str, float, int]:
    try:
        # Decoded first: json.loads would guess UTF-16/32 from the bytes.
        request: Any = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(request, dict):
        raise ValueError("not a JSON object")
    pid = request.get("pid")
    scope = request.get("scope_id")
    expiration = request.get("expiration_time")
    sig = request.get("signal", 0)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"'pid' must be a positive integer, got {pid!r}")
    if not isinstance(scope, str):
        raise ValueError(f"'scope_id' must be a string, got {scope!r}")
    if (
        not isinstance(expiration, (int, float))
        or isinstance(expiration, bool)
        or not math.isfinite(expiration)
    ):
        raise ValueError(f"'expiration_time' must be a finite number, got {expiration!r}")
    if not isinstance(sig, int) or isinstance(sig, bool) or sig > 64:
        raise ValueError(f"'signal' must be a signal number, got {sig!r}")
    return pid, scope, float(expiration), sig
