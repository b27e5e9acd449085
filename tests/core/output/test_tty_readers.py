"""Telling from ``/proc`` whether a process waits to read a terminal, for each way of reading.

Each child gets a pseudo-terminal as stdin and a pipe as stdout, prints ``ready`` and then
blocks: in a read of the terminal (in one of the calls a prompt ends in), or in something
else. A reader is waited for (its read follows ``ready``); a non-reader is checked once its
main thread sleeps in the very system call its code ends in (not in any sleep on the way
there, such as an import's), and is checked to be still in it after. Both waits look at
``/proc`` again and again, with a timeout: the kernel sends no event when a process starts
to read, which is why the module exists.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from aioelastic._core.output import _tty_readers
from aioelastic._core.output._tty_readers import reads_terminal, terminal_device
from tests.support.waits import process_state

pytestmark = pytest.mark.timeout(60)

READERS = {
    "read": "input()",
    "readline-select": "import readline; input()",
    "buffered-readline": "import sys; sys.stdin.readline()",
    "reopened-dev-stdin": "open('/dev/stdin').readline()",
    "select": "import select; select.select([0], [], [])",
    "poll": "import select; p = select.poll(); p.register(0, select.POLLIN); p.poll()",
    "epoll-event-loop": (
        "import asyncio\n"
        "async def main():\n"
        "    asyncio.get_running_loop().add_reader(0, print)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())"
    ),
    "pdb": "import pdb; pdb.set_trace()",
    "another-thread": (
        "import sys, threading\n"
        "t = threading.Thread(target=sys.stdin.readline)\n"
        "t.start(); t.join()"
    ),
    "a-child-shell": "import subprocess; subprocess.run(['sh', '-c', 'read line'])",
}

NOT_READERS = {
    "sleep": "import time; time.sleep(60)",
    # The terminal in the set, but not for reading (for hang-ups only; writing it would
    # not block at all).
    "poll-without-pollin": (
        "import select, os; r, w = os.pipe(); p = select.poll(); "
        "p.register(r, select.POLLIN); p.register(0, 0); p.poll(60000)"
    ),
    "idle-event-loop": (
        "import asyncio\nasync def main():\n    await asyncio.sleep(60)\nasyncio.run(main())"
    ),
}

#: The system calls each of NOT_READERS ends in, by machine: ``clock_nanosleep`` (Python
#: 3.11 and later; 3.10's ``time.sleep`` waits in ``select``, which glibc makes
#: ``pselect6``); ``poll`` or ``ppoll``; ``epoll_wait`` and kin.
NOT_READER_CALLS: dict[str, dict[str, set[int]]] = {
    "x86_64": {
        "sleep": {230, 270},
        "poll-without-pollin": {7, 271},
        "idle-event-loop": {232, 281, 441},
    },
    "aarch64": {
        "sleep": {115, 72},
        "poll-without-pollin": {73},
        "idle-event-loop": {22, 441},
    },
}


class Child:
    """``python -c CODE`` with a fresh pty as stdin, after printing ``ready``."""

    def __init__(self, code: str, stdin: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"print('ready', flush=True)\n{code}"],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=os.setpgrp,  # a group of its own (Popen's process_group= is 3.11+)
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n"

    def syscall(self) -> str:
        """Its main thread's ``/proc/PID/syscall``: the call's number first, or ``running``."""
        with open(f"/proc/{self.proc.pid}/syscall") as f:
            return f.read().strip()

    def asleep_in(self, calls: set[int], timeout: float = 30) -> str:
        """Wait until its main thread sleeps in one of ``calls``; that ``syscall`` line."""
        deadline = time.monotonic() + timeout
        seen = ""
        while time.monotonic() < deadline:
            seen = self.syscall()
            number = seen.split()[0]
            if number.isdigit() and int(number) in calls and process_state(self.proc.pid) == "S":
                return seen
            time.sleep(0.01)
        pytest.fail(f"pid {self.proc.pid} never slept in {sorted(calls)}; last seen {seen!r}")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def terminal() -> Iterator[tuple[int, int]]:
    """A pty (master, slave) whose slave is the child's stdin."""
    master, slave = os.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def _eventually(check: bool | None, pid: int, device: int, timeout: float = 30) -> bool | None:
    deadline = time.monotonic() + timeout
    seen = reads_terminal(pid, device)
    while seen is not check and time.monotonic() < deadline:
        time.sleep(0.01)
        seen = reads_terminal(pid, device)
    return seen


@pytest.mark.parametrize("code", READERS.values(), ids=READERS.keys())
def test_a_process_waiting_to_read_its_terminal_is_seen(
    code: str, terminal: tuple[int, int]
) -> None:
    _, slave = terminal
    child = Child(code, slave)
    try:
        assert _eventually(True, child.proc.pid, terminal_device(slave)) is True
    finally:
        child.close()


@pytest.mark.parametrize("name", NOT_READERS.keys())
def test_a_process_asleep_in_anything_else_is_not_reading(
    name: str, terminal: tuple[int, int]
) -> None:
    calls = NOT_READER_CALLS.get(os.uname().machine)
    if calls is None:
        pytest.skip(f"no system call numbers for {os.uname().machine} here")
    _, slave = terminal
    child = Child(NOT_READERS[name], slave)
    try:
        # The call its code ends in, not the first sleep after ``ready`` (an import's).
        before = child.asleep_in(calls[name])
        assert reads_terminal(child.proc.pid, terminal_device(slave)) is False
        # Still that call (the same arguments): the answer was about it.
        assert child.syscall() == before
    finally:
        child.close()


def test_a_read_of_another_terminal_does_not_count(terminal: tuple[int, int]) -> None:
    _, slave = terminal
    other_master, other_slave = os.openpty()
    child = Child("input()", other_slave)
    try:
        # It reads, but the terminal asked about is not the one it reads.
        assert _eventually(True, child.proc.pid, terminal_device(other_slave)) is True
        assert reads_terminal(child.proc.pid, terminal_device(slave)) is False
    finally:
        child.close()
        os.close(other_master)
        os.close(other_slave)


def test_a_process_that_is_gone_reads_nothing(terminal: tuple[int, int]) -> None:
    _, slave = terminal
    child = Child("pass", slave)
    child.proc.wait(30)
    try:
        assert reads_terminal(child.proc.pid, terminal_device(slave)) is False
    finally:
        child.close()


def test_on_an_unknown_machine_it_cannot_tell(
    terminal: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, slave = terminal
    monkeypatch.setattr(_tty_readers, "_CALLS", {})
    assert reads_terminal(os.getpid(), terminal_device(slave)) is None
