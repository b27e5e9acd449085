"""Identical console lines of several ranks printed once (``aioelastic/_core/_collapse.py``).

The stage is driven here by a fake clock and a console that records what it is given and
when, so that interleavings, delays and the ends of streams can be chosen at will. Real
workers follow in test_collapse_workers.py (``start_processes`` and ``aioelastic-run``
over pipes; at a terminal in test_terminal_workers.py, through ``start_processes`` in
test_logs.py) and test_collapse_block_buffered.py (writers whose 8 KiB flushes end
mid-line).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import re
from collections.abc import Callable

import pytest

from aioelastic._core.output import _collapse
from aioelastic._core.output._collapse import Collapser, Lane, rank_ranges

pytestmark = pytest.mark.timeout(120)

WINDOW = 1.0
COLLAPSED = re.compile(rb"\[ranks ([0-9,-]+)\]: ")
PREFIXED = re.compile(rb"\[w(\d+)\]:")


class FakeTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Time that moves only when told; timers run as it passes them."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, FakeTimer, Callable[[], None]]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None], /) -> FakeTimer:
        timer = FakeTimer()
        heapq.heappush(self._timers, (when, next(self._order), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer, callback = heapq.heappop(self._timers)
            if not timer.cancelled:
                self.now = max(self.now, when)
                callback()
        self.now = end

    def pending(self) -> int:
        return sum(not timer.cancelled for _, _, timer, _ in self._timers)


class FakeConsole:
    """Records each block put, with the time it was put."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.blocks: list[tuple[float, bytes]] = []

    def put(self, data: bytes) -> None:
        assert data
        self.blocks.append((self.clock.now, data))

    def room(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
        return None

    def end(self) -> None:
        pass

    @property
    def text(self) -> bytes:
        return b"".join(data for _, data in self.blocks)

    def take(self) -> bytes:
        text = self.text
        self.blocks.clear()
        return text


class Stage:
    """A collapser of ``nprocs`` ranks prefixed ``[w{rank}]:``, on a fake clock."""

    def __init__(self, nprocs: int, window: float = WINDOW, prefix: bytes = b"[w%d]:") -> None:
        self.clock = FakeClock()
        self.console = FakeConsole(self.clock)
        self.collapser = Collapser(self.console, window, self.clock)
        self.lanes = [
            self.collapser.lane(rank, prefix % rank if b"%" in prefix else prefix)
            for rank in range(nprocs)
        ]


def stage(nprocs: int, window: float = WINDOW) -> tuple[FakeClock, FakeConsole, list[Lane]]:
    made = Stage(nprocs, window)
    return made.clock, made.console, made.lanes


def test_rank_ranges_are_what_ranks_filter_reads() -> None:
    assert rank_ranges(range(8)) == "0-7"
    assert rank_ranges([7, 0, 2, 5, 6]) == "0,2,5-7"
    assert rank_ranges([3]) == "3"
    assert rank_ranges([4, 5]) == "4,5"
    assert rank_ranges([0, 1, 2, 9, 10, 11, 12, 20]) == "0-2,9-12,20"


def test_a_line_every_rank_writes_is_printed_once_as_soon_as_all_wrote_it() -> None:
    clock, console, lanes = stage(8)
    for lane in lanes:
        assert console.text == b""
        lane.put(lane.prefix + b"UserWarning: careful\n")
    # Every rank that could still write one is in it: no need to wait for the window.
    assert console.take() == b"[ranks 0-7]: UserWarning: careful\n"
    assert clock.pending() == 0


def test_a_line_of_one_rank_is_printed_as_written_when_its_window_ends() -> None:
    clock, console, lanes = stage(4)
    lanes[2].put(b"[w2]:only mine\n")
    clock.advance(WINDOW * 0.99)
    assert console.text == b""
    clock.advance(WINDOW * 0.02)
    assert console.blocks == [(WINDOW, b"[w2]:only mine\n")]


def test_the_ranks_that_wrote_it_within_the_window_share_one_line() -> None:
    clock, console, lanes = stage(8)
    for rank in (5, 0, 7, 2, 6):
        lanes[rank].put(b"[w%d]:warn\n" % rank)
        clock.advance(0.1)
    clock.advance(WINDOW - 0.5)  # the first one's window ended
    assert console.take() == b"[ranks 0,2,5-7]: warn\n"
    lanes[1].put(b"[w1]:warn\n")  # too late: a group of its own
    clock.advance(WINDOW)
    assert console.take() == b"[w1]:warn\n"


def test_a_line_that_follows_each_ranks_own_lines_still_collapses() -> None:
    clock, console, lanes = stage(4)
    for lane in lanes:
        lane.put(
            b"%sstep of rank %d\n%ssaving checkpoint\n" % (lane.prefix, lane.label, lane.prefix)
        )
        clock.advance(0.2)
    clock.advance(WINDOW)
    assert console.take() == (
        b"[w0]:step of rank 0\n[w1]:step of rank 1\n[w2]:step of rank 2\n"
        b"[w3]:step of rank 3\n[ranks 0-3]: saving checkpoint\n"
    )


def test_a_held_line_holds_its_ranks_later_lines_and_frames_behind_it() -> None:
    _, console, lanes = stage(2)
    lanes[0].put(b"[w0]:warn\n[w0]:bar 1\r")
    lanes[0].put(b"[w0]:bar 2\r")
    assert console.text == b""
    # Nothing of rank 1 waits: its frames pass at once, and so does the line that ends
    # its bar (drawn over the last frame, it is part of the bar).
    lanes[1].put(b"[w1]:bar 1\r[w1]:bar done\n")
    assert console.take() == b"[w1]:bar 1\r[w1]:bar done\n"
    lanes[1].put(b"[w1]:warn\n")
    assert console.take() == b"[ranks 0,1]: warn\n[w0]:bar 1\r[w0]:bar 2\r"


def test_frames_and_the_newline_that_ends_a_bar_never_collapse() -> None:
    made = Stage(2, prefix=b"")
    console, lanes = made.console, made.lanes
    # Unprefixed ranks (neither tee'd nor redirected) collapse too: a bar's frames and
    # the bare newline that ends it do not, nor a CRLF line.
    for lane in lanes:
        lane.put(b"50%\r")
        lane.put(b"\n")
        lane.put(b"dos\r\n")
        lane.put(b"done\n")
    assert console.take() == b"50%\r\ndos\r\n50%\r\ndos\r\n[ranks 0,1]: done\n"


def test_a_line_longer_than_max_line_is_passed_on_as_it_is() -> None:
    _, console, lanes = stage(2)
    long = b"x" * (_collapse.MAX_LINE + 1) + b"\n"
    lanes[0].put(b"[w0]:" + long)
    lanes[1].put(b"[w1]:" + long)
    assert console.take() == b"[w0]:" + long + b"[w1]:" + long


def test_ranks_writing_in_opposite_orders_do_not_block_each_other_for_long() -> None:
    clock, console, lanes = stage(3)
    lanes[0].put(b"[w0]:a\n[w0]:b\n")
    lanes[1].put(b"[w1]:b\n[w1]:a\n")
    # Each group waits for a line of the other's. One window after their own ended, the
    # lines at the front of their queues go and the others go on alone: then the other
    # group is free.
    clock.advance(2 * WINDOW * 0.99)
    assert console.text == b""
    clock.advance(2 * WINDOW * 0.01)
    assert console.take() == b"[w0]:a\n[ranks 0,1]: b\n[w1]:a\n"


def test_a_rank_whose_stream_ended_is_not_waited_for() -> None:
    clock, console, lanes = stage(4)
    lanes[2].end()
    lanes[3].put(b"[w3]:bye\n")
    lanes[3].end()
    lanes[0].put(b"[w0]:warn\n")
    assert console.text == b""
    lanes[1].put(b"[w1]:warn\n")
    assert console.take() == b"[ranks 0,1]: warn\n"
    # Rank 3's line: nobody is left who could write it too.
    lanes[0].end()
    lanes[1].end()
    assert console.take() == b"[w3]:bye\n"
    assert clock.pending() == 0


def test_flush_prints_everything_at_once_collapsing_what_order_allows() -> None:
    made = Stage(3)
    for lane in made.lanes:
        p = lane.prefix
        lane.put(b"%sown %d\n%scommon\n" % (p, lane.label, p))
    made.lanes[0].put(b"[w0]:a\n[w0]:b\n")
    made.lanes[1].put(b"[w1]:b\n[w1]:a\n")
    made.collapser.flush()  # the group's teardown, long before any window ended
    shown = made.console.take()
    assert made.clock.now == 0
    assert shown == (
        b"[w0]:own 0\n[w1]:own 1\n[w2]:own 2\n[ranks 0-2]: common\n"
        # The two groups that block each other: the oldest line goes first.
        b"[w0]:a\n[ranks 0,1]: b\n[w1]:a\n"
    )
    assert made.clock.pending() == 0


def test_at_most_held_lines_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_collapse, "HELD_LINES", 100)
    clock, console, lanes = stage(2)
    lanes[0].put(b"".join(b"[w0]:line %d\n" % i for i in range(1000)))
    # The oldest went at once, in order: 100 wait.
    shown = console.take().splitlines()
    assert shown == [b"[w0]:line %d" % i for i in range(900)]
    clock.advance(WINDOW)
    assert console.take().splitlines() == [b"[w0]:line %d" % i for i in range(900, 1000)]


