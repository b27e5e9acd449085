"""Worker logs: redirects, tee, prefixes, rank filters, whole lines, nothing lost.

Console behaviour is checked on a real supervisor process (``tests.children.logs``) whose
stdout and stderr are pipes read here, never through pytest's capture; file and
failure-report behaviour is checked in-process where that is enough.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from aioelastic import ChildFailedError, Std, run_processes, start_processes
from aioelastic._core.output import _logs
from aioelastic._core.output._console import ConsoleStream
from aioelastic._core.output._frames import Framer, Live
from aioelastic._core.output._logs import StreamPump
from aioelastic._core.process._platform import proc_stat
from tests.children import logs as children
from tests.children.logs import BAD_BYTES, numbered_line
from tests.support.waits import ReadyFifo

REPO_ROOT = Path(__file__).resolve().parents[3]
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
            cwd=REPO_ROOT,
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


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Any]:
    """``supervise(config, read_stdout=True)`` -> a started :class:`Supervisor`."""
    started: list[Supervisor] = []

    def start(config: dict[str, Any], **options: bool) -> Supervisor:
        sup = Supervisor(tmp_path, config, **options)
        started.append(sup)
        return sup

    yield start
    for sup in started:
        sup.close()


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
    return "".join(numbered_line(rank, i) + "\n" for i in range(count)).encode()


# -- whole lines, nothing lost ----------------------------------------------------------


@pytest.mark.timeout(180)
def test_every_line_reaches_files_and_console_once_whole_and_prefixed(
    supervise: Any, tmp_path: Path
) -> None:
    nprocs, out_lines, err_lines = 4, 200_000, 2_000
    sup = supervise(
        {
            "worker": "numbered",
            "nprocs": nprocs,
            "args": [[rank, out_lines, err_lines] for rank in range(nprocs)],
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    assert summary["failures"] == {}
    out, err = by_rank(stdout, nprocs), by_rank(stderr, nprocs)
    for rank in range(nprocs):
        expected_out = numbered_bytes(rank, out_lines)
        expected_err = numbered_bytes(rank, err_lines)
        assert (tmp_path / "logs" / str(rank) / "stdout.log").read_bytes() == expected_out
        assert (tmp_path / "logs" / str(rank) / "stderr.log").read_bytes() == expected_err
        # Equal lists: every line exactly once, in order, unbroken, with its own prefix.
        assert out[rank] == expected_out.split(b"\n")[:-1]
        assert err[rank] == expected_err.split(b"\n")[:-1]
        assert summary["stdouts"][str(rank)] == str(tmp_path / "logs" / str(rank) / "stdout.log")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["function", "binary"])
def test_block_buffered_writers_get_whole_lines_on_the_console(
    supervise: Any, tmp_path: Path, kind: str
) -> None:
    # 8 KiB writes ending mid-line at ~10,000 lines/s for about three seconds: most
    # reads end in the middle of a line, for many flush delays in a row, and no line
    # may be cut, lost or printed twice on the console (a pipe here).
    nprocs, lines, rate = 4, 30_000, 10_000.0
    args = [[rank, lines, rate] for rank in range(nprocs)]
    config: dict[str, Any] = {"worker": "paced_blocks", "nprocs": nprocs, "args": args}
    if kind == "binary":
        config["binary"] = sys.executable
        config["args"] = [["-m", "tests.children.logs", "paced_blocks", *map(str, a)] for a in args]
    sup = supervise(
        {**config, "tee": Std.ALL, "redirects": Std.ALL, "log_dir": str(tmp_path / "logs")}
    )
    stdout, stderr, summary = sup.finish()
    assert summary["failures"] == {}
    out, err = by_rank(stdout, nprocs), by_rank(stderr, nprocs)
    for rank in range(nprocs):
        expected = numbered_bytes(rank, lines)
        for name, console in (("stdout", out), ("stderr", err)):
            assert (tmp_path / "logs" / str(rank) / f"{name}.log").read_bytes() == expected
            assert console[rank] == expected.split(b"\n")[:-1], f"{name} of rank {rank}"


def test_stdout_and_stderr_on_one_pipe_never_cut_each_others_lines(supervise: Any) -> None:
    nprocs, count = 2, 100_000
    sup = supervise(
        {
            "worker": "numbered",
            "nprocs": nprocs,
            "args": [[rank, count, count] for rank in range(nprocs)],
            "tee": Std.ALL,
        },
        merged=True,  # like `aioelastic-run ... 2>&1 | tee run.log`
    )
    merged, _, summary = sup.finish()
    assert summary["failures"] == {}
    for rank, lines in by_rank(merged, nprocs).items():
        expected = numbered_bytes(rank, count).split(b"\n")[:-1]
        assert sorted(lines) == sorted(expected * 2)


def test_progress_bar_without_newline_is_printed_whole_at_exit(
    supervise: Any, tmp_path: Path
) -> None:
    sup = supervise(
        {
            "worker": "progress_bar_then_exit",
            "nprocs": 2,
            "tee": Std.ALL,
            "redirects": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    written = "".join(f"\rprogress {p:3d}%" for p in range(0, 101, 25)) + " [no newline at exit]"
    # Every piece on the console is a prefixed frame ending in \r or a line ending in
    # \n, so the two bars never splice; the redrawing carriage returns re-print the
    # prefix, so a bar never overwrites it; the bar is not one line per frame.
    matches = list(re.finditer(rb"\r?\[w(\d+)\]:([^\r\n]*[\r\n])", stdout))
    assert b"".join(m.group(0) for m in matches) == stdout
    for rank in range(2):
        mine = b"".join(m.group(2) for m in matches if int(m.group(1)) == rank)
        assert mine == written.encode()[1:] + b"\n"
        log = tmp_path / "logs" / str(rank) / "stdout.log"
        assert log.read_bytes() == written.encode()
    assert stdout.count(b"\n") == 2


def test_a_slow_progress_bar_is_frames_on_a_piped_console_not_a_line_per_flush(
    supervise: Any, tmp_path: Path
) -> None:
    sup = supervise(
        {
            "worker": "bar_over_time",
            "nprocs": 1,
            "args": [[4, 0.3]],
            "tee": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    # Each frame outlived the flush delay: it was shown as a frame (ended by \r, so the
    # next one draws over it), never as a line of its own. The closing \n is written
    # bare after the last frame, which a file or `less` reads as a CRLF line ending.
    frames = b"".join(b"\r[w0]:step %d/4" % i for i in range(1, 5))
    assert stdout == frames + b"\r\n[w0]:done\n"
    log = (tmp_path / "logs" / "0" / "stdout.log").read_bytes()
    assert log == b"".join(b"\rstep %d/4" % i for i in range(1, 5)) + b"\ndone\n"


BAR_THEN_RAISE = """
import sys, time
print("starting", file=sys.stderr, flush=True)
for i in range(1, 5):
    sys.stderr.write(f"\\rtraining {i}/4")
    sys.stderr.flush()
    time.sleep(0.3)  # longer than the flush delay: every frame is held past it
