"""Worker programs for the reliability tests: one configurable worker, and a supervisor.

A worker's behaviour is a plain dict (JSON for binary workers), so the soak can draw it at
random per rank. In order, a worker:

1. writes its planned output to the redirected streams (raw ``os.write`` of chunks cut at
   random places, so lines arrive split across writes), then says ``wrote <rank>``;
2. starts its grandchildren and says ``grandchild <rank> <pid>`` for each;
3. says ``ready <rank> <pid>`` — from here on the test may signal it;
4. does what its ``kind`` says: finish at once (``ok``, ``big``), wait for the test's
   SIGUSR1 and then fail (``exit``, ``raise``), or block until stopped (``sigkill``,
   ``hang``, ``ignore_term``, ``children``).

Every line to the FIFO is one ``write`` shorter than ``PIPE_BUF``, so lines of different
processes never interleave. The expected bytes of every stream are a function of the
plan alone (:func:`expected_output`), so the test can check each log file byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

#: Environment variable carrying a round's mark into every process the round starts.
ROUND_MARK = "AIOELASTIC_SOAK_ROUND"

#: Kinds that fail by themselves (once released by the test) and their exit codes.
FAULT_CODES = {"raise": 1, "sigkill": -signal.SIGKILL}


def say(fifo: str, text: str) -> None:
    """Write one line to the test's FIFO in a single ``write``."""
    data = (text + "\n").encode()
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def expected_output(stream: dict[str, Any]) -> bytes:
    """The exact bytes a worker writes for one stream's plan.

    ``stream`` holds ``lines`` (count), ``seed``, ``newline`` (whether the last line ends
    with one) and ``long`` (one line of that many bytes in the middle, or 0).
    """
    rng = random.Random(stream["seed"])
    tag = stream["tag"]
    lines = []
    for i in range(stream["lines"]):
        width = (
            stream["long"] if stream["long"] and i == stream["lines"] // 2 else rng.randrange(90)
        )
        lines.append(b"%s %d %s" % (tag.encode(), i, b"x" * width))
    data = b"\n".join(lines)
    if stream["newline"] and data:
        data += b"\n"
    return data


def _write_stream(fd: int, stream: dict[str, Any]) -> None:
    data = expected_output(stream)
    rng = random.Random(stream["seed"] + 1)
    view = memoryview(data)
    while view:
        # Chunks cut anywhere, so a line often arrives in several pieces.
        size = min(len(view), rng.choice((1, 7, 300, 4096, 65536, 200_000)))
        written = os.write(fd, view[:size])
        view = view[written:]


def _block(how: str) -> None:
    """Block in a blocking call of the given kind until a signal ends the process."""
    if how == "sleep":
        while True:
            time.sleep(3600)
    if how == "read":
        r, _w = os.pipe()  # we hold the write end: the read never sees end-of-file
        os.read(r, 1)
    if how == "select":
        while True:
            select.select([], [], [], 3600)
    threading.Event().wait()


def _wait_for_release() -> None:
    """Wait for the test's SIGUSR1 (blocked before ``ready``, so it cannot be missed)."""
    signal.sigwait({signal.SIGUSR1})


def _grandchildren(plan: dict[str, Any]) -> list[int]:
    """Start the planned grandchildren; return their pids."""
    pids = []
    for how in plan.get("children", ()):
        if how == "exec":
            # Inherits our stdout/stderr pipes: end-of-file then depends on teardown.
            pids.append(subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL).pid)
        elif how == "fork":
            pid = os.fork()
            if pid == 0:
                # A forked child that must never unwind into its parent's code (the worker
                # bootstrap): whatever ends it, SIGINT's KeyboardInterrupt included.
                try:
                    while True:
                        signal.pause()
                finally:
                    os._exit(0)
            pids.append(pid)
        elif how == "setsid":
            pids.append(
                subprocess.Popen(
                    ["sleep", "1000"],
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ).pid
            )
        elif how == "daemon":
            pids.append(_daemonize(plan["fifo"]))
    return pids


