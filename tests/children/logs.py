"""Child programs for tests/core/output/test_logs.py.

Function workers (run by the supervisor under test) are the module-level functions below.
The supervisor itself runs in its own interpreter, so that the tests capture its real
stdout/stderr file descriptors rather than a pytest capture object::

    python -m tests.children.logs supervise CONFIG_JSON

``CONFIG_JSON`` holds the ``start_processes`` arguments (``worker`` names a function of
this module; ``args`` is a list of argument lists by rank; ``envs`` maps ranks as
strings) plus:

* ``result``: a path where a JSON summary of the run is written at the end;
* ``stop_on_stdin``: stay up until a line arrives on stdin, then close the context;
* ``high_water``: the console's back-pressure mark, in bytes;
* ``warm_console``: start the console's writer thread before any worker starts;
* ``quiet``: no ``@@`` reports (for a stdout and stderr that are one pipe);
* ``binary``: start this program instead of a function (``args`` are its arguments).

The supervisor reports its own progress on fd 2 as lines starting with ``@@`` (written
with ``os.write``, never through the console queue under test).
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

# -- function workers -------------------------------------------------------------------


def numbered_line(rank: int, i: int) -> str:
    """The ``i``-th line worker ``rank`` writes (no newline); lengths vary to cut chunks."""
    return f"{rank} {i} " + "x" * (i % 53)


def numbered(rank: int, out_lines: int, err_lines: int) -> None:
    """Write ``out_lines`` numbered lines to stdout and ``err_lines`` to stderr.

    Block-buffered, so the pipe receives 8 KiB writes that cut lines anywhere.
    """
    out, err = sys.stdout, sys.stderr
    for stream in (out, err):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=False, write_through=False)
    for i in range(max(out_lines, err_lines)):
        if i < out_lines:
            out.write(numbered_line(rank, i) + "\n")
        if i < err_lines:
            err.write(numbered_line(rank, i) + "\n")
    out.flush()
    err.flush()


def paced_blocks(rank: int, lines: int, rate: float) -> None:
    """Write ``lines`` numbered lines to stdout and stderr as a block-buffered program does.

    Each stream gets 8 KiB writes that end wherever the buffer filled (nearly always in
    the middle of a line), paced to ``rate`` lines a second: ``print()`` in a loop
    without ``-u``, whose pipe reader sees a partial line at the end of almost every read.
    """
    block = 8192
    pending = bytearray()
    began = time.monotonic()
    for i in range(lines):
        pending += (numbered_line(rank, i) + "\n").encode()
        if len(pending) >= block:
            for fd in (1, 2):
                _write_all(fd, pending[:block])
            del pending[:block]
            ahead = began + (i + 1) / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)  # the writer's pace, not a synchronisation
    for fd in (1, 2):
        _write_all(fd, pending)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def progress_bar_then_exit() -> None:
    """A progress bar redrawn with carriage returns, and the process exits with no newline."""
    for pct in range(0, 101, 25):
        sys.stdout.write(f"\rprogress {pct:3d}%")
        sys.stdout.flush()
    sys.stdout.write(" [no newline at exit]")
    sys.stdout.flush()


def dots_until(go_file: str) -> None:
    """Keep extending one line (a dot every 20 ms) until ``go_file`` exists, then end it.

    A flush delay that restarts on every byte would never print this line before its
    newline; the test creates ``go_file`` only after it saw the line on the console.
    """
    sys.stdout.write("dots:")
    sys.stdout.flush()
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        sys.stdout.write(".")
        sys.stdout.flush()
        time.sleep(0.02)
    print("|end")


def split_line(rank: int, fifo: str) -> None:
    """``print(end="")``, block until the test opens ``fifo``, then end the line."""
    print(f"rank {rank} epoch 1: loss=", end="", flush=True)
    with open(fifo) as f:
        f.read()
    print(f"0.{rank}5")
    print(f"rank {rank} done")


def bar_over_time(frames: int, pause: float) -> None:
    """A progress bar of ``frames`` frames, ``pause`` seconds apart, then a line.

    The pause is longer than the flush delay, so each frame is held past it.
    """
    for i in range(1, frames + 1):
        if i > 1:
            time.sleep(pause)
        sys.stdout.write(f"\rstep {i}/{frames}")
        sys.stdout.flush()
    time.sleep(pause)
    sys.stdout.write("\ndone\n")
    sys.stdout.flush()


def write_then_sigkill() -> None:
    """Write a line and a partial line, then die by SIGKILL before any cleanup."""
    os.write(1, b"last words before SIGKILL\nand a partial one")
    os.write(2, b"stderr last words\n")
    os.kill(os.getpid(), signal.SIGKILL)


BAD_BYTES = b"caf\xc3\xa9 \xff\xfe\xfd lone \xc3( truncated \xe2\x82"


def undecodable() -> None:
    """Write invalid UTF-8 (and a valid line after it) to stdout and stderr."""
    for fd in (1, 2):
        os.write(fd, BAD_BYTES + b"\n" + b"still fine\n" + BAD_BYTES)
    sys.exit(3)


def big_line(size: int) -> None:
    """One line of ``size`` bytes, then a short one."""
    os.write(1, b"<" + b"L" * (size - 2) + b">\n" + b"after the big line\n")


def idle_ready() -> None:
    """Say ready, then sit idle until stopped."""
    print("ready", flush=True)
    threading.Event().wait()


def one_line(rank: int, text: str) -> None:
    """Print ``"{text} from {rank}"``."""
    print(f"{text} from {rank}", flush=True)


def console_after_fork() -> None:
    """Print through aioelastic's console in a worker forked from a supervisor."""
    import anyio

    from aioelastic._core.output._console import console

    async def main() -> None:
        console("stdout").put(b"queued after the fork\n")
        await console("stdout").flush()

    anyio.run(main)