sys.stderr.write("\\n")
raise ValueError("diverged")
"""


@pytest.mark.asyncio
async def test_the_failure_report_keeps_the_last_frame_of_a_bar_not_every_frame(
    tmp_path: Path,
) -> None:
    script = tmp_path / "bar.py"
    script.write_text(BAR_THEN_RAISE)
    with anyio.fail_after(60):
        result = await run_processes(
            name="bar",
            entrypoint=sys.executable,
            args={0: (str(script),)},
            envs={0: {}},
            log_dir=tmp_path / "logs",
            redirects=Std.ERR,
        )
    lines = result.failures[0].message.splitlines()
    assert lines[:3] == ["starting", "training 4/4", "Traceback (most recent call last):"]
    assert lines[-1] == "ValueError: diverged"
    assert not any("training 1/4" in line or "training 3/4" in line for line in lines)
    log = (tmp_path / "logs" / "0" / "stderr.log").read_bytes()
    frames = b"".join(b"\rtraining %d/4" % i for i in range(1, 5))
    assert log.startswith(b"starting\n" + frames + b"\nTraceback")


def test_a_growing_partial_line_is_shown_after_the_flush_delay(
    supervise: Any, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    sup = supervise({"worker": "dots_until", "nprocs": 1, "args": [[str(go)]], "tee": Std.OUT})
    # The worker adds a dot every 20 ms and ends the line only once `go` exists, so
    # this line can only come from the flush delay (counted from the line's first byte).
    sup.wait_for("stdout", b"[w0]:dots:.", timeout=30)
    go.touch()
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    lines = by_rank(stdout, 1)[0]
    assert len(lines) >= 2
    assert b"".join(lines) == b"dots:" + b"." * (b"".join(lines).count(b".")) + b"|end"


def test_print_end_empty_is_held_then_printed_whole_without_interleaving(
    supervise: Any, tmp_path: Path
) -> None:
    fifos = [tmp_path / f"fifo{rank}" for rank in range(2)]
    for fifo in fifos:
        os.mkfifo(fifo)
    sup = supervise(
        {
            "worker": "split_line",
            "nprocs": 2,
            "args": [[r, str(f)] for r, f in enumerate(fifos)],
            "tee": Std.OUT,
            "redirects": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    for rank in range(2):
        # Both workers now hold a partial line and block: only the flush delay prints it.
        sup.wait_for("stdout", f"[w{rank}]:rank {rank} epoch 1: loss=\n".encode())
    for fifo in fifos:
        with open(fifo, "w"):
            pass
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    for rank, lines in by_rank(stdout, 2).items():
        assert lines == [
            f"rank {rank} epoch 1: loss=".encode(),
            f"0.{rank}5".encode(),
            f"rank {rank} done".encode(),
        ]
        log = tmp_path / "logs" / str(rank) / "stdout.log"
        assert (
            log.read_bytes() == f"rank {rank} epoch 1: loss=0.{rank}5\nrank {rank} done\n".encode()
        )


def test_sigkilled_worker_keeps_its_last_lines(supervise: Any, tmp_path: Path) -> None:
    sup = supervise(
        {
            "worker": "write_then_sigkill",
            "nprocs": 1,
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    assert stdout == b"[w0]:last words before SIGKILL\n[w0]:and a partial one\n"
    assert stderr == b"[w0]:stderr last words\n"
    logs = tmp_path / "logs" / "0"
    assert (logs / "stdout.log").read_bytes() == b"last words before SIGKILL\nand a partial one"
    assert (logs / "stderr.log").read_bytes() == b"stderr last words\n"
    failure = summary["failures"]["0"]
    assert failure["exitcode"] == -signal.SIGKILL
    assert "stderr last words" in failure["message"]
    assert "SIGKILL" in summary["format_msg"]


def test_undecodable_bytes_pass_through_unchanged(supervise: Any, tmp_path: Path) -> None:
    sup = supervise(
        {
            "worker": "undecodable",
            "nprocs": 1,
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    written = BAD_BYTES + b"\n" + b"still fine\n" + BAD_BYTES
    expected_console = b"".join(b"[w0]:" + line + b"\n" for line in written.split(b"\n"))
    assert stdout == expected_console
    assert stderr == expected_console
    for name in ("stdout.log", "stderr.log"):
        assert (tmp_path / "logs" / "0" / name).read_bytes() == written
    failure = summary["failures"]["0"]
    assert failure["exitcode"] == 3
    assert "still fine" in failure["message"]
    assert "\ufffd" in failure["message"]
    assert "caf\u00e9" in failure["message"]


def test_a_one_megabyte_line_passes_whole(supervise: Any, tmp_path: Path) -> None:
    size = 1_000_000
    sup = supervise(
        {
            "worker": "big_line",
            "nprocs": 1,
            "args": [[size]],
            "tee": Std.OUT,
            "redirects": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    big = b"<" + b"L" * (size - 2) + b">"
    assert stdout == b"[w0]:" + big + b"\n[w0]:after the big line\n"
    assert (tmp_path / "logs" / "0" / "stdout.log").read_bytes() == big + b"\nafter the big line\n"


def test_a_forked_worker_gets_a_console_of_its_own(supervise: Any, tmp_path: Path) -> None:
    # The supervisor's console writer thread runs before the fork; a forked worker that
    # supervises workers of its own must not inherit a console whose thread it does not
    # have (what it queued would never be written, and its flush would never end).
    sup = supervise(
        {
            "worker": "console_after_fork",
            "nprocs": 1,
            "start_method": "fork",
            "tee": Std.OUT,
            "warm_console": True,
        }
    )
    stdout, _, summary = sup.finish(timeout=60)
    assert summary["failures"] == {}
    assert stdout == b"console warmed up\n[w0]:queued after the fork\n"


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_pump_closed_from_another_task_leaves_no_stale_registration() -> None:
    # The exit path drains and closes a pipe from the exit callback while the pump task
    # sleeps on it; the descriptor number is then free for the next pipe or pidfd.
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pump = StreamPump(read_end, log_path=None, console=None, prefix=b"", keep_tail=True)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump.run)
            await anyio.wait_all_tasks_blocked()
            pump.finish()  # the sleeping pump task must wake up and end
    os.close(write_end)
    reused, writer = os.pipe2(os.O_CLOEXEC)
    assert reused == read_end  # the lowest free number: the case that matters
    again = StreamPump(reused, log_path=None, console=None, prefix=b"", keep_tail=True)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(again.run)
            await anyio.wait_all_tasks_blocked()
            os.write(writer, b"heard\n")
            os.close(writer)
            await again.closed.wait()
    assert again.tail_lines() == ["heard"]


# -- whole lines whatever the chunking ----------------------------------------------------
#
# The pump is fed the same byte stream cut at random boundaries, with random pauses
# between writes (the pattern of a block-buffered program: nearly every read ends in the
# middle of a line, for many flush delays in a row), into a real console writer whose
# pipe is drained by a reader that may be slow enough to pause the pump. Every line must
# reach the console once, in order, whole and prefixed, exactly as if the stream had been
# read in one piece. Pauses are bounded so that no line waits for its newline longer than
# a fraction of the flush delay: a line held longer is *meant* to be shown early.

_DELAY = 0.5  # the flush delay in these tests: a wide margin over the pauses below
_LINE_BUDGET = 0.1  # the most a line may wait between its first byte and its newline


def _numbered_stream(rng: random.Random, lines: int) -> bytes:
    return b"".join(b"line %d %s\n" % (i, b"x" * rng.randrange(60)) for i in range(lines))


def _frames_stream(rng: random.Random, pieces: int) -> bytes:
    out = []
    for i in range(pieces):
        kind = rng.random()
        if kind < 0.5:
            out.append(b"line %d %s\n" % (i, b"x" * rng.randrange(40)))
        elif kind < 0.75:
            frames = rng.randint(1, 6)
            bar = b"".join(b"\rstep %d/%d" % (j, frames) for j in range(1, frames + 1))
            out.append(bar + rng.choice([b"\n", b"\r\n", b"\r", b""]))
        elif kind < 0.9:
            out.append(b"crlf %d\r\n" % i)
        else:
            out.append(rng.choice([b"\n", b"\r", b"\r\r"]))
    return b"".join(out) + b"\n"


def _big_line_stream(rng: random.Random) -> bytes:
    before, after = _numbered_stream(rng, 12_000), _numbered_stream(rng, 12_000)
    return before + b"<" + b"L" * (1 << 20) + b">\n" + after


def _cut(rng: random.Random, data: bytes, sizes: Any, pauses: Any) -> list[tuple[bytes, float]]:
    """``data`` as (chunk, pause before it) pairs, no line waiting past ``_LINE_BUDGET``."""
    chunks: list[tuple[bytes, float]] = []
    at, clock, line_began = 0, 0.0, 0.0
    while at < len(data):
        chunk = data[at : at + sizes()]
        pause = pauses()
        if at and data[at - 1 : at] != b"\n" and clock + pause - line_began > _LINE_BUDGET:
            pause = 0.0  # the line begun before this chunk must not be held any longer
        clock += pause
        chunks.append((chunk, pause))
        at += len(chunk)
        end = chunk.rfind(b"\n")
        if end >= 0 and end < len(chunk) - 1:
            line_began = clock  # this chunk begins a line it does not end
        elif end < 0 and data[at - len(chunk) - 1 : at - len(chunk)] in (b"\n", b""):
            line_began = clock
    return chunks


def _block_buffered(rng: random.Random, data: bytes) -> list[tuple[bytes, float]]:
    # 8 KiB writes, each ending wherever the buffer filled: ~10,000 lines/s.
    return _cut(rng, data, lambda: 8192, lambda: rng.uniform(0.01, 0.03))


def _random_cuts(rng: random.Random, data: bytes) -> list[tuple[bytes, float]]:
    sizes = lambda: int(2 ** rng.uniform(0, 13))  # noqa: E731 - 1 B to 8 KiB, log-uniform
    return _cut(rng, data, sizes, lambda: rng.choice([0.0, 0.0, rng.uniform(0, 0.02)]))


def rendered(console: bytes, prefix: bytes) -> list[list[bytes]]:
    """What each console line shows, frame by frame; every frame must carry ``prefix``.

    A redrawn line is the list of its frames; empty frames and a bare prefix (a
    redrawing ``\\r`` at the start of a line) draw nothing and are left out.
    """
    assert console.endswith(b"\n"), console[-200:]
    lines = []
    for line in console.split(b"\n")[:-1]:
        frames = [frame for frame in line.split(b"\r") if frame and frame != prefix]
        for frame in frames:
            assert frame.startswith(prefix), f"a piece without its prefix: {frame[:200]!r}"
        lines.append(frames)
    return lines


@pytest.mark.parametrize("seed", range(300))
def test_the_framer_shows_the_same_whatever_the_chunking(seed: int) -> None:
    rng = random.Random(seed)
    data = _frames_stream(rng, 60)
    reference = Framer(b"[p]", console=True, keep_tail=True)
    whole = reference.feed(data) + reference.end()
    framer = Framer(b"[p]", console=True, keep_tail=True)
    pieces, at = [], 0
    while at < len(data):
        size = rng.randint(1, 12)
        pieces.append(framer.feed(data[at : at + size]))
        at += size
    shown = b"".join(pieces) + framer.end()
    assert rendered(shown, b"[p]") == rendered(whole, b"[p]")
    assert framer.tail_lines() == reference.tail_lines()


class PipeConsole:
    """A real console writer whose stream is a pipe drained by a thread, maybe slowly."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, high_water: int, slow: bool) -> None:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        self._stream = io.TextIOWrapper(io.FileIO(write_end, "w"))
        monkeypatch.setattr(sys, "stdout", self._stream)
        self.stream = ConsoleStream("stdout", high_water=high_water)
        self.received = bytearray()
        pause = 0.001 if slow else 0.0

        def read() -> None:
            with io.FileIO(read_end, "r") as pipe:
                while chunk := pipe.read(4096 if slow else 1 << 20):
                    self.received += chunk
                    if pause:
                        time.sleep(pause)  # a slow terminal: the pace, not a synchronisation

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    async def close(self) -> bytes:
        """Wait until everything queued is written; return what the reader received."""
        await self.stream.flush()
        self._stream.close()
        self._reader.join(30)
        assert not self._reader.is_alive()
        return bytes(self.received)


