"""The supervisor side of stacks on demand: one FIFO per worker, read when asked.

:class:`StackChannel` owns the FIFO a worker's faulthandler writes to (see
:mod:`..child._stack_hook`). :meth:`StackChannel.capture` signals the worker and collects what it
writes. faulthandler marks no end of a dump, but it writes the whole dump from inside one
signal handler without ever blocking (the FIFO is non-blocking on its side), so the dump
is complete once the pipe has stayed quiet for :data:`SETTLE` seconds after the first
byte and no thread of the worker still runs the handler or has the signal pending (on a
loaded machine a worker can be descheduled halfway through its dump). Every capture is
bounded by its timeout: a worker that never answers (not Python, handler replaced, already
gone) costs at most that, and never delays a teardown beyond it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path

import anyio

from ..child._stack_hook import STACK_SIGNAL, STACKS_FIFO_ENV
from ..process._platform import proc_stat
from ._fifo import OwnedFifo

#: Quiet time after which a started dump is taken as complete.
SETTLE = 0.1
#: Default bound of one capture.
DEFAULT_TIMEOUT = 5.0
#: A dump larger than this is cut (a process with thousands of threads).
MAX_DUMP = 4 * 1024 * 1024


class StackChannel:
    """The FIFO through which one worker answers stack requests.

    Args:
        path: where to create the FIFO (its directory must exist).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fifo = OwnedFifo(path)
        self._lock = anyio.Lock()

    def open(self) -> None:
        """Create the FIFO and open it; call before the worker starts."""
        self._fifo.open()

    @property
    def fd(self) -> int | None:
        """The supervisor's descriptor of the FIFO (``None`` before open or after close)."""
        return self._fifo.fd

    def env(self) -> dict[str, str]:
        """The environment entries that tell the worker's bootstrap where to write."""
        return {STACKS_FIFO_ENV: str(self.path)}

    async def capture(self, pid: int, timeout: float = DEFAULT_TIMEOUT) -> str | None:
        """Ask process ``pid`` for the stacks of all its threads.

        Returns the dump, or ``None`` when nothing came within ``timeout`` seconds or the
        process no longer exists.
        """
        fd = self._fifo.fd
        if fd is None:
            return None
        async with self._lock:
            self._discard()
            try:
                os.kill(pid, STACK_SIGNAL)
            except ProcessLookupError:
                return None
            data = bytearray()
            with anyio.move_on_after(timeout):
                await anyio.wait_readable(fd)
                while len(data) < MAX_DUMP:
                    data += self._fifo.drain()
                    with anyio.move_on_after(SETTLE) as quiet:
                        await anyio.wait_readable(fd)
                    if quiet.cancelled_caught and not _still_dumping(pid):
                        break
            data += self._fifo.drain()
        return _without_hook_frames(data.decode(errors="replace")) if data else None

    def _discard(self) -> None:
        # A late answer to an earlier, timed-out request must not open this one's dump.
        self._fifo.drain()

    def close(self) -> None:
        """Close and remove the FIFO; idempotent."""
        self._fifo.close()


class StackChannels:
    """The stack FIFOs of a group of workers, in a private temporary directory."""

    def __init__(self, ranks: Collection[int]) -> None:
        self._ranks = ranks
        self._dir: Path | None = None
        self.channels: dict[int, StackChannel] = {}

    def open(self) -> None:
        """Create the directory and one FIFO per rank (nothing without ranks)."""
        if not self._ranks:
            return
        self._dir = Path(tempfile.mkdtemp(prefix="aioelastic_stacks_"))
        with contextlib.ExitStack() as cleanup_on_fail:
            cleanup_on_fail.callback(self.close)
            for rank in self._ranks:
                channel = StackChannel(self._dir / f"{rank}.fifo")
                channel.open()
                self.channels[rank] = channel
            cleanup_on_fail.pop_all()

    async def capture(
        self, pids: Mapping[int, int], timeout: float = DEFAULT_TIMEOUT
    ) -> dict[int, str]:
        """Stacks of every given ``{rank: pid}`` at once, within ``timeout`` in all.

        A rank that did not answer maps to a line that says so.
        """
        found: dict[int, str] = {}

        async def one(rank: int, pid: int) -> None:
            channel = self.channels.get(rank)
            text = None if channel is None else await channel.capture(pid, timeout)
            found[rank] = text if text is not None else no_stack(pid, timeout)

        async with anyio.create_task_group() as tg:
            for rank, pid in pids.items():
                tg.start_soon(one, rank, pid)
        return dict(sorted(found.items()))

    def fds(self) -> list[int]:
        """The open FIFO descriptors."""
        return [c.fd for c in self.channels.values() if c.fd is not None]

    def close(self) -> None:
        """Close every FIFO and remove the directory; idempotent."""
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _still_dumping(pid: int) -> bool:
    """Whether a thread of ``pid`` runs the dump handler or has the signal pending.

    faulthandler installs its handler without ``SA_NODEFER``, so the signal is in the
    blocked mask of the thread running it, and in a pending set until delivered.
    """
    bit = 1 << (STACK_SIGNAL - 1)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("SigPnd", "ShdPnd", "SigBlk") and int(value, 16) & bit:
                        return True
        except (OSError, ValueError):
            continue
    return False


def _without_hook_frames(dump: str) -> str:
    """Drop the frames of :mod:`..child._stack_hook` and of its callers (runpy) from a dump.

    faulthandler lists frames most recent first, so in each thread's block the hook's
    frame and everything after it are the wrapper around the user's script, not the
    user's code.
    """
    marker = os.sep + os.path.join("child", "_stack_hook.py")
    kept: list[str] = []
    skipping = False
    for line in dump.splitlines(keepends=True):
        if not line.startswith("  "):
            skipping = False  # a new thread's header, or the blank line between threads
        elif marker in line:
            skipping = True
        if not skipping:
            kept.append(line)
    return "".join(kept)


def no_stack(pid: int, timeout: float) -> str:
    """What is shown for a worker that gave no stack (a stopped one said to be stopped)."""
    stat = proc_stat(pid, 1)
    if stat is not None and stat[0] in (b"T", b"t"):
        return (
            f"(no Python stack: pid {pid} is stopped (SIGSTOP, or a debugger holds it) and did "
            f"not answer {STACK_SIGNAL.name} within {timeout:g}s)\n"
        )
    return (
        f"(no Python stack: pid {pid} did not answer {STACK_SIGNAL.name} within {timeout:g}s; "
        "it is not a Python process started by aioelastic, it replaced the handler, or it "
        "exited)\n"
    )


async def py_spy_dump(pid: int, timeout: float) -> str | None:
    """Every thread's stack of ``pid`` by ``py-spy dump``, where it is installed.

    The fallback for a worker that has no stack hook (a Python binary started without
    it): py-spy reads the stacks from outside through ptrace, so it needs no cooperation
    from the worker, but it needs ptrace rights (often refused in containers) and is an
    optional install. ``None`` when it is missing, refused or too slow.
    """
    tool = shutil.which("py-spy")
    if tool is None:
        return None
    with anyio.move_on_after(timeout):
        try:
            done = await anyio.run_process([tool, "dump", "--pid", str(pid)], check=False)
        except OSError:
            return None
        if done.returncode == 0 and done.stdout:
            return done.stdout.decode("utf-8", "replace")[:MAX_DUMP]
    return None
