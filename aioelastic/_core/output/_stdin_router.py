"""What is typed at the supervisor's terminal goes to the worker that reads its stdin.

At a terminal (the supervisor's stdin is one, and the supervisor is its foreground job)
every worker's stdin is a pseudo-terminal (:mod:`._terminal`), and one
:class:`StdinRouter` per group decides where typed input goes:

* A group of one worker owns the keyboard outright: what is typed is copied into its
  terminal as it comes, so typing ahead works, as with a program run on its own.
* In a group of several, a typed line goes only to a worker that is *reading* its stdin
  at that moment (``input()``, ``breakpoint()``, pdb, ``torch.distributed.breakpoint``),
  which :func:`~._tty_readers.reads_terminal` tells from ``/proc``. A line typed while
  none reads waits in the terminal, unread, until one does.

The rule for several readers (docs/cli.md): the keyboard belongs to one worker at a time.
A worker that reads when none owns it gets it: the first seen reading, the lowest local
rank among those seen at once. It keeps it while it reads, between two commands too; the
next reader gets it once the owner exited or has not read for :data:`OWNER_GRACE` seconds
(it went on, as after pdb's ``c``). Each change is shown on the console (``[aioelastic]
stdin: typing goes to rank 1``), and the owner's prompt is shown at once, on its line, as a
single worker's is.

Why ``/proc`` is looked at on events and a few timers rather than watched: the kernel
sends no event when a process starts to read a terminal. The look is made when a worker
leaves a partial line (a prompt) on its output, a few times in the next fraction of a
second (its read follows the prompt's write), then on a backoff timer while that prompt
stands unanswered (a loaded machine may run the read seconds later), when a line is
typed, when a worker's output ends (it exited), and — only while a typed line waits for a
reader — on a backoff timer. When
``/proc`` cannot tell (no ptrace access, an unknown machine), a worker whose output ends
with a prompt counts as reading.

Ctrl-C and Ctrl-Z never pass through here: the real terminal turns them into signals for
the supervisor's process group, as before. Ctrl-D (an empty read) is passed on as the
worker terminal's end-of-file character.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import math
import os
import select
from collections import deque
from dataclasses import dataclass, field

import anyio

from ..aio._lazy_event import wait_all
from ..process._platform import proc_stat
from ..process._runtime import runtime
from ._console import console
from ._frames import Live
from ._logs import StreamPump
from ._tty_readers import reads_terminal

#: End-of-file typed at the start of a line (VEOF), as the worker's pty expects it.
_EOF = b"\x04"
#: Seconds an owner that stopped reading keeps the keyboard before the next reader gets it.
OWNER_GRACE = 0.5
#: After a prompt, when to look again (seconds after it) for the read that follows it.
_PROMPT_LOOKS = (0.002, 0.01, 0.03, 0.06, 0.1, 0.2, 0.35)
#: A prompt still unread after those looks (a loaded machine can run the read that follows
#: it much later): the first and the longest wait between further looks, while it stands.
_STANDING_PROMPT_LOOKS = (0.5, 2.0)
#: The most of a prompt kept to show it again.
_PROMPT_MAX = 256
#: While a typed line waits for a reader: the first and the longest wait between looks.
_WAITING_LINE_LOOKS = (0.01, 0.5)


@dataclass(eq=False)
class StdinTarget:
    """One worker's stdin terminal, as the router sees it.

    Attributes:
        local_rank: The worker's local rank (the lowest wins a tie).
        label: How the console names it (``rank 1 (local rank 1)``).
        pid: The worker, whose threads and descendants are looked at.
        master: The supervisor's copy of the terminal's master side: typed bytes are
            written there. Owned by :meth:`StdinRouter.attach`, which closes it.
        device: The terminal's ``st_rdev``, to recognise a read of it.
        streams: The worker's stdout and stderr pumps, where its prompts show (pdb's on
            stdout, ``input()``'s on stderr at a terminal, as CPython writes it), shown
            at once while the worker owns the keyboard and reads.
        drain: Nothing else reads the master (stdin has a terminal of its own): what the
            worker writes to its stdin is read and dropped here.
    """

    local_rank: int
    label: str
    pid: int
    master: int
    device: int
    streams: tuple[StreamPump, ...] = ()
    drain: bool = False
    #: When the router saw it reading, first since it last saw it not reading.
    asking_since: float | None = None
    #: When it was last seen reading or last given a line.
    active_at: float = -math.inf
    #: The partial line its output ends with (a prompt), the last bytes of it; ``b""``
    #: after a newline. Also what counts as asking when /proc cannot tell.
    prompt_text: bytes = b""
    #: The stream that prompt is on.
    prompt_stream: StreamPump | None = None
    #: A line was given to it since its last output (the terminal echoed a newline).
    typed_since_output: bool = False
    #: When to look at it again after a prompt (loop times).
    looks: deque[float] = field(default_factory=deque)
    #: Wakes the router for the first of those looks.
    look_timer: asyncio.TimerHandle | None = None
    #: The wait before the next look at a prompt that outlived those looks; 0 before.
    standing_wait: float = 0.0

    def drop_looks(self) -> None:
        """Forget the looks planned after a prompt."""
        self.looks.clear()
        if self.look_timer is not None:
            self.look_timer.cancel()
            self.look_timer = None


class StdinRouter:
    """Routes the supervisor's typed input to the workers of one group.

    Args:
        alone: The group has one worker: it owns the keyboard whether it reads or not.

    One router reads the terminal at a time in a process: a second group running beside
    the first leaves its workers' input unfed rather than race for the lines.
    """

    def __init__(self, *, alone: bool) -> None:
        self._alone = alone
        self._targets: list[StdinTarget] = []
        self._owner: StdinTarget | None = None
        self._owner_before: StdinTarget | None = None
        #: When to look at every worker again (a decision put off), in loop time.
        self._look_all_at: float | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        owner = self._owner.label if self._owner is not None else None
        return f"<StdinRouter workers={len(self._targets)} alone={self._alone} owner={owner!r}>"

    async def attach(self, target: StdinTarget) -> None:
        """Route input to ``target`` until cancelled; then close its master copy."""
        loop = asyncio.get_running_loop()
        os.set_blocking(target.master, False)
        if target.drain:
            loop.add_reader(target.master, _drain, loop, target.master)
        for pump in target.streams:
            pump.on_chunk = functools.partial(self._output, target, pump)
        self._targets.append(target)
        self._poke()
        try:
            if target.streams:
                await wait_all(pump.closed for pump in target.streams)
                self._output_ended(target)
            await anyio.sleep_forever()
        finally:
            target.drop_looks()
            self._targets.remove(target)
            for pump in target.streams:
                pump.on_chunk = None
            if self._owner is target:
                self._owner = None
                self._show_prompt(target, False)
            if target.drain:
                loop.remove_reader(target.master)
            # Wakes a write waiting for room in it (a worker that stopped reading).
            anyio.notify_closing(target.master)
            os.close(target.master)
            self._poke()

    async def run(self) -> None:
        """Read the supervisor's terminal and route what is typed, until cancelled.

        Returns at once when another router of this process reads the terminal, and as
        soon as the supervisor is not the terminal's foreground job: reading it then
        would stop the supervisor (SIGTTIN), and what is typed belongs to another job.
        """
        if runtime.stdin_forwarded:
            return
        runtime.stdin_forwarded = True
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        try:
            if self._alone:
                await self._forward()
            else:
                await self._route()
        finally:
            runtime.stdin_forwarded = False
            if self._owner is not None:
                self._show_prompt(self._owner, False)

    # -- a group of one ---------------------------------------------------------------

    async def _forward(self) -> None:
        """Copy what is typed into the one worker's terminal as it comes, line by line."""
        while not self._targets:
            await self._wait(stdin=False, timeout=None)
        target = self._targets[0]
        while target in self._targets:
            await self._wait(stdin=True, timeout=None)
            if not in_foreground():
                return
            if _typed() and not await self._pass_on(target):
                return

    # -- a group of several -----------------------------------------------------------

    async def _route(self) -> None:
        assert self._loop is not None
        line_wait: float | None = None
        while True:
            now = self._loop.time()
            typed = bool(self._targets) and _typed()
            if typed and not in_foreground():
                return
            owner = self._choose(now, look_at_all=typed)
            if typed and owner is not None and owner.asking_since is not None:
                if not await self._pass_on(owner):
                    return
                # It read this line; whether it reads again (pdb's next prompt) or went
                # on (pdb's "c") is seen by a fresh look, at its prompt or after the grace.
                owner.asking_since = None
                owner.active_at = now = self._loop.time()
                self._look_all_at = now + OWNER_GRACE
                line_wait = None
                continue
            timeouts = [t.looks[0] - now for t in self._targets if t.looks]
            if self._look_all_at is not None:
                timeouts.append(self._look_all_at - now)
            if typed:
                # A line waits and nobody reads it: look again later (see the docstring).
                line_wait = _next_wait(line_wait, _WAITING_LINE_LOOKS)
                timeouts.append(line_wait)
            timeout = max(min(timeouts), 0.0) if timeouts else None
            # stdin is watched only while it has nothing waiting and a worker to go to:
            # a line typed before any worker was attached would wake us at once, forever.
            await self._wait(stdin=bool(self._targets) and not typed, timeout=timeout)

    def _choose(self, now: float, *, look_at_all: bool) -> StdinTarget | None:
        """Look at the workers that are due, then decide who owns the keyboard.

        Every worker is looked at when a line is typed and when a decision was put off
        (:data:`OWNER_GRACE`); otherwise only those with a look due after a prompt. The
        others keep what was last seen of them.
        """
        if self._look_all_at is not None and now >= self._look_all_at:
            self._look_all_at = None
            look_at_all = True
        for target in self._targets:
            due = bool(target.looks) and target.looks[0] <= now
            while target.looks and target.looks[0] <= now:
                target.looks.popleft()
            if look_at_all or due:
                self._look(target, now)
            if due and not target.looks and _prompt_stands(target):
                target.standing_wait = _next_wait(target.standing_wait, _STANDING_PROMPT_LOOKS)
                target.looks.append(now + target.standing_wait)
        readers = [t for t in self._targets if t.asking_since is not None]
        owner = self._owner
        if owner is not None and owner.asking_since is None and readers:
            # The owner is not reading now, another is. It keeps the keyboard for a
            # moment (a line typed during its command is not given away), unless it is
            # gone or has not read for that long (it went on, as after pdb's "c").
            if _alive(owner.pid) and now < owner.active_at + OWNER_GRACE:
                self._look_all_at = owner.active_at + OWNER_GRACE
            else:
                owner = None
        if owner is None and readers:
            owner = min(readers, key=lambda t: (t.asking_since, t.local_rank))
        if owner is not self._owner:
            if self._owner is not None:
                self._show_prompt(self._owner, False)
            self._owner_before, self._owner = self._owner, owner
            if owner is not None:
                self._announce(owner)
        if owner is not None:
            self._show_prompt(owner, owner.asking_since is not None)
        return owner

    def _look(self, target: StdinTarget, now: float) -> None:
        reading = reads_terminal(target.pid, target.device)
        if reading is None:
            reading = bool(target.prompt_text) and _alive(target.pid)
        if not reading:
            target.asking_since = None
            return
        # What it wrote before it read comes first: its prompt may still be in the pipe,
        # and the note that may follow goes before the prompt, not before that output.
        for pump in target.streams:
            pump.catch_up()
        target.drop_looks()  # found reading: no need to look again
        target.active_at = now
        if target.asking_since is None:
            target.asking_since = now

    def _announce(self, owner: StdinTarget) -> None:
        """Say on the console which worker what is typed goes to, before its prompt."""
        before = self._owner_before
        # The note starts a line: after the previous owner's prompt, unless the Enter
        # typed to it since (echoed by the terminal) moved to the next line already.
        fresh = (
            before is not None
            and any(pump.raw_text_shown() for pump in before.streams)
            and not before.typed_since_output
        )
        note = f"[aioelastic] stdin: typing goes to {owner.label}\n".encode()
        if fresh:
            note = b"\n" + note
        # On the console of the stream its prompt is on, so that the note comes first
        # (stdout and stderr are written by a thread each). A prompt printed as a line
        # of its own already (the flush delay passed while the worker waited its turn)
        # is shown again under the note, so that what is typed follows it.
        stream = owner.prompt_stream
        if stream is None or not stream.put_note(note, owner.prompt_text):
            console("stdout").put(note)

    # -- events -----------------------------------------------------------------------

    def _output(self, target: StdinTarget, pump: StreamPump, chunk: bytes) -> None:
        """A chunk of the target's output (a pump's callback): a prompt makes us look."""
        end = chunk.rfind(b"\n")
        if end >= 0 or pump is not target.prompt_stream:
            tail = chunk[end + 1 :]
        else:
            tail = target.prompt_text + chunk
        target.prompt_text = tail[-_PROMPT_MAX:]
        target.prompt_stream = pump
        target.typed_since_output = False
        # A progress bar's frame (a \r in the partial line) is no prompt: looking at the
        # workers' threads at every frame would cost more than the bar. Nor is a line
        # whose end comes later (``python -u`` writes a print's newline on its own): the
        # looks it scheduled are dropped.
        if not _is_prompt(tail):
            target.drop_looks()
            return
        if self._alone or self._loop is None or target.looks:
            return
        # A timer, not a wake-up of the router now: most partial chunks are completed
        # by the next one within microseconds, which cancels it.
        now = self._loop.time()
        target.standing_wait = 0.0
        target.looks.extend(now + delay for delay in _PROMPT_LOOKS)
        target.look_timer = self._loop.call_at(target.looks[0], self._poke)

    def _output_ended(self, target: StdinTarget) -> None:
        """The worker's output ended: it exited (with every descendant that shared it).

        Its exit sends the router no event of its own, and an owner found reading is not
        looked at again until something happens: without this, the keyboard would stay
        with a dead owner, and the next reader's prompt unshown, until a line is typed.
        Every worker is looked at now (this one reads nothing any more).
        """
        target.drop_looks()
        if self._loop is not None:
            self._look_all_at = self._loop.time()
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _wait(self, *, stdin: bool, timeout: float | None) -> None:
        """Until poked, a line is typed (``stdin``) or ``timeout`` passes."""
        assert self._wake is not None
        assert self._loop is not None
        wake = self._wake
        if stdin:
            self._loop.add_reader(0, wake.set)
        try:
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                await wake.wait()
        finally:
            if stdin:
                self._loop.remove_reader(0)
            wake.clear()

    async def _pass_on(self, target: StdinTarget) -> bool:
        """Read one typed line (or Ctrl-D) and write it to ``target``; False: stop reading."""
        try:
            data = os.read(0, 4096)
        except OSError as exc:
            return exc.errno in (errno.EAGAIN, errno.EINTR)
        await _write_all(target.master, data or _EOF)
        if data.endswith(b"\n"):
            target.typed_since_output = True
            for pump in target.streams:
                pump.typed_line_echoed()
        return True

    def _show_prompt(self, target: StdinTarget, owner: bool) -> None:
        if not self._alone:
            for pump in target.streams:
                pump.set_live(Live.EVERYTHING if owner else Live.FRAMES)