async def pump_chunks(
    chunks: list[tuple[bytes, float]], console: PipeConsole, prefix: bytes
) -> None:
    """Write ``chunks`` into a pipe from a thread, pausing as told, through a pump."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pump = StreamPump(
        read_end, log_path=None, console=console.stream, prefix=prefix, keep_tail=True
    )

    def write() -> None:
        try:
            for chunk, pause in chunks:
                if pause:
                    time.sleep(pause)  # the writer's pace, not a synchronisation
                view = memoryview(chunk)
                while view:
                    view = view[os.write(write_end, view) :]
        except BrokenPipeError:
            pass  # the pump failed and closed its end; the assertions below say so
        finally:
            os.close(write_end)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    with anyio.fail_after(60):
        await pump.run()
    writer.join(10)
    assert pump.log_fault() is None


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stream", "cut", "slow_console"),
    [
        pytest.param("numbered", _block_buffered, False, id="block-buffered"),
        pytest.param("numbered", _random_cuts, False, id="random-cuts"),
        pytest.param("numbered", _block_buffered, True, id="block-buffered-slow-console"),
        pytest.param("frames", _random_cuts, False, id="frames-random-cuts"),
        pytest.param("frames", _random_cuts, True, id="frames-slow-console"),
        pytest.param("big-line", _random_cuts, False, id="megabyte-line"),
    ],
)
async def test_console_lines_are_the_written_lines_whatever_the_chunking(
    monkeypatch: pytest.MonkeyPatch, stream: str, cut: Any, slow_console: bool
) -> None:
    monkeypatch.setattr(_logs, "FLUSH_DELAY", _DELAY)
    seed = f"{stream}-{cut.__name__}-{slow_console}"
    rng = random.Random(seed)
    if stream == "numbered":
        data = _numbered_stream(rng, 20_000)
    elif stream == "frames":
        data = _frames_stream(rng, 20_000)
    else:
        data = _big_line_stream(rng)
    chunks = cut(rng, data)
    # Long runs of reads that all end mid-line, for several flush delays in a row: the
    # pattern that cut a line in two every flush delay.
    mid_line = [chunk[-1:] != b"\n" for chunk, _ in chunks]
    assert sum(pause for _, pause in chunks) > 3 * _DELAY
    assert sum(mid_line) > 0.9 * len(chunks)
    prefix = b"[w3]:"
    console = PipeConsole(
        monkeypatch, high_water=8192 if slow_console else 1 << 24, slow=slow_console
    )
    await pump_chunks(chunks, console, prefix)
    shown = await console.close()
    reference = Framer(prefix, console=True, keep_tail=False)
    whole = reference.feed(data) + reference.end()
    assert rendered(shown, prefix) == rendered(whole, prefix), f"seed {seed}"
    if b"\r" not in data:
        assert shown == b"".join(prefix + line + b"\n" for line in data.split(b"\n")[:-1])


# -- prefixes and the rank filter -------------------------------------------------------


def test_log_line_prefix_template(supervise: Any) -> None:
    sup = supervise(
        {
            "worker": "one_line",
            "nprocs": 2,
            "args": [[0, "hello"], [1, "hello"]],
            "envs": {"0": {"ROLE_NAME": "trainer", "RANK": "10"}, "1": {"RANK": "11"}},
            "tee": Std.OUT,
            "log_line_prefix": "${role_name}/${rank}/${local_rank}@${hostname}> ",
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    host = socket.gethostname()
    assert sorted(stdout.decode().splitlines()) == [
        f"trainer/10/0@{host}> hello from 0",
        # No ROLE_NAME in its environment: the group's name stands in for the role.
        f"w/11/1@{host}> hello from 1",
    ]


def test_identical_lines_are_printed_once_with_the_ranks_the_prefix_shows(
    supervise: Any, tmp_path: Path
) -> None:
    from tests.children import collapse as child

    nprocs = 8
    ready = ReadyFifo(tmp_path)
    go = tmp_path / "go"
    os.mkfifo(go)
    script = str(REPO_ROOT / "tests" / "children" / "collapse.py")
    sup = supervise(
        {
            "binary": sys.executable,
            "nprocs": nprocs,
            "args": [[script, str(ready.path), str(go), "0", rank] for rank in range(nprocs)],
            # The prefix shows the global rank: so do the collapsed lines.
            "envs": {str(rank): {"RANK": str(10 + rank)} for rank in range(nprocs)},
            "log_line_prefix": "<${rank}> ",
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
            "collapse_identical_lines": 2.0,
        }
    )
    try:
        anyio.run(ready.lines, nprocs, 60)
    finally:
        ready.close()
    fd = os.open(go, os.O_RDWR)  # every rank writes now (see tests/children/collapse.py)
    try:
        stdout, stderr, summary = sup.finish()
    finally:
        os.close(fd)
    assert summary["failures"] == {}
    own = [f"<{10 + r}> {line}" for r in range(nprocs) for line in child.lines(r)[0][1:-1]]
    shown = stdout.decode().splitlines()
    assert shown[0] == f"[ranks 10-17]: {child.WARNING}"
    assert sorted(shown[1:-1]) == sorted(own)
    assert shown[-1] == f"[ranks 10-17]: {child.LAST}"
    assert stderr.decode().splitlines() == [f"[ranks 10-17]: {child.ERR_WARNING}"]
    for rank in range(nprocs):
        out, err = child.lines(rank)
        logs = tmp_path / "logs" / str(rank)
        assert (logs / "stdout.log").read_text() == "".join(f"{line}\n" for line in out)
        assert (logs / "stderr.log").read_text() == "".join(f"{line}\n" for line in err)


def test_rank_filter_hides_console_output_but_not_files_or_failures(
    supervise: Any, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sup = supervise(
        {
            "worker": "fail_after_output",
            "nprocs": 2,
            "args": [[0, str(fifo)], [1, str(fifo)]],
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "local_ranks_filter": [0],
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    assert stdout == b"[w0]:stdout of rank 0\n"
    assert b"[w0]:stderr of rank 0\n" in stderr
    assert b"rank 1" not in stdout + stderr
    logs = tmp_path / "logs" / "1"
    assert (logs / "stdout.log").read_bytes() == b"stdout of rank 1\n"
    assert (logs / "stderr.log").read_bytes().startswith(b"stderr of rank 1\n")
    assert list(summary["failures"]) == ["1"]
    assert "RuntimeError: rank 1 blew up" in summary["format_msg"]


# -- the last stderr lines of a plain script --------------------------------------------

PLAIN_SCRIPT = """\
import sys
print("output before the crash")
def deep_inside():
    raise ValueError("plain script failed: marker-42")