def fail_after_output(rank: int, fifo: str) -> None:
    """Both ranks print to stdout and stderr; rank 1 then raises, once rank 0 is done.

    Rank 0 opens ``fifo`` for writing after its output, rank 1 for reading before it
    fails: the open blocks until both are there, so rank 0 is never stopped early.
    """
    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    with open(fifo, "w" if rank == 0 else "r"):
        pass
    if rank == 1:
        raise RuntimeError(f"rank {rank} blew up")


# -- the supervisor ---------------------------------------------------------------------


_quiet = False


def _report(text: str) -> None:
    if not _quiet:
        os.write(2, f"@@{text}\n".encode())


async def _supervise(config: dict[str, Any]) -> dict[str, Any]:
    import anyio

    from aioelastic import ChildFailedError, Std, start_processes
    from aioelastic._core.output import _console

    if "high_water" in config:
        _console.HIGH_WATER = int(config["high_water"])
    if config.get("warm_console"):
        # Start the console's writer thread before any worker is forked.
        _console.console("stdout").put(b"console warmed up\n")
        await _console.console("stdout").flush()
    nprocs = int(config["nprocs"])
    per_rank_args = config.get("args") or [[] for _ in range(nprocs)]
    args = {r: tuple(per_rank_args[r]) for r in range(nprocs)}
    envs = {r: dict((config.get("envs") or {}).get(str(r), {})) for r in range(nprocs)}
    filt = config.get("local_ranks_filter")
    started = time.monotonic()
    ctx = start_processes(
        name=config.get("name", "w"),
        entrypoint=config["binary"] if "binary" in config else globals()[config["worker"]],
        args=args,
        envs=envs,
        log_dir=config.get("log_dir"),
        start_method=config.get("start_method", "spawn"),
        redirects=Std(config.get("redirects", 0)),
        tee=Std(config.get("tee", 0)),
        local_ranks_filter=None if filt is None else set(filt),
        log_line_prefix=config.get("log_line_prefix"),
        collapse_identical_lines=config.get("collapse_identical_lines"),
        grace_period=5.0,
    )
    async with ctx:
        _report(f"PIDS {json.dumps(ctx.pids())}")
        if config.get("stop_on_stdin"):
            await anyio.wait_readable(sys.stdin.fileno())
            _report(f"THREADS {json.dumps([t.name for t in threading.enumerate()])}")
            result = await ctx.wait(timeout=0)
            await ctx.close()
        else:
            result = await ctx.wait()
            _report(f"WAITED {time.monotonic() - started:.3f}")
    summary: dict[str, Any] = {"pids": ctx.pids(), "finished": result is not None}
    if result is not None:
        summary["stdouts"] = result.stdouts
        summary["stderrs"] = result.stderrs
        summary["failures"] = {
            rank: {"exitcode": f.exitcode, "message": f.message}
            for rank, f in result.failures.items()
        }
        if result.failures:
            summary["format_msg"] = ChildFailedError(ctx.name, result.failures).format_msg()
    return summary


def main(argv: list[str]) -> None:
    """``supervise CONFIG_JSON``: run a group of workers as the config says."""
    import anyio

    if argv[:1] == ["paced_blocks"]:  # the same worker as a program (binary workers)
        paced_blocks(int(argv[1]), int(argv[2]), float(argv[3]))
        return
    if argv[:1] != ["supervise"] or len(argv) != 2:
        raise SystemExit(f"usage: python -m tests.children.logs supervise CONFIG_JSON, got {argv}")
    config = json.loads(argv[1])
    global _quiet
    # With stdout and stderr on one pipe, a report written by this thread could land
    # inside a block of console lines; the test then relies on the exit alone.
    _quiet = bool(config.get("quiet"))
    summary = anyio.run(_supervise, config)
    Path(config["result"]).write_text(json.dumps(summary))
    _report("DONE")


if __name__ == "__main__":
    main(sys.argv[1:])