def in_foreground() -> bool:
    """Whether this process is the foreground job of the terminal on its stdin."""
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _typed() -> bool:
    """Whether a typed line (or Ctrl-D) waits on our stdin, without reading it."""
    try:
        return bool(select.select([0], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def _prompt_stands(target: StdinTarget) -> bool:
    """Whether ``target``'s output still ends with a prompt nobody answered, unread."""
    return (
        target.asking_since is None
        and _is_prompt(target.prompt_text)
        and not target.typed_since_output
        and _alive(target.pid)
    )


def _is_prompt(tail: bytes) -> bool:
    """Whether the partial line an output ends with may be a prompt (not a ``\r`` frame)."""
    return bool(tail) and b"\r" not in tail


def _next_wait(previous: float | None, bounds: tuple[float, float]) -> float:
    """The next wait of a doubling backoff within ``bounds`` (first, longest)."""
    first, longest = bounds
    return first if not previous else min(2 * previous, longest)


def _alive(pid: int) -> bool:
    stat = proc_stat(pid, 1)
    return stat is not None and stat[0] not in (b"Z", b"X")


def _drain(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Drop what a worker wrote to a stdin terminal of its own (nothing shows it)."""
    try:
        if os.read(fd, 65536):
            return
    except BlockingIOError:
        return
    except OSError:
        pass  # EIO: the worker and its children closed the terminal
    loop.remove_reader(fd)


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            try:
                await anyio.wait_writable(fd)
            except anyio.ClosedResourceError:
                return  # the worker's record ended (see attach)
        except OSError:
            return  # the worker is gone