if sys.argv[1] == "fail":
    deep_inside()
"""


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("redirects", "tee", "ranks_filter"),
    [
        pytest.param(Std.NONE, Std.NONE, None, id="not-redirected-not-teed"),
        pytest.param(Std.ERR, Std.NONE, None, id="redirected"),
        pytest.param(Std.ALL, Std.ALL, {1}, id="teed-but-filtered-out"),
        pytest.param(Std.NONE, Std.ALL, {1}, id="teed-not-redirected-filtered-out"),
    ],
)
async def test_plain_script_traceback_is_reported_without_a_decorator(
    tmp_path: Path, redirects: Std, tee: Std, ranks_filter: set[int] | None
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    result = await run_processes(
        name="plain",
        entrypoint=sys.executable,
        args={0: (str(script), "fail"), 1: (str(script), "ok")},
        envs={0: {}, 1: {}},
        log_dir=tmp_path / "logs",
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ranks_filter,
    )
    assert list(result.failures) == [0]
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert failure.message.startswith("Traceback (most recent call last):")
    assert failure.message.endswith("ValueError: plain script failed: marker-42")
    report = ChildFailedError("plain", result.failures).format_msg()
    assert "in deep_inside" in report
    assert "ValueError: plain script failed: marker-42" in report
    if Std.ERR in redirects:
        assert "marker-42" in (tmp_path / "logs" / "0" / "stderr.log").read_text()


# -- log directories --------------------------------------------------------------------


@pytest.mark.parametrize("existing", ["stdout.log", "stderr.log", "error.json"])
def test_log_dir_with_earlier_output_is_refused_before_anything_starts(
    tmp_path: Path, existing: str
) -> None:
    log_dir = tmp_path / "logs"
    (log_dir / "1").mkdir(parents=True)
    (log_dir / "1" / existing).write_text("an earlier run")
    with pytest.raises(ValueError, match="already holds output") as info:
        start_processes(
            name="w",
            entrypoint=children.one_line,
            args={0: (0, "x"), 1: (1, "x")},
            envs={0: {}, 1: {}},
            log_dir=log_dir,
            redirects=Std.ALL,
        )
    assert str(log_dir / "1" / existing) in str(info.value)
    assert (log_dir / "1" / existing).read_text() == "an earlier run"
    assert sorted(p.relative_to(log_dir).as_posix() for p in log_dir.rglob("*")) == [
        "1",
        f"1/{existing}",
    ]


@pytest.fixture
def private_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory as ``tempfile``'s default, so leftovers are ours to count."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.mark.asyncio
async def test_temporary_log_dir_is_removed_when_nothing_was_redirected(
    private_tempdir: Path,
) -> None:
    result = await run_processes(
        name="w",
        entrypoint=children.one_line,
        args={0: (0, "not kept"), 1: (1, "not kept")},
        envs={0: {}, 1: {}},
        start_method="fork",
    )
    assert not result.failures
    assert list(private_tempdir.iterdir()) == []


@pytest.mark.asyncio
async def test_tee_also_logs_to_files_like_torch(private_tempdir: Path) -> None:
    result = await run_processes(
        name="w",
        entrypoint=children.one_line,
        args={0: (0, "kept")},
        envs={0: {}},
        start_method="fork",
        tee=Std.OUT,
    )
    (kept,) = private_tempdir.iterdir()
    assert result.stdouts == {0: str(kept / "0" / "stdout.log")}
    assert result.stderrs == {0: ""}
    assert "kept" in (kept / "0" / "stdout.log").read_text()


@pytest.mark.asyncio
async def test_temporary_log_dir_is_kept_when_a_worker_wrote_an_error_file(
    private_tempdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aioelastic")
    result = await run_processes(
        name="w",
        entrypoint=children.fail_after_output,
        args={0: (0, "/nonexistent/fifo")},
        envs={0: {}},
        start_method="fork",
    )
    (kept,) = private_tempdir.iterdir()
    failure = result.failures[0]
    assert failure.error_file == str(kept / "0" / "error.json")
    assert "FileNotFoundError" in failure.message
    assert str(kept) in caplog.text


@pytest.mark.asyncio
async def test_temporary_log_dir_is_kept_and_logged_when_redirected(
    private_tempdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aioelastic")
    result = await run_processes(
        name="w",
        entrypoint=children.one_line,
        args={0: (0, "kept")},
        envs={0: {}},
        start_method="fork",
        redirects=Std.OUT,
    )
    (kept,) = private_tempdir.iterdir()
    assert result.stdouts == {0: str(kept / "0" / "stdout.log")}
    assert (kept / "0" / "stdout.log").read_text() == "kept from 0\n"
    assert str(kept) in caplog.text


# -- back-pressure and idle cost --------------------------------------------------------


def test_worker_is_not_blocked_by_a_stalled_console_below_the_high_water_mark(
    supervise: Any,
) -> None:
    lines = 120_000  # about 4 MB, far more than the pipe to the stalled reader holds
    sup = supervise(
        {"worker": "numbered", "nprocs": 1, "args": [[0, lines, 0]], "tee": Std.OUT},
        read_stdout=False,
    )
    # Nobody reads the supervisor's stdout, yet the worker finishes and is reaped.
    sup.wait_for("stderr", b"@@WAITED", timeout=60)
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    assert by_rank(stdout, 1)[0] == numbered_bytes(0, lines).split(b"\n")[:-1]


def test_beyond_the_high_water_mark_the_worker_waits_and_nothing_is_dropped(
    supervise: Any,
) -> None:
    lines = 120_000
    sup = supervise(
        {
            "worker": "numbered",
            "nprocs": 1,
            "args": [[0, lines, 0]],
            "tee": Std.OUT,
            "high_water": 256 * 1024,
        },
        read_stdout=False,
    )
    sup.wait_for("stderr", b"@@PIDS")
    # An observation window, not a synchronisation: with the console stalled and the
    # queue full, the worker must still be blocked in its write when it ends.
    time.sleep(1.5)
    assert not sup.seen("stderr", b"@@WAITED")
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    assert by_rank(stdout, 1)[0] == numbered_bytes(0, lines).split(b"\n")[:-1]


def _task_stats(pid: int) -> tuple[int, float, int]:
    """Threads, CPU seconds and context switches (all threads) of process ``pid``."""
    tasks = os.listdir(f"/proc/{pid}/task")
    fields = proc_stat(pid)
    assert fields is not None
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt")):
                        switches += int(line.split()[1])
        except FileNotFoundError:
            continue
    return len(tasks), cpu, switches


@pytest.mark.timeout(90)
def test_idle_teed_workers_cost_no_threads_and_no_wakeups(supervise: Any) -> None:
    nprocs = 8
    sup = supervise(
        {"worker": "idle_ready", "nprocs": nprocs, "tee": Std.ALL, "stop_on_stdin": True}
    )
    sup.wait_for("stdout", b"]:ready\n", count=nprocs)
    pid = sup.proc.pid
    threads, cpu_before, switches_before = _task_stats(pid)
    time.sleep(2.0)  # the measurement window
    threads_after, cpu_after, switches_after = _task_stats(pid)
    print(
        f"idle 2 s: {threads} threads, {cpu_after - cpu_before:.3f} s CPU, "
        f"{switches_after - switches_before} context switches"
    )
    sup.send_stop()
    sup.wait_for("stderr", b"@@THREADS")
    names = json.loads(sup.tail("stderr").split(b"@@THREADS ")[1].split(b"\n")[0])
    stdout, _, summary = sup.finish()
    assert summary["finished"] is False  # still running when stopped, as intended
    assert sorted(by_rank(stdout, nprocs).items()) == [(r, [b"ready"]) for r in range(nprocs)]
    # The main thread, the console writer (one per console stream used) and the
    # launcher pool (capped, shared by every group) — never a thread per stream (torch's
    # tee: one per tee'd file, 16 here).
    others = [n for n in names if not n.startswith("aioelastic-launch")]
    assert sorted(others) == ["MainThread", "aioelastic-stdout"]
    assert threads == threads_after == len(names) <= 3 + 8
    # No polling: an idle supervisor sleeps in epoll_wait and condition waits.
    assert switches_after - switches_before <= 10
    assert cpu_after - cpu_before <= 0.05


# -- framing, unit ------------------------------------------------------------------------


def _feed_all(framer: Framer, pieces: list[bytes | None]) -> bytes:
    """Feed ``pieces``; ``None`` stands for the flush delay expiring."""
    out = b""
    for piece in pieces:
        out += framer.flush() if piece is None else framer.feed(piece)
    return out + framer.end()


@pytest.mark.parametrize(
    ("pieces", "console", "tail"),
    [
        pytest.param(
            [b"\ra 1", b"\ra 2", b"\ra 3", b"\nok\n"],
            b"\r[p]a 1\r[p]a 2\r[p]a 3\n[p]ok\n",
            [b"a 3", b"ok"],
            id="frames-in-one-go",
        ),
        pytest.param(
            [b"\ra 1", None, None, b"\ra 2", None, b"\n"],
            b"\r[p]a 1\r[p]a 2\r\n",
            [b"a 2"],
            id="each-frame-shown-once-by-the-delay",
        ),
        pytest.param(
            [b"\ra 1", None, b"0", None, b"\n"],
            b"\r[p]a 1\r[p]a 10\r\n",
            [b"a 10"],
            id="a-shown-frame-that-grows-is-drawn-again-whole",
        ),
        pytest.param(
            [b"loss=", None, b"0.5\n"],
            b"[p]loss=\n[p]0.5\n",
            [b"loss=", b"0.5"],
            id="plain-partial-text-is-still-a-line",
        ),
        pytest.param(
            [b"a\r", b"\nb\r", b"x\n"],
            b"[p]a\r\n[p]b\r[p]x\n",
            [b"a", b"x"],
            id="crlf-is-a-line-end-split-across-reads",
        ),
        pytest.param(
            [b"\ra 1", None, b"\ra 2"],
            b"\r[p]a 1\r[p]a 2\n",
            [b"a 2"],
            id="a-frame-held-at-the-end-gets-a-newline",
        ),
    ],
)
def test_framer_cuts_lines_and_frames(
    pieces: list[bytes | None], console: bytes, tail: list[bytes]
) -> None:
    framer = Framer(b"[p]", console=True, keep_tail=True)
    assert _feed_all(framer, pieces) == console
    assert framer.tail_lines() == tail


def test_a_bars_first_carriage_return_read_alone_leads_the_next_piece() -> None:
    # The worker writes "\rprogress   0%"; a busy reader may take it before the next
    # write, and then its \r is a block of its own. Printed alone, that \r would be a
    # console piece without our prefix, and another rank's piece could follow it.
    framer = Framer(b"[w1]:", console=True, keep_tail=True)
    pieces = [framer.feed(b"\rprogress   0%"), framer.feed(b"\rprogress  25%"), framer.end()]
    assert pieces == [b"", b"\r[w1]:progress   0%\r", b"[w1]:progress  25%\n"]


def test_live_frames_are_shown_as_they_arrive() -> None:
    framer = Framer(b"", console=True, keep_tail=True, live=Live.FRAMES)
    assert framer.feed(b"\r 10%|#") == b"\r 10%|#\r"
    assert not framer.holding
    assert framer.feed(b"#") == b" 10%|##\r"
    assert framer.feed(b"\r 20%|###") == b" 20%|###\r"
    assert framer.feed(b"\n") == b"\n"
    assert framer.tail_lines() == [b" 20%|###"]
    assert framer.feed(b"name? ") == b""  # plain text: a line of its own, later
    assert framer.flush() == b"name? \n"


def test_alone_at_a_terminal_a_prompt_is_shown_at_once_on_its_line() -> None:
    framer = Framer(b"", console=True, keep_tail=True, live=Live.EVERYTHING)
    assert framer.feed(b"name? ") == b"name? "
    assert framer.flush() == b""
    assert framer.feed(b"Alice\nhello") == b"Alice\nhello"
    assert framer.feed(b"\r 10%") == b"\r 10%\r"
    assert framer.feed(b"\r 20%") == b" 20%\r"
    assert framer.end() == b"\n"
    assert framer.tail_lines() == [b"name? Alice", b" 20%"]
    with pytest.raises(ValueError, match="prefix"):
        Framer(b"[w0]:", console=True, keep_tail=False, live=Live.EVERYTHING)


def test_a_prompt_held_back_is_shown_at_once_when_its_worker_gets_the_keyboard() -> None:
    # One of several workers at a terminal: its prompt waits, like any partial line,
    # until the stdin router finds it reading and raises it to Live.EVERYTHING.
    framer = Framer(b"", console=True, keep_tail=True, live=Live.FRAMES)
    assert framer.feed(b"(Pdb) ") == b""
    assert framer.set_live(Live.EVERYTHING) == b"(Pdb) "
    assert not framer.holding
    assert framer.raw_text_shown
    # The typed line's Enter was echoed by the terminal: the prompt's line is over, and
    # the worker's answer is not printed after an empty line.
    framer.end_shown_line()
    assert not framer.raw_text_shown
    assert framer.feed(b"42\n(Pdb) ") == b"42\n(Pdb) "
    # Back to Live.FRAMES (it went on, another worker reads): text shown stays shown,
    # and only the rest of its line follows, once complete or at the flush delay.
    assert framer.set_live(Live.FRAMES) == b""
    assert framer.feed(b"c") == b""
    assert framer.flush() == b"c\n"
    assert framer.feed(b"more\n") == b"more\n"
    assert framer.tail_lines() == [b"(Pdb) ", b"42", b"(Pdb) c", b"more"]


def test_a_prefixed_stream_never_shows_partial_lines_raw() -> None:
    framer = Framer(b"[w1]:", console=True, keep_tail=False, live=Live.FRAMES)
    assert framer.feed(b"name? ") == b""
    assert framer.set_live(Live.EVERYTHING) == b""
    assert framer.live is Live.FRAMES
    assert framer.flush() == b"[w1]:name? \n"


def test_a_thousand_frames_leave_one_line_in_the_tail() -> None:
    framer = Framer(b"", console=False, keep_tail=True)
    for i in range(1000):
        assert framer.feed(b"\rstep %d" % i) == b""
        if i % 7 == 0:
            framer.flush()
    framer.feed(b"\nTraceback\n")
    assert framer.tail_lines() == [b"step 999", b"Traceback"]