def _daemonize(fifo: str) -> int:
    """Classic double fork + setsid: the daemon is orphaned while we still run."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.close(w)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.execvp("sleep", ["sleep", "1000"])
        os.write(w, b"%d" % daemon)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        daemon_pid = int(f.read())
    os.waitpid(middle, 0)
    return daemon_pid


def run(plan: dict[str, Any]) -> Any:
    """Behave as ``plan`` says (see the module documentation); the function entrypoint."""
    rank, fifo, kind = plan["rank"], plan["fifo"], plan["kind"]
    if kind == "ignore_term":
        # Set before the grandchildren start: they inherit SIG_IGN across exec too.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if name in plan.get("output", {}):
            _write_stream(fd, plan["output"][name])
    if plan.get("output"):
        say(fifo, f"wrote {rank}")
    for pid in _grandchildren(plan):
        say(fifo, f"grandchild {rank} {pid}")
    # An "early" fault fires at once, maybe while its siblings are still being started.
    gated = (kind in ("exit", "raise") and not plan.get("early")) or plan.get("gate", False)
    if gated:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    say(fifo, f"ready {rank} {os.getpid()}")
    if gated:
        _wait_for_release()
    if kind == "exit":
        sys.exit(plan["code"])
    if kind == "raise":
        raise RuntimeError(f"soak fault in rank {rank}")
    if kind == "ok":
        return rank * 10
    if kind == "big":
        return big_value(plan["size"], plan["seed"])
    _block(plan.get("block", "event"))
    return None


def stop_while_publishing_error_file(fifo: str) -> None:
    """Record an error, but stop just before the error file gets its name; wait there.

    A profile hook catches the call that publishes the file (``os.replace``,
    ``os.rename`` or ``os.link``): at that moment the whole file is written, and a
    worker killed there is one killed at the worst moment for leftovers.
    """
    from aioelastic._core.child._error_file import write_error_file

    publishing = {os.replace, os.rename, os.link}

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg in publishing:
            sys.setprofile(None)
            say(fifo, f"publishing {os.getpid()}")
            threading.Event().wait()

    sys.setprofile(hook)
    write_error_file(os.environ["TORCHELASTIC_ERROR_FILE"], RuntimeError("recorded"))
    sys.setprofile(None)
    say(fifo, f"published {os.getpid()}")
    threading.Event().wait()


class _InterruptedFlush:
    """A stdout whose flush raises KeyboardInterrupt: a SIGINT arriving at that moment."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return int(self._stream.write(text))

    def flush(self) -> None:
        sys.stdout = self._stream  # once only, as a single signal would
        raise KeyboardInterrupt


def exit_interrupted_on_the_way_out(code: int) -> None:
    """``sys.exit(code)``; the process is interrupted while its stdio is flushed at exit.

    That is where ``close(death_sig=SIGINT)`` racing a worker's own exit can land: after
    the function ended, while the forked child flushes before ``os._exit``.
    """
    sys.stdout = _InterruptedFlush(sys.stdout)
    sys.exit(code)


