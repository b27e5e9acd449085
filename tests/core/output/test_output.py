"""The output hub: lines and frames, fan-out, bounded buffers with gap counts, replay."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioelastic
from aioelastic import Std
from aioelastic._core.output._stream import HISTORY_BYTES, OutputHub, OutputItem, StreamOutput


def _lines(out: StreamOutput, count: int, start: int = 0) -> None:
    out.feed(b"".join(b"line %d\n" % i for i in range(start, start + count)))


async def _collect(stream: AsyncIterable[OutputItem]) -> list[OutputItem]:
    items = []
    with anyio.fail_after(5):
        async for item in stream:
            items.append(item)
    return items


def _shape(items: list[OutputItem]) -> list[tuple[int, str, bool]]:
    return [(i.local_rank, i.text, i.frame) for i in items]


@pytest.mark.asyncio
@pytest.mark.parametrize("chunking", [1, 2, 3, 7, 1000])
async def test_lines_and_frames_are_cut_the_same_however_the_bytes_arrive(chunking: int) -> None:
    hub = OutputHub()
    sub = hub.subscribe()
    out = StreamOutput(hub, 0, Std.ERR)
    data = b"start\n\r 10%|#\r 20%|##\r 30%|###\ndone\r\nend \xff\nlast frame\r"
    for i in range(0, len(data), chunking):
        out.feed(data[i : i + chunking])
    out.end()
    hub.close()
    assert _shape(await _collect(sub)) == [
        (0, "start", False),
        (0, " 10%|#", True),
        (0, " 20%|##", True),
        (0, " 30%|###", False),
        (0, "done", False),
        (0, "end \ufffd", False),
        (0, "last frame", True),
    ]


@pytest.mark.asyncio
async def test_every_subscriber_sees_every_item_in_order() -> None:
    hub = OutputHub()
    first, second = hub.subscribe(), hub.subscribe()
    out = StreamOutput(hub, 1, Std.OUT, rank=5, attempt=2)
    _lines(out, 100)
    out.end()
    hub.close()
    for stream in (first, second):
        items = await _collect(stream)
        assert [i.data for i in items] == [b"line %d" % i for i in range(100)]
        assert {(i.local_rank, i.stream, i.rank, i.attempt, i.missed) for i in items} == {
            (1, Std.OUT, 5, 2, 0)
        }


@pytest.mark.asyncio
async def test_a_slow_subscriber_gets_a_gap_count_and_the_newest_items() -> None:
    hub = OutputHub()
    slow = hub.subscribe(buffer=10)
    fast = hub.subscribe()
    out = StreamOutput(hub, 0, Std.OUT)
    _lines(out, 25)
    hub.close()
    items = await _collect(slow)
    # The 15 oldest were dropped; the first item kept says so.
    assert [i.data for i in items] == [b"line %d" % i for i in range(15, 25)]
    assert [i.missed for i in items] == [15] + [0] * 9
    assert len(await _collect(fast)) == 25


@pytest.mark.asyncio
async def test_publishing_never_waits_for_a_reader() -> None:
    """A subscriber that never reads costs the publisher a bounded buffer and a count.

    ``feed`` is synchronous: a wait in it would block the pump (and the event loop), and
    ``fail_after`` cannot interrupt it; the time is measured instead, after every chunk.
    The 100,000 lines take 0.2 to 1 s (a busy machine); the budget is 10 s, which a wait
    of a tenth of a millisecond for each line dropped exceeds.
    """
    hub = OutputHub()
    stalled = hub.subscribe(buffer=1000)  # not read until the end
    ample = hub.subscribe(buffer=100_000)
    out = StreamOutput(hub, 0, Std.OUT)
    budget = 10.0
    began = time.monotonic()
    for start in range(0, 100_000, 1000):
        _lines(out, 1000, start)
        took = time.monotonic() - began
        assert took < budget, f"{start + 1000} lines to a stalled subscriber took {took:.1f} s"
    out.end()
    hub.close()
    # The stalled one kept its buffer's worth, the newest, and is told how many it lost.
    items = await _collect(stalled)
    assert [i.data for i in items] == [b"line %d" % i for i in range(99_000, 100_000)]
    assert [i.missed for i in items] == [99_000] + [0] * 999
    # The other subscriber, with room for all, lost nothing for it.
    items = await _collect(ample)
    assert [i.data for i in items] == [b"line %d" % i for i in range(100_000)]
    assert not any(i.missed for i in items)


@pytest.mark.asyncio
async def test_late_subscriber_replays_across_ranks_in_time_order_or_starts_live() -> None:
    hub = OutputHub()
    ranks = [StreamOutput(hub, r, Std.OUT) for r in range(2)]
    for i in range(4):
        ranks[i % 2].feed(b"line %d\n" % i)
    replayed = hub.subscribe()
    live = hub.subscribe(replay=False)
    ranks[0].feed(b"line 4\n")
    for out in ranks:
        out.end()
    hub.close()
    assert [(i.local_rank, i.text) for i in await _collect(replayed)] == [
        (0, "line 0"),
        (1, "line 1"),
        (0, "line 2"),
        (1, "line 3"),
        (0, "line 4"),
    ]
    assert [i.text for i in await _collect(live)] == ["line 4"]


@pytest.mark.asyncio
async def test_replay_past_the_history_bound_says_how_much_is_missing() -> None:
    hub = OutputHub()
    out = StreamOutput(hub, 0, Std.OUT)
    line = b"x" * 1023 + b"\n"
    total = 2 * HISTORY_BYTES // len(line)
    for _ in range(total):
        out.feed(line)
    items = hub.subscribe()._items
    assert sum(i.missed for i in items) + len(items) == total
    assert items[0].missed > 0


@pytest.mark.asyncio
async def test_a_held_partial_line_joins_replay_and_live_without_a_seam() -> None:
    hub = OutputHub()
    out = StreamOutput(hub, 0, Std.OUT)
    out.feed(b"first\nsec")
    sub = hub.subscribe()  # the first subscriber: cutting starts mid-line
    out.feed(b"ond\nthi")
    later = hub.subscribe()
    out.feed(b"rd\n")
    out.end()
    hub.close()
    assert [i.text for i in await _collect(sub)] == ["first", "second", "third"]
    assert [i.text for i in await _collect(later)] == ["first", "second", "third"]


@pytest.mark.asyncio
async def test_new_attempt_starts_replay_at_its_streams() -> None:
    hub = OutputHub()
    old = StreamOutput(hub, 0, Std.OUT, attempt=0)
    _lines(old, 3)
    old.end()
    hub.new_attempt()
    new = StreamOutput(hub, 0, Std.OUT, rank=4, attempt=1)
    new.feed(b"attempt 1\n")
    new.end()
    hub.close()
    items = await _collect(hub.subscribe())
    assert [(i.text, i.rank, i.attempt, i.missed) for i in items] == [("attempt 1", 4, 1, 0)]


@pytest.mark.asyncio
async def test_reader_waiting_wakes_on_output_and_ends_on_close() -> None:
    hub = OutputHub()
    out = StreamOutput(hub, 0, Std.OUT)
    stream = hub.subscribe()
    got: list[bytes] = []

    async def read() -> None:
        async for item in stream:
            got.append(item.data)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            out.feed(b"hello\n")
            await anyio.wait_all_tasks_blocked()
            assert got == [b"hello"]
            hub.close()
    assert got == [b"hello"]


@pytest.mark.asyncio
async def test_aclose_unsubscribes_and_stops_cutting() -> None:
    hub = OutputHub()
    out = StreamOutput(hub, 0, Std.OUT)
    async with hub.subscribe() as stream:
        _lines(out, 2)
    assert out._partial is None  # nobody listens: nothing is cut into items
    _lines(out, 2, start=2)
    assert await _collect(stream) == []
    # The history still has everything for the next subscriber.
    assert [i.text for i in hub.subscribe()._items] == [f"line {i}" for i in range(4)]


@pytest.mark.asyncio
async def test_subscribing_after_close_replays_then_ends() -> None:
    hub = OutputHub()
    out = StreamOutput(hub, 0, Std.OUT)
    out.feed(b"a\nb")
    out.end()
    hub.close()
    assert [i.text for i in await _collect(hub.subscribe())] == ["a", "b"]
    assert await _collect(hub.subscribe(replay=False)) == []


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10"])
def test_bad_buffer_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="buffer must be a positive number of items"):
        OutputHub().subscribe(buffer=bad)  # type: ignore[arg-type]


# -- with real workers --------------------------------------------------------------------

_WRITER = """
import os, sys
rank, count = sys.argv[1], int(sys.argv[2])
for i in range(count):
    sys.stdout.write(f"{rank} line {i}\\n")
    if i % 50 == 0:
        sys.stderr.write(f"\\r{rank} {i}/{count}")
        sys.stderr.flush()
