"""A start of a helper or a worker that fails part-way leaves nothing behind.

Each test makes one start fail at a chosen step; the autouse leak check
(``tests/conftest.py``) then fails it for any process, zombie or descriptor the failed
start's cleanup missed.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest

from aioelastic._core.process import _platform
from aioelastic._core.start import _forkserver, _launchers, _watchdog
from aioelastic._core.start._forkserver import INLINE_CALL_MAX, ForkServer


def test_a_watchdog_that_exits_at_start_is_reaped_and_its_exit_status_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "exits_at_start.py"
    script.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setattr(_watchdog, "_SCRIPT", str(script))
    dog = _watchdog.Watchdog()
    with pytest.raises(RuntimeError, match=r"^the watchdog process exited at start \(3\)$"):
        dog.ensure_started()
    assert not dog.running()
    assert dog.fileno() is None


def test_a_watchdog_that_cannot_be_created_leaves_no_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new_group = _platform.new_group_popen_kwargs

    def in_a_missing_directory() -> dict[str, Any]:
        return {**new_group(), "cwd": str(tmp_path / "missing")}

    monkeypatch.setattr(_platform, "new_group_popen_kwargs", in_a_missing_directory)
    dog = _watchdog.Watchdog()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(FileNotFoundError):
            dog.ensure_started()
        gc.collect()  # a socket left open is closed here, with a ResourceWarning
    assert [w.message for w in warned if w.category is ResourceWarning] == []
    assert dog.pid is None


def test_a_spawned_worker_whose_exit_cannot_be_watched_is_killed_and_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_pidfd(pid: int) -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(_launchers, "watch_child", no_pidfd)
    result_r, result_w = os.pipe2(os.O_CLOEXEC)
    try:
        with pytest.raises(OSError, match="Too many open files") as caught:
            _launchers.start_spawn(dict(os.environ), None, 2, result_w)
    finally:
        os.close(result_r)
        os.close(result_w)
    assert caught.value.errno == errno.EMFILE


@pytest.mark.asyncio
async def test_a_fork_server_that_cannot_be_created_leaves_no_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_process(*args: object) -> Any:
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    monkeypatch.setattr(_forkserver, "start_python", no_process)
    server = ForkServer(("tests.children.core",))
    with pytest.raises(OSError, match=os.strerror(errno.EAGAIN)) as caught:
        await server.warm_up()
    assert caught.value.errno == errno.EAGAIN
    assert server.pid is None


def test_a_request_to_a_replaced_fork_server_closes_every_pipe_it_made() -> None:
    # Found replaced once its status and payload pipes exist: none of them may stay open.
    server = ForkServer(("tests.children.core",))  # not started: any socket is stale
    stale, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with stale, other:
        large_call = b"x" * (INLINE_CALL_MAX + 1)  # sent through a payload pipe
        with pytest.raises(_forkserver._ServerGone, match="it was replaced"):
            server._send_request(stale, None, 2, 2, large_call, None, block=False)