# -- any interleaving: nothing lost, doubled or reordered, nothing held too long ----------


def _script(rng: random.Random, rank: int) -> list[bytes]:
    """What one rank writes: shared lines (often the same across ranks), lines of its
    own, repeated lines, progress frames; as the framer hands them on, prefixed."""
    prefix = b"[w%d]:" % rank
    shared = [b"shared %d" % i for i in range(6)] + [b"", b"warning: x"]
    pieces = []
    for i in range(rng.randrange(0, 40)):
        kind = rng.random()
        if kind < 0.5:
            text = rng.choice(shared)
        elif kind < 0.8:
            text = b"rank %d own %d" % (rank, i)
        elif kind < 0.9:
            pieces.append(prefix + b"bar %d%%\r" % rng.randrange(100))
            continue
        else:
            text = b"again"
        pieces.append(prefix + text + b"\n")
    return pieces


def _by_rank(blocks: list[tuple[float, bytes]]) -> dict[int, list[tuple[float, bytes]]]:
    """Each rank's pieces as the console shows them (a collapsed line is each rank's)."""
    shown: dict[int, list[tuple[float, bytes]]] = {}
    for when, data in blocks:
        for piece in re.findall(rb"[^\r\n]*(?:\r|\n)", data):
            match = COLLAPSED.match(piece)
            if match:
                text = piece[match.end() :]
                ranks = _ranks(match[1].decode())
                assert len(ranks) > 1, piece
                for rank in ranks:
                    shown.setdefault(rank, []).append((when, b"[w%d]:" % rank + text))
                continue
            match = PREFIXED.match(piece)
            assert match, piece
            shown.setdefault(int(match[1]), []).append((when, piece))
    return shown