sys.stderr.write("\\n")
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and rank == "1":
    sys.exit(3)
"""


def _writers(nprocs: int, count: int) -> dict[str, Any]:
    return {
        "entrypoint": sys.executable,
        "args": {r: ("-c", _WRITER, str(r), str(count)) for r in range(nprocs)},
        "envs": {r: {} for r in range(nprocs)},
    }


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_subscriber_sees_every_line_and_frame_the_log_files_hold(tmp_path: Path) -> None:
    count = 2000
    ctx = aioelastic.start_processes(
        "out", **_writers(3, count), log_dir=tmp_path, redirects=Std.ALL
    )
    stream = ctx.output()  # before the start: nothing can be missed
    async with ctx:
        items = [item async for item in stream]
        result = await ctx.wait()
    assert result is not None
    assert not result.is_failed()
    for rank in range(3):
        lines = [i.text for i in items if i.local_rank == rank and i.stream is Std.OUT]
        assert lines == (tmp_path / str(rank) / "stdout.log").read_text().splitlines()
        assert lines == [f"{rank} line {i}" for i in range(count)]
        frames = [i.text for i in items if i.local_rank == rank and i.frame]
        assert frames == [f"{rank} {i}/{count}" for i in range(0, count - 50, 50)]
    assert all(i.missed == 0 for i in items)
    for stream in (Std.OUT, Std.ERR):
        times = [i.time for i in items if (i.local_rank, i.stream) == (0, stream)]
        assert times == sorted(times)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_slow_subscriber_gets_gap_counts_and_never_slows_the_workers(
    tmp_path: Path,
) -> None:
    count = 3000
    async with aioelastic.start_processes(
        "slow", **_writers(2, count), log_dir=tmp_path, redirects=Std.OUT
    ) as ctx:
        slow = ctx.output(buffer=10)
        fast = ctx.output(replay=False)
        # Nobody reads `slow` until the workers are done: they finish all the same.
        with anyio.fail_after(30):
            result = await ctx.wait()
        assert result is not None
        assert not result.is_failed()
    slow_items = [item async for item in slow]
    fast_items = [item async for item in fast]
    assert len(slow_items) == 10
    # Every item is either delivered or counted as missed (the replayed ones included).
    # Per rank: its stdout lines, and its progress frames, the last of which ends as a line.
    total = 2 * (count + len(range(0, count, 50)))
    assert sum(i.missed for i in slow_items) + len(slow_items) == total
    assert sum(i.missed for i in fast_items) + len(fast_items) <= total
    for rank in range(2):
        log = (tmp_path / str(rank) / "stdout.log").read_text().splitlines()
        assert log == [f"{rank} line {i}" for i in range(count)]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_output_works_without_redirect_or_tee_and_after_the_run(tmp_path: Path) -> None:
    ctx = aioelastic.start_processes("plain", **_writers(1, 10))  # to the console only
    async with ctx:
        await ctx.wait()
    late = [i async for i in ctx.output()]
    assert [i.text for i in late if not i.frame and i.stream is Std.OUT] == [
        f"0 line {i}" for i in range(10)
    ]


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_the_agent_timeline_spans_attempts_with_ranks_and_events(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    from aioelastic import GroupRestarting, LocalElasticAgent, WorkerFailed, WorkerSpec

    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=sys.executable,
        args=("-c", _WRITER, "${local_rank}", "20"),
        max_restarts=1,
        master_port=aioelastic.free_port(),
    )
    agent = LocalElasticAgent(spec, log_dir=tmp_path / "logs")
    timeline = agent.timeline()
    output = agent.output()
    result = await agent.run()
    assert not result.is_failed()
    items = [item async for item in timeline]
    kinds = [type(i).__name__ for i in items if not isinstance(i, aioelastic.OutputItem)]
    assert "WorkerFailed" in kinds
    assert kinds.index("WorkerFailed") < kinds.index("GroupRestarting")
    lines = [i for i in items if isinstance(i, aioelastic.OutputItem) and not i.frame]
    # Rank 1 fails at the end of attempt 0 (rank 0 may be stopped before it finished).
    for attempt, rank in ((0, 1), (1, 0), (1, 1)):
        mine = [i.text for i in lines if (i.attempt, i.rank, i.stream) == (attempt, rank, Std.OUT)]
        assert mine == [f"{rank} line {i}" for i in range(20)]
    # The restart is between the attempts' output in the one timeline.
    restart = next(n for n, i in enumerate(items) if isinstance(i, GroupRestarting))
    assert all(i.attempt == 0 for i in items[:restart] if isinstance(i, aioelastic.OutputItem))
    assert any(isinstance(i, WorkerFailed) for i in items[:restart])
    assert {i.attempt for i in [x async for x in output]} == {0, 1}
