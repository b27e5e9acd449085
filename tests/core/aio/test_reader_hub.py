"""The loop's hub of worker descriptors: add_reader's semantics at an epoll_ctl's cost."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import aioelastic
from aioelastic._core.aio import _reader_hub
from aioelastic._core.aio._reader_hub import ReaderHub, hold_reader_hub, reader_hub

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


async def _a_dispatch_later(hub: ReaderHub) -> None:
    """Return once the hub served a descriptor made ready after this call.

    Every descriptor ready before it was then in the same or an earlier wake-up: a reader
    not called by now never is for what was ready.
    """
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    served = anyio.Event()
    hub.add(r, served.set)
    try:
        os.write(w, b"x")
        with anyio.fail_after(5):
            await served.wait()
    finally:
        hub.remove(r)
        os.close(r)
        os.close(w)


async def test_calls_back_while_readable_and_stops_at_remove() -> None:
    loop = asyncio.get_running_loop()
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    got: list[bytes] = []
    seen = anyio.Event()

    def on_readable() -> None:
        got.append(os.read(r, 100))
        seen.set()

    hub = reader_hub(loop)
    hub.add(r, on_readable)
    try:
        os.write(w, b"one")
        with anyio.fail_after(5):
            await seen.wait()
        assert got == [b"one"]
        # A reader of its own keeps the hub open once this one is removed.
        keep_r, keep_w = os.pipe2(os.O_CLOEXEC)
        hub.add(keep_r, lambda: None)
        assert hub.remove(r) is True
        assert hub.remove(r) is False
        os.write(w, b"two")
        # A wake-up with the pipe readable: a removed reader is never called.
        await _a_dispatch_later(hub)
        assert got == [b"one"]
        hub.remove(keep_r)
        os.close(keep_r)
        os.close(keep_w)
    finally:
        hub.remove(r)
        os.close(r)
        os.close(w)


async def test_end_of_file_counts_as_readable() -> None:
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    ended = anyio.Event()

    def on_readable() -> None:
        if os.read(r, 100) == b"":
            hub.remove(r)
            ended.set()

    hub = reader_hub(asyncio.get_running_loop())
    hub.add(r, on_readable)
    os.close(w)
    try:
        with anyio.fail_after(5):
            await ended.wait()
    finally:
        hub.remove(r)
        os.close(r)


async def test_the_last_remove_closes_the_hub_and_its_epoll() -> None:
    loop = asyncio.get_running_loop()
    before = _open_fds()
    r1, w1 = os.pipe2(os.O_CLOEXEC)
    r2, w2 = os.pipe2(os.O_CLOEXEC)
    hub = reader_hub(loop)
    hub.add(r1, lambda: None)
    hub.add(r2, lambda: None)
    assert reader_hub(loop) is hub
    hub.remove(r1)
    assert not hub.closed
    hub.remove(r2)
    assert hub.closed
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    # Nothing of the hub outlives its last descriptor: no epoll left open.
    assert _open_fds() == before
    fresh = reader_hub(loop)
    assert fresh is not hub
    fresh.close()
    assert loop not in _reader_hub._hubs


async def test_a_held_hub_outlives_its_last_descriptor_until_released() -> None:
    loop = asyncio.get_running_loop()
    before = _open_fds()
    release = hold_reader_hub(loop)
    hub = reader_hub(loop)
    r, w = os.pipe2(os.O_CLOEXEC)
    hub.add(r, lambda: None)
    hub.remove(r)
    os.close(r)
    os.close(w)
    assert not hub.closed
    assert reader_hub(loop) is hub
    second = hold_reader_hub(loop)
    release()
    release()  # a second call of the same release counts for nothing
    assert not hub.closed
    second()
    assert hub.closed
    assert loop not in _reader_hub._hubs
    assert _open_fds() == before


async def test_a_group_holds_its_loops_hub_from_its_start_to_its_end(tmp_path: Path) -> None:
    # Workers that exit as they start leave the hub without a descriptor between starts;
    # the group's hold keeps it (one epoll per group, not one per worker).
    loop = asyncio.get_running_loop()
    assert loop not in _reader_hub._hubs
    group = aioelastic.start_processes(
        "hold", "true", {r: () for r in range(4)}, {r: {} for r in range(4)}, log_dir=tmp_path
    )
    async with group:
        hub = _reader_hub._hubs[loop]
        result = await group.wait(timeout=20)
        assert result is not None
        assert not result.is_failed()
        assert _reader_hub._hubs.get(loop) is hub
        assert not hub.closed
    assert hub.closed
    assert loop not in _reader_hub._hubs


async def test_a_descriptor_has_one_reader() -> None:
    r, w = os.pipe2(os.O_CLOEXEC)
    hub = reader_hub(asyncio.get_running_loop())
    hub.add(r, lambda: None)
    try:
        with pytest.raises(RuntimeError, match=f"fd {r} has a reader already"):
            hub.add(r, lambda: None)
    finally:
        hub.remove(r)
        os.close(r)
        os.close(w)


async def test_a_failing_reader_goes_to_the_loops_handler_and_the_others_still_run() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    bad_r, bad_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    good_r, good_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    good = anyio.Event()

    def bad() -> None:
        os.read(bad_r, 100)
        raise ValueError("planted")

    def fine() -> None:
        os.read(good_r, 100)
        good.set()

    hub = reader_hub(loop)
    hub.add(bad_r, bad)
    hub.add(good_r, fine)
    try:
        os.write(bad_w, b"x")
        os.write(good_w, b"x")
        with anyio.fail_after(5):
            await good.wait()
            while not reported:
                await asyncio.sleep(0)
        assert isinstance(reported[0]["exception"], ValueError)
        assert f"the reader of fd {bad_r} failed" in str(reported[0]["message"])
    finally:
        loop.set_exception_handler(None)
        hub.remove(bad_r)
        hub.remove(good_r)
        for fd in (bad_r, bad_w, good_r, good_w):
            os.close(fd)


async def test_a_reader_that_removes_another_ready_one_spares_it_the_call() -> None:
    """Two descriptors ready in one wake-up; the first reader removes the second."""
    r1, w1 = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    r2, w2 = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    calls: list[int] = []
    done = anyio.Event()
    hub = reader_hub(asyncio.get_running_loop())

    def reader(mine: int, other: int) -> Callable[[], None]:
        def on_readable() -> None:
            calls.append(mine)
            os.read(mine, 100)
            hub.remove(other)
            hub.remove(mine)
            done.set()

        return on_readable

    hub.add(r1, reader(r1, r2))
    hub.add(r2, reader(r2, r1))
    os.write(w1, b"x")
    os.write(w2, b"x")
    try:
        with anyio.fail_after(5):
            await done.wait()
        await _a_dispatch_later(reader_hub(asyncio.get_running_loop()))
        assert len(calls) == 1
    finally:
        hub.remove(r1)
        hub.remove(r2)
        for fd in (r1, w1, r2, w2):
            os.close(fd)