def _ranks(text: str) -> list[int]:
    ranks: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ranks += range(int(first), int(last or first) + 1)
    return ranks


@pytest.mark.parametrize("seed", range(60))
def test_any_interleaving_keeps_every_ranks_lines_once_and_in_order(seed: int) -> None:
    rng = random.Random(seed)
    nprocs = rng.randrange(2, 9)
    made = Stage(nprocs)
    scripts = {rank: _script(rng, rank) for rank in range(nprocs)}
    todo = {rank: list(pieces) for rank, pieces in scripts.items()}
    arrived: dict[int, list[float]] = {rank: [] for rank in range(nprocs)}
    ended: set[int] = set()
    teardown = rng.random() < 0.3
    while any(todo.values()) or len(ended) < nprocs:
        rank = rng.randrange(nprocs)
        if todo[rank]:
            # Several pieces in one put, as a pump hands on what one read held.
            count = min(len(todo[rank]), rng.choice([1, 1, 2, 5]))
            chunk, todo[rank] = todo[rank][:count], todo[rank][count:]
            made.lanes[rank].put(b"".join(chunk))
            arrived[rank] += [made.clock.now] * count
        elif rank not in ended and rng.random() < 0.3:
            made.lanes[rank].end()
            ended.add(rank)
        made.clock.advance(rng.choice([0, 0, 0.01, 0.1, 0.3, 0.9, 1.5]) * WINDOW)
        if teardown and rng.random() < 0.02:
            made.collapser.flush()
            break
    made.collapser.flush() if teardown else made.clock.advance(2 * WINDOW)
    assert made.collapser._held_lines == 0
    assert made.clock.pending() == 0
    shown = _by_rank(made.console.blocks)
    for rank in range(nprocs):
        written = scripts[rank][: len(arrived[rank])]
        assert [piece for _, piece in shown.get(rank, [])] == written, f"seed {seed} rank {rank}"
        for (when, _), at in zip(shown.get(rank, []), arrived[rank], strict=True):
            assert when - at <= 2 * WINDOW + 1e-9, f"seed {seed}: held {when - at:g} s"


def test_collapsing_happens_in_random_interleavings_of_the_same_lines() -> None:
    # The check above cannot fail for want of collapsing; this one can.
    rng = random.Random(7)
    made = Stage(8)
    order = [rank for rank in range(8) for _ in range(5)]
    rng.shuffle(order)
    written = dict.fromkeys(range(8), 0)
    for rank in order:
        made.lanes[rank].put(b"[w%d]:line %d\n" % (rank, written[rank]))
        written[rank] += 1
        made.clock.advance(rng.random() * 0.05)
    made.clock.advance(2 * WINDOW)
    assert made.console.text == b"".join(b"[ranks 0-7]: line %d\n" % i for i in range(5))
