"""Identical console lines of several ranks, printed once: ``[ranks 0-7]: text``.

Every rank of a job runs the same code, so a warning that one rank prints, all of them
print: 64 copies at 64 ranks. With ``collapse_identical_lines`` set, a group's console
lines pass through a :class:`Collapser` per console stream (stdout, stderr) on their way
to the :class:`~._console.ConsoleStream`. A line joins, when it arrives, the group of
lines with the same text (without the rank prefix) that other ranks wrote less than the
window before; a group is printed once its window has passed (or every rank that could
still join it has), as ``[ranks 0,2,5-7]: text`` with the rank numbers the prefix shows.
A line no other rank wrote within the window is printed exactly as without collapsing,
with its own prefix.

The rules this keeps, and how:

* **A rank's lines keep their order.** Each rank has a :class:`Lane`, the queue of what
  it wrote and is not printed yet. A group is printed only when each of its lines is at
  the front of its rank's queue, and printing pops them from there. So a held line holds
  its rank's later lines (and frames) behind it, and a collapsed line never overtakes an
  earlier line of any of its ranks. Lines join groups on arrival, not once at the front:
  the line every rank prints after a line of its own (``rank 3: loss=...``, then
  ``saving checkpoint``) still collapses, while the ranks' own lines wait out their
  window.
* **Nothing lost, nothing doubled.** Every queued item leaves its queue exactly once,
  collapsed or alone.
* **Nothing held forever, bounded memory.** A group whose window has passed waits for
  its ranks' earlier lines for one more window at most; then the lines of it at the
  front of their queues are printed, and the others go on alone. So a line is printed at
  the latest two windows after it arrived. :meth:`Collapser.flush` prints everything
  (the group's teardown), and at most :data:`HELD_LINES` lines (:data:`HELD_BYTES` bytes)
  are held: beyond that the oldest are printed at once.
* **Only plain lines collapse.** What holds a ``\\r`` (a progress frame, the bare ``\\n``
  that ends a bar, a ``\\r\\n`` ending) and lines longer than :data:`MAX_LINE` are passed
  on as they are, in their rank's order, never collapsed.

The log files and ``output()`` subscribers are fed before this stage (:mod:`._logs`), so
they get every line of every rank unchanged. One collapser serves the ranks of one group
(one node): with several nodes, each node collapses its own ranks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from ._console import ConsoleSink

__all__ = ["HELD_BYTES", "HELD_LINES", "MAX_LINE", "Clock", "Collapser", "Lane", "rank_ranges"]

#: The most lines held, over all ranks of a stream; beyond, the oldest are printed at once.
HELD_LINES = 10_000
#: The most bytes held, likewise.
HELD_BYTES = 4 * 1024 * 1024
#: A longer line is passed on as it is rather than held for its twins.
MAX_LINE = 16 * 1024
#: Groups of one text open at once: a rank that writes a line again while its first copy
#: still waits starts a second group, which the other ranks' second copies join. Beyond
#: this many, a copy goes alone (a rank printing blank lines in a burst, say).
GENERATIONS = 4

# What a timer entry of a group stands for: its window ends; its last wait ends.
_DUE, _LAST = 0, 1


class TimerHandle(Protocol):
    """A scheduled call (``asyncio.TimerHandle``)."""

    def cancel(self) -> None:
        """Do not call it."""


class Clock(Protocol):
    """The time and timers the collapser runs on: the event loop's, or a test's."""

    def time(self) -> float:
        """Now, in the clock's seconds."""

    def call_at(self, when: float, callback: Callable[[], None], /) -> TimerHandle:
        """Call ``callback`` at ``when`` (or soon after)."""


class _Held:
    """One item of a rank's queue: a line (without its prefix), or bytes passed as is."""

    __slots__ = ("at", "data", "group", "lane")

    def __init__(self, lane: Lane, data: bytes, at: float) -> None:
        self.lane = lane
        self.data = data
        #: When it arrived: its window counts from here.
        self.at = at
        #: The group of a line; None for bytes passed as is (a frame, say).
        self.group: _Group | None = None


