"""aioelastic.spawn: torch.multiprocessing.spawn semantics on real processes."""

from __future__ import annotations

import pickle
import signal
import time
from pathlib import Path

import pytest

from aioelastic._compat._spawn import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
)
from tests.children import spawn as children
from tests.support.waits import make_fifo

pytestmark = pytest.mark.timeout(60)


@pytest.mark.asyncio
async def test_returns_values_by_index() -> None:
    assert await spawn(children.spawn_scaled, args=(10,), nprocs=3) == [0, 10, 20]


@pytest.mark.asyncio
async def test_a_raising_worker_gives_its_traceback_and_stops_the_others() -> None:
    with pytest.raises(ProcessRaisedException) as info:
        await spawn(children.spawn_raise_at, args=(1,), nprocs=3, grace_period=5)
    err = info.value
    assert err.error_index == 1
    assert err.pid == err.error_pid > 0
    text = str(err)
    assert "-- Process 1 terminated with the following error:" in text
    assert "Traceback (most recent call last):" in text
    assert "ValueError: worker 1 failed on purpose" in text
    assert "spawn_raise_at" in text  # the frame, not just the message
    assert isinstance(err, ProcessException)


@pytest.mark.asyncio
async def test_a_worker_that_exits_3() -> None:
    with pytest.raises(ProcessExitedException) as info:
        await spawn(children.spawn_exit_at, args=(0, 3), nprocs=2, grace_period=5)
    err = info.value
    assert (err.error_index, err.exit_code, err.signal_name) == (0, 3, None)
    assert str(err).startswith("process 0 terminated with exit code 3")


@pytest.mark.asyncio
async def test_a_worker_killed_by_sigkill() -> None:
    with pytest.raises(ProcessExitedException) as info:
        await spawn(children.spawn_sigkill_at, args=(1,), nprocs=2, grace_period=5)
    err = info.value
    assert err.error_index == 1
    assert err.exit_code == -signal.SIGKILL
    assert err.signal_name == "SIGKILL"
    assert str(err).startswith("process 1 terminated with signal SIGKILL")


@pytest.mark.asyncio
async def test_grace_period_is_honoured_for_a_sigterm_ignoring_sibling(tmp_path: Path) -> None:
    # torch's join would wait 30 s here whatever grace period was asked for.
    fifo = make_fifo(tmp_path, "fifo")
    started = time.monotonic()
    with pytest.raises(ProcessRaisedException) as info:
        await spawn(children.spawn_stubborn_sibling, args=(str(fifo),), nprocs=2, grace_period=1)
    elapsed = time.monotonic() - started
    assert info.value.error_index == 0
    assert "rank 0 fails once rank 1 ignores SIGTERM" in str(info.value)
    # Generous bound: start-up on a loaded 2-core machine plus the 1 s grace, far below 30.
    assert elapsed < 20


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fn": 42}, TypeError, "fn must be callable"),
        ({"args": 5}, TypeError, "args must be a tuple or list"),
        ({"args": "ab"}, TypeError, "args=\\(value,\\)"),
        ({"nprocs": 0}, ValueError, "nprocs"),
        ({"nprocs": True}, TypeError, "nprocs: True is a bool, not an integer"),
    ],
)
async def test_misuse_is_refused_before_anything_starts(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    call: dict[str, object] = {"fn": children.spawn_scaled, "args": (1,), "nprocs": 1, **kwargs}
    with pytest.raises(error, match=match):
        await spawn(**call)  # type: ignore[arg-type]


def test_exceptions_pickle_with_torch_shapes() -> None:
    raised = pickle.loads(pickle.dumps(ProcessRaisedException("tb", 2, 1234)))
    assert (raised.msg, raised.error_index, raised.error_pid, raised.pid) == ("tb", 2, 1234, 1234)
    exited = pickle.loads(pickle.dumps(ProcessExitedException("x", 1, 99, -9, "SIGKILL")))
    assert (exited.exit_code, exited.signal_name, exited.error_index) == (-9, "SIGKILL", 1)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.asyncio
async def test_torch_gloo_all_reduce_on_four_workers() -> None:
    pytest.importorskip("torch")
    from aioelastic._compat._launch import free_port

    world_size = 4
    values = await spawn(
        children.torch_spawn_all_reduce, args=(world_size, free_port()), nprocs=world_size
    )
    assert values == [float(sum(range(1, world_size + 1)))] * world_size


@pytest.mark.asyncio
async def test_a_function_spawn_cannot_pickle_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="cannot be pickled for start_method='spawn'"):
        await spawn(lambda i: i, nprocs=2)
