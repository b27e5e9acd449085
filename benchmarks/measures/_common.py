"""Pieces the measures share: lazy imports of each side, and the console capture.

aioelastic's modules are imported lazily and a missing one raises
:class:`~benchmarks.harness._spec.NotAvailable`, so that a measure whose aioelastic side has not
landed yet reports ``n/a`` instead of failing the suite.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from benchmarks.harness._spec import NotAvailable, RepContext
from benchmarks.programs._clock import now_ns

#: The ``name`` every system gives its workers; tee'd lines start with ``[bench{rank}]:``.
NAME = "bench"


def aio(module: str) -> ModuleType:
    """Import an aioelastic module, or raise NotAvailable saying which one is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise NotAvailable(f"{module} is not importable yet ({exc})") from exc


def runnable(module: str) -> str:
    """``module``, for ``python -m``, or raise NotAvailable when it cannot be found."""
    if importlib.util.find_spec(module) is None:
        raise NotAvailable(f"{module} is not importable yet")
    return module


def aio_core() -> Any:
    """``aioelastic._core.group._processes`` (start_processes, run_processes)."""
    return aio("aioelastic._core.group._processes")


def aio_std() -> Any:
    """aioelastic's ``Std`` flag."""
    return aio("aioelastic._core.output._std").Std


def torch_mp() -> Any:
    """``torch.multiprocessing`` (untyped, hence ``Any``)."""
    return importlib.import_module("torch.multiprocessing")


def set_stdlib_forkserver_preload(modules: list[str]) -> None:
    """What a torch user can do to preload torch: the stdlib fork server's preload list.

    torch's start_processes has no preload parameter, but its ``forkserver`` start method
    uses the process-wide stdlib fork server, whose preload list is set here. It only
    takes effect before that server starts, which is why every system runs in its own
    driver process.
    """
    import multiprocessing

    multiprocessing.set_forkserver_preload(modules)


#: A system's params asking for a torch-preloading stdlib fork server (see
#: :func:`preload_torch_if_asked`).
TORCH_PRELOAD = {"torch_preload": True}


def preload_torch_if_asked(ctx: RepContext) -> None:
    """Make the stdlib fork server preload torch when the system's params ask for it.

    torch's worker wrapper (its ``_wrap``) lives in torch, so each of its function workers
    imports torch even when the user's function does not; a torch-preloading fork server
    keeps that ~1.5 s out of every repetition, which is about starting, waiting or
    stopping, not about imports.
    """
    if ctx.params.get("torch_preload"):
        set_stdlib_forkserver_preload(["torch"])


def envs_for(n: int) -> dict[int, dict[str, str]]:
    """Per-rank environments (the same for every system)."""
    return {r: {"LOCAL_RANK": str(r)} for r in range(n)}


def log_dir(ctx: RepContext) -> str:
    """This repetition's log directory (not created: both sides create it)."""
    return str(ctx.workdir / "logs")


def check_success(result: Any, who: str) -> None:
    """Raise if a run that should have succeeded did not (a broken benchmark, not a sample)."""
    if result is None or result.is_failed():
        failures = getattr(result, "failures", None)
        raise RuntimeError(f"{who}: the run failed: {failures!r}")


def check_failure(result: Any, who: str) -> None:
    """Raise if a run that should have failed did not."""
    if result is None or not result.is_failed():
        raise RuntimeError(f"{who}: expected a failed run, got {result!r}")


@dataclass
class Capture:
    """What reached the supervisor's console (fd 1) while :func:`console` was active.

    Attributes:
        data: every byte written to fd 1.
        chunks: ``(arrival_ns, end_offset)`` per read, to date each line's arrival.
    """

    data: bytearray = field(default_factory=bytearray)
    chunks: list[tuple[int, int]] = field(default_factory=list)

    def last_arrival(self) -> int:
        """When the last byte arrived."""
        if not self.chunks:
            raise RuntimeError("nothing reached the console")
        return self.chunks[-1][0]

    def lines_with_arrival(self) -> Iterator[tuple[bytes, int]]:
        """Each complete line with the time its newline arrived."""
        start = 0
        chunk = 0
        while True:
            end = self.data.find(b"\n", start)
            if end < 0:
                return
            while self.chunks[chunk][1] <= end:
                chunk += 1
            yield bytes(self.data[start:end]), self.chunks[chunk][0]
            start = end + 1


@contextmanager
def console() -> Iterator[Capture]:
    """Point this process's fd 1 at a pipe read by a thread that dates every chunk.

    Both systems print tee'd lines to the supervisor's stdout (a Python ``sys.stdout``
    over fd 1 or fd 1 itself); swapping the descriptor underneath catches both. The
    reader thread blocks in ``read``: it costs nothing while the console is quiet and
    keeps the pipe drained so the systems are never throttled by a slow console.
    ``sys.stdout`` is made line-buffered, as it is on a terminal: block buffering (its
    default on a pipe) would hold a system's lines back for kilobytes and measure Python's
    buffer rather than the system.
    """
    import sys

    capture = Capture()
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    line_buffering = sys.stdout.line_buffering
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    saved = os.dup(1)
    os.dup2(write_fd, 1)
    os.close(write_fd)

    def reader() -> None:
        while True:
            data = os.read(read_fd, 1 << 16)
            if not data:
                return
            capture.data += data
            capture.chunks.append((now_ns(), len(capture.data)))

    thread = threading.Thread(target=reader, name="bench-console", daemon=True)
    thread.start()
    try:
        yield capture
    finally:
        sys.stdout.flush()
        sys.stdout.reconfigure(line_buffering=line_buffering)  # type: ignore[union-attr]
        # Restoring fd 1 closes the pipe's last write end: the reader sees EOF.
        os.dup2(saved, 1)
        os.close(saved)
        thread.join()
        os.close(read_fd)


LINE = re.compile(rb"^\[" + NAME.encode() + rb"(\d+)\]:(\d+) (\d+) (\S+)$")


@dataclass
class LineCount:
    """How the tee'd lines of a throughput run came out on the console.

    Attributes:
        good: distinct expected lines seen whole with the right prefix.
        lost: expected lines never seen whole.
        broken: console lines that are not a whole expected line (split, merged,
            mis-prefixed), plus duplicates.
    """

    good: int
    lost: int
    broken: int


def count_lines(capture: Capture, n: int, lines: int, width: int) -> LineCount:
    """Check the console against what ``spam`` workers wrote (``RANK I xxx..``)."""
    seen: set[tuple[int, int]] = set()
    broken = 0
    pad = b"x" * width
    for line, _ in capture.lines_with_arrival():
        match = LINE.match(line)
        if (
            match is None
            or match.group(1) != match.group(2)
            or match.group(4) != pad
            or int(match.group(1)) >= n
            or int(match.group(3)) >= lines
        ):
            broken += 1
            continue
        key = (int(match.group(1)), int(match.group(3)))
        if key in seen:
            broken += 1
        seen.add(key)
    if not capture.data.endswith(b"\n") and capture.data:
        broken += 1
    return LineCount(good=len(seen), lost=n * lines - len(seen), broken=broken)