class _Group:
    """Lines of several ranks with the same text, printed together."""

    __slots__ = ("blocked", "due", "late", "lines", "open", "ranks", "text")

    def __init__(self, text: bytes, due: float, *, late: bool = False) -> None:
        self.text = text
        #: When its window ends: its first line's arrival + the window.
        self.due = due
        self.lines: list[_Held] = []
        self.ranks: set[Lane] = set()
        #: How many of its lines wait behind earlier lines of their rank.
        self.blocked = 0
        #: Its window ended: nothing joins any more, it is printed once nothing blocks it.
        self.late = late
        #: False once printed.
        self.open = True


class Lane:
    """One rank's stream into a :class:`Collapser`; what its log pump writes to.

    Made by :meth:`Collapser.lane`; a :class:`~._console.ConsoleSink`.
    """

    __slots__ = ("_stage", "after_frame", "ended", "held", "label", "prefix")

    def __init__(self, stage: Collapser, label: int, prefix: bytes) -> None:
        self._stage = stage
        #: The rank number a collapsed line shows for this rank.
        self.label = label
        #: What the pump puts before each of this rank's lines.
        self.prefix = prefix
        #: What this rank wrote that is not printed yet, oldest first.
        self.held: deque[_Held] = deque()
        #: The last piece put ended in ``\r``: the next one ends a frame's line.
        self.after_frame = False
        #: The stream ended (nothing more will be put).
        self.ended = False

    def put(self, data: bytes) -> None:
        """Take the pump's next console blocks (whole lines and frames, prefixed)."""
        if data:
            self._stage._put(self, data)

    def room(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
        """The console's back-pressure (see :meth:`~._console.ConsoleStream.room`)."""
        return self._stage.console.room(loop)

    def end(self) -> None:
        """The stream ended; what it wrote is still printed by the rules (idempotent)."""
        self._stage._end(self)

    def __repr__(self) -> str:
        return f"<Lane rank={self.label} held={len(self.held)}{' ended' if self.ended else ''}>"


class Collapser:
    """Holds the console lines of a group's ranks for one stream, collapsing identical ones.

    Args:
        console: Where the lines go (the process's stdout or stderr writer).
        window: Seconds a line waits for the same line from other ranks.
        clock: The time and timers; the running event loop's when ``None``.
    """

    def __init__(self, console: ConsoleSink, window: float, clock: Clock | None = None) -> None:
        self.console = console
        self.window = window
        self._clock = clock
        self._lanes: list[Lane] = []
        #: The groups of each text still within their window, oldest first.
        self._joinable: dict[bytes, list[_Group]] = {}
        #: ``(when, order, what, group)``: the window ends (``_DUE``) and last waits
        #: (``_LAST``) to come. An entry is stale once its group was printed.
        self._timeline: list[tuple[float, int, int, _Group]] = []
        self._order = itertools.count()
        #: Groups that may be printed now (nothing blocks them, their time came).
        self._ready: deque[_Group] = deque()
        #: Lanes that may still write a line (whose stream has not ended).
        self._writing: set[Lane] = set()
        self._held_lines = 0
        self._held_bytes = 0
        self._timer: TimerHandle | None = None
        self._timer_at = math.inf

    def __repr__(self) -> str:
        return (
            f"<Collapser window={self.window:g}s lanes={len(self._lanes)} "
            f"held={self._held_lines} writing={len(self._writing)}>"
        )

    def lane(self, label: int, prefix: bytes) -> Lane:
        """A new rank's lane: ``label`` is its number in collapsed lines, ``prefix`` its own."""
        lane = Lane(self, label, prefix)
        self._lanes.append(lane)
        self._writing.add(lane)
        return lane

    def flush(self) -> None:
        """Print everything held now (the group's teardown); the lanes stay usable.

        Lines still collapse as far as order allows: every group is taken as if its
        window had passed, so a group waits only for its ranks' earlier lines.
        """
        for group in self._held_groups():
            group.late = True
            self._unindex(group)
            self._check(group)
        out: list[bytes] = []
        while True:
            while self._ready:
                group = self._ready.popleft()
                if group.open:
                    self._print(group, out)
            if not self._held_lines:
                break
            self._print_oldest(out)  # groups block each other: break the circle
        self._settle(self._now(), out)

    def _held_groups(self) -> list[_Group]:
        """Every group a held line is in."""
        return list(dict.fromkeys(i.group for lane in self._lanes for i in lane.held if i.group))

    # -- taking lines -----------------------------------------------------------------

    def _now(self) -> float:
        if self._clock is None:
            self._clock = asyncio.get_running_loop()
        return self._clock.time()

    def _put(self, lane: Lane, data: bytes) -> None:
        now = self._now()
        out: list[bytes] = []
        for piece in _pieces(data):
            text = self._text(lane, piece)
            if text is None and not lane.held:
                out.append(piece)  # nothing of this rank waits: passes at once
                continue
            item = _Held(lane, piece if text is None else text, now)
            if text is not None:
                self._join(item, first=not lane.held)
            lane.held.append(item)
            self._held_lines += 1
            self._held_bytes += len(item.data)
        self._settle(now, out)

    def _text(self, lane: Lane, piece: bytes) -> bytes | None:
        """The line of ``piece`` without its prefix, or None if it must not collapse."""
        after_frame, lane.after_frame = lane.after_frame, piece[-1:] == b"\r"
        prefix = lane.prefix
        if (
            after_frame
            or b"\r" in piece
            or piece[-1:] != b"\n"
            or len(piece) > MAX_LINE
            or not piece.startswith(prefix)
        ):
            return None
        return piece[len(prefix) :]

    def _join(self, item: _Held, *, first: bool) -> None:
        """Put a new line in the oldest joinable group of its text without its rank."""
        lane, text = item.lane, item.data
        groups = self._joinable.setdefault(text, [])
        group = next((g for g in groups if lane not in g.ranks), None)
        if group is None:
            group = _Group(text, item.at + self.window)
            if len(groups) < GENERATIONS:
                groups.append(group)
            heapq.heappush(self._timeline, (group.due, next(self._order), _DUE, group))
        group.lines.append(item)
        group.ranks.add(lane)
        item.group = group
        if not first:
            group.blocked += 1
        self._check(group)

    def _end(self, lane: Lane) -> None:
        if lane.ended:
            return
        lane.ended = True
        self._writing.discard(lane)
        # One rank fewer that could join: groups may be complete now. Rare (a stream's
        # end), so a look at every group is fine.
        for group in self._held_groups():
            self._check(group)
        self._settle(self._now(), [])

    def _check(self, group: _Group) -> None:
        """Make ``group`` ready if nothing blocks it and it need not wait any more.

        It need not once its window has passed, or when nobody who could still join it
        is missing: every rank still writing is in it.
        """
        if not group.open or group.blocked:
            return
        writing = self._writing
        if group.late or (len(group.ranks) >= len(writing) and writing <= group.ranks):
            self._ready.append(group)

    # -- printing ---------------------------------------------------------------------

    def _settle(self, now: float, out: list[bytes]) -> None:
        """Print what may be printed by ``now``, then set the timer for what is next."""
        while True:
            while self._ready:
                group = self._ready.popleft()
                if group.open:
                    self._print(group, out)
            timeline = self._timeline
            if timeline and timeline[0][0] <= now:
                _, _, what, group = heapq.heappop(timeline)
                if group.open:
                    self._time_came(group, what)
                continue
            if self._held_lines > HELD_LINES or self._held_bytes > HELD_BYTES:
                self._print_oldest(out)
                continue
            break
        if out:
            self.console.put(b"".join(out))
        self._rearm()

    def _time_came(self, group: _Group, what: int) -> None:
        if what == _DUE:
            group.late = True
            self._unindex(group)
            if group.blocked and len(group.lines) > 1:
                # Its lines wait behind earlier lines of their ranks, which are due
                # within a window: wait that long at most (see _last_wait).
                when = group.due + self.window
                heapq.heappush(self._timeline, (when, next(self._order), _LAST, group))
            self._check(group)
        else:
            self._last_wait(group)

    def _unindex(self, group: _Group) -> None:
        """Nothing joins ``group`` any more."""
        groups = self._joinable.get(group.text)
        if groups is not None and group in groups:
            groups.remove(group)
            if not groups:
                del self._joinable[group.text]

    def _last_wait(self, group: _Group) -> None:
        """Print the lines of ``group`` at the front of their queues; the others go alone.

        Groups can block each other (rank 0 wrote ``a`` then ``b``, rank 1 ``b`` then
        ``a``), and a rank can be slow to print its earlier lines; this ends the wait.
        """
        self._unindex(group)
        front = [item for item in group.lines if item.lane.held[0] is item]
        for item in group.lines:
            if item.lane.held[0] is not item:
                alone = _Group(group.text, group.due, late=True)
                alone.lines.append(item)
                alone.ranks.add(item.lane)
                alone.blocked = 1
                item.group = alone
        group.lines = front
        group.ranks = {item.lane for item in front}
        group.blocked = 0
        if front:
            self._ready.append(group)
        else:
            group.open = False

    def _print_oldest(self, out: list[bytes]) -> None:
        """Print now the group of the oldest line at the front of a queue.

        With it go the group's lines at the front of theirs; the others go on alone.
        """
        oldest = min((lane.held[0] for lane in self._lanes if lane.held), key=lambda i: i.at)
        group = oldest.group
        assert group is not None  # bytes passed as is never wait at the front
        self._last_wait(group)
        self._ready.remove(group)
        self._print(group, out)

    def _print(self, group: _Group, out: list[bytes]) -> None:
        group.open = False
        self._unindex(group)
        lines = group.lines
        if len(lines) == 1:
            out.append(lines[0].lane.prefix + group.text)
        else:
            ranks = rank_ranges(item.lane.label for item in lines)
            out.append(b"[ranks " + ranks.encode() + b"]: " + group.text)
        for item in lines:
            lane = item.lane
            assert lane.held[0] is item
            self._release(lane.held.popleft())
            self._advance(lane, out)
        # The timeline keeps a printed group until its time: not its lines.
        group.lines = []
        group.ranks = set()

    def _advance(self, lane: Lane, out: list[bytes]) -> None:
        """The front of ``lane`` was printed: pass on what follows as is, unblock a line."""
        held = lane.held
        while held:
            head = held[0]
            if head.group is None:
                out.append(head.data)
                self._release(held.popleft())
                continue
            head.group.blocked -= 1
            self._check(head.group)
            return

    def _release(self, item: _Held) -> None:
        self._held_lines -= 1
        self._held_bytes -= len(item.data)

    def _rearm(self) -> None:
        """One timer, at the next time something comes (none while nothing is held)."""
        timeline = self._timeline
        while timeline and not timeline[0][3].open:
            heapq.heappop(timeline)
        when = timeline[0][0] if timeline else math.inf
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = when
        if when != math.inf:
            assert self._clock is not None
            self._timer = self._clock.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        # asyncio may call a timer up to its clock's resolution early: what it was set
        # for has come all the same (else it would be set again, for the same time).
        fired_for = self._timer_at
        self._timer = None
        self._timer_at = math.inf
        self._settle(max(self._now(), fired_for), [])


def _pieces(data: bytes) -> Iterator[bytes]:
    """``data`` cut after each ``\\n`` (the last piece may end otherwise: a frame's ``\\r``)."""
    start, size = 0, len(data)
    while start < size:
        end = data.find(b"\n", start)
        end = size if end < 0 else end + 1
        yield data[start:end]
        start = end


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as ``0-7`` or ``0,2,5-7``: three or more consecutive ranks as a range.

    The form ``--ranks-filter`` reads, so a collapsed line's ranks can be pasted there.
    """
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(r) for r in ordered[i : j + 1])
        i = j + 1
    return ",".join(parts)
