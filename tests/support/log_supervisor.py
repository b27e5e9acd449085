"""A supervisor in its own interpreter (``tests.children.logs``), its console read here.

Console behaviour is checked on a real supervisor process whose stdout and stderr are
pipes read by threads of the test, never through pytest's capture. The ``supervise``
fixture (tests/core/output/conftest.py) starts them and closes them after the test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.children.logs import numbered_line
from tests.support.paths import REPO

#: The rank prefix the supervisor gives each console line: ``[w<rank>]:``.
PREFIX = re.compile(rb"^\[w(\d+)\]:")


class Supervisor:
    """A supervisor run in its own interpreter, with its stdout/stderr read by threads."""

    def __init__(
        self,
        tmp_path: Path,
        config: dict[str, Any],
        *,
        read_stdout: bool = True,
        merged: bool = False,
    ):
        self.result_path = tmp_path / "result.json"
        config = {"result": str(self.result_path), "quiet": merged, **config}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.children.logs", "supervise", json.dumps(config)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        )
        self._cond = threading.Condition()
        self._data = {"stdout": bytearray(), "stderr": bytearray()}
        self._readers: dict[str, threading.Thread] = {}
        if not merged:
            self.start_reading("stderr")
        if read_stdout:
            self.start_reading("stdout")

    def _pipe(self, name: str) -> Any:
        return self.proc.stdout if name == "stdout" else self.proc.stderr

    def start_reading(self, name: str) -> None:
        pipe = self._pipe(name)
        assert pipe is not None

        def read() -> None:
            while chunk := os.read(pipe.fileno(), 1 << 20):
                with self._cond:
                    self._data[name] += chunk
                    self._cond.notify_all()

        thread = threading.Thread(target=read, daemon=True)
        self._readers[name] = thread
        thread.start()

    def wait_for(self, name: str, needle: bytes, timeout: float = 60, count: int = 1) -> None:
        """Wait until ``needle`` occurs ``count`` times in the stream read so far."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._data[name].count(needle) >= count, timeout)
            assert done, f"{needle!r} x{count} not in {name} after {timeout} s: {self.tail(name)!r}"

    def seen(self, name: str, needle: bytes) -> bool:
        with self._cond:
            return needle in self._data[name]

    def tail(self, name: str) -> bytes:
        with self._cond:
            return bytes(self._data[name][-2000:])

    def send_stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stop\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 90) -> tuple[bytes, bytes, dict[str, Any]]:
        """Wait for the supervisor to end; return its stdout, its stderr without the
        ``@@`` reports, and its JSON summary."""
        for name in ("stdout", "stderr"):
            if name not in self._readers and self._pipe(name) is not None:
                self.start_reading(name)
        assert self.proc.wait(timeout) == 0, self.tail("stderr")
        for thread in self._readers.values():
            thread.join(timeout)
        stderr = b"".join(
            line for line in bytes(self._data["stderr"]).splitlines(True) if b"@@" not in line
        )
        return bytes(self._data["stdout"]), stderr, json.loads(self.result_path.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            # Only on a failed test: the workers die with it (parent-death signal).
            self.proc.kill()
            self.proc.wait()
        for thread in self._readers.values():
            thread.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def by_rank(console: bytes, nprocs: int) -> dict[int, list[bytes]]:
    """Console lines (without prefix) per rank; every line must carry a prefix."""
    out: dict[int, list[bytes]] = {rank: [] for rank in range(nprocs)}
    assert console.endswith(b"\n") or not console, console[-200:]
    for line in console.split(b"\n")[:-1]:
        match = PREFIX.match(line)
        assert match is not None, f"console line without a rank prefix: {line[:200]!r}"
        out[int(match.group(1))].append(line[match.end() :])
    return out


def numbered_bytes(rank: int, count: int) -> bytes:
    """The first ``count`` numbered lines of ``rank``, as its worker writes them."""
    return "".join(numbered_line(rank, i) + "\n" for i in range(count)).encode()