def exit_0_on_sigterm(fifo: str) -> None:
    """A graceful worker: on SIGTERM it exits 0 at once (no return value); blocks until then."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    say(fifo, f"ready 0 {os.getpid()}")
    threading.Event().wait()


def big_value(size: int, seed: int) -> bytes:
    """A large return value whose content depends on ``seed``."""
    return random.Random(seed).randbytes(size)


def main() -> None:
    """``python -m tests.children.soak worker PLAN_JSON`` | ``supervise CONFIG_JSON``."""
    command, arg = sys.argv[1:3]
    if command == "worker":
        from aioelastic import record

        record(run)(json.loads(arg))
        return
    if command == "supervise":
        supervise(json.loads(arg))
        return
    raise SystemExit(f"unknown command {command!r}")


# -- a supervising process of its own -------------------------------------------------


def _leftovers(helpers: set[int], fds_before: set[int]) -> dict[str, Any]:
    """What this supervisor still holds after its context closed."""
    from aioelastic._core.process._platform import proc_stat

    me = os.getpid()
    zombies, live = [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = proc_stat(entry, 2)
        if fields is None:
            continue
        if int(fields[1]) != me or int(entry) in helpers:
            continue
        (zombies if fields[0] == b"Z" else live).append(int(entry))
    fds = set(map(int, os.listdir("/proc/self/fd"))) - fds_before
    return {"zombies": zombies, "live_children": live, "new_fds": sorted(fds)}


def supervise(config: dict[str, Any]) -> None:
    """Run one group as its own supervising process, as the soak's config says.

    Prints ``pids {json}`` once the workers started. Then, whichever comes first: the
    group's outcome, ``close`` on stdin, or a signal. At the end it prints
    ``report {json}`` (its failures and what it still holds) — unless a signal ended it
    abruptly (SIGTERM, SIGKILL: there is nothing to report then).
    """
    import anyio

    import aioelastic
    from aioelastic._core.start import _forkserver
    from aioelastic._core.start._watchdog import watchdog

    if config.get("subreaper"):
        assert aioelastic.enable_subreaper()
    elif config.get("kernel_subreaper_only"):
        # Adopt escaped descendants (kernel side) without aioelastic's subreaper mode, to
        # show what the default mode leaves behind — and still clean it up ourselves.
        from aioelastic._core.process import _platform

        assert _platform.set_child_subreaper()
    fds_before = set(map(int, os.listdir("/proc/self/fd")))
    report: dict[str, Any] = {"failures": None, "cancelled": False}

    def emit(tag: str, value: Any) -> None:
        sys.stdout.write(f"{tag} {json.dumps(value)}\n")
        sys.stdout.flush()

    async def close_on_request(ctx: aioelastic.PContext) -> None:
        os.set_blocking(0, False)
        data = b""
        while b"\n" not in data:
            await anyio.wait_readable(0)
            chunk = os.read(0, 100)
            if not chunk:
                return
            data += chunk
        # wait() in the other task returns once this close has stopped the group.
        await ctx.close(grace_period=config["grace"])

    async def supervise_group() -> None:
        entry: Any = run
        args = {r: (plan,) for r, plan in enumerate(config["plans"])}
        if config["method"] == "binary":
            entry = sys.executable
            args = {
                r: ("-m", "tests.children.soak", "worker", json.dumps(plan))
                for r, plan in enumerate(config["plans"])
            }
        ctx = aioelastic.start_processes(
            "sup",
            entry,
            args,
            {r: {} for r in args},
            log_dir=config["log_dir"],
            start_method="spawn" if config["method"] == "binary" else config["method"],
            redirects={r: aioelastic.Std(v) for r, v in enumerate(config["redirects"])},
            grace_period=config["grace"],
        )
        async with ctx, anyio.create_task_group() as tg:
            emit("pids", ctx.pids())
            tg.start_soon(close_on_request, ctx)
            result = await ctx.wait()
            tg.cancel_scope.cancel()
        assert result is not None
        report["failures"] = {r: f.exitcode for r, f in result.failures.items()}

    try:
        anyio.run(supervise_group)
    except KeyboardInterrupt:
        report["cancelled"] = True
    except asyncio.CancelledError:
        # Python 3.10's asyncio has no Runner: a Ctrl-C inside anyio.run/asyncio.run
        # cancels the main task and surfaces as CancelledError instead of
        # KeyboardInterrupt (docs/reliability.md). The teardown ran all the same.
        if sys.version_info >= (3, 11):
            raise
        report["cancelled"] = True
    helpers = set(_forkserver.running_server_pids())
    if watchdog.pid is not None:
        helpers.add(watchdog.pid)
    helper_fds = set(_forkserver.open_server_fds())
    if watchdog.fileno() is not None:
        helper_fds.add(watchdog.fileno())  # type: ignore[arg-type]
    left = _leftovers(helpers, fds_before | helper_fds)
    if config.get("kernel_subreaper_only"):
        # The escaped descendants are our children now (kernel subreaper): report the
        # ones still running, then stop and reap them so that nothing outlives the test.
        left["escaped_alive"] = left.pop("live_children")
        for pid in left["escaped_alive"]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    report.update(left)
    emit("report", report)
    if report["cancelled"]:
        sys.exit(130)


if __name__ == "__main__":
    main()
