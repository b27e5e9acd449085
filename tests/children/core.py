"""Worker programs for the core tests (function workers and ``python -m`` binaries)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any


def add(a: int, b: int) -> int:
    return a + b


def env_value(key: str) -> str | None:
    return os.environ.get(key)


def identity(value: Any) -> Any:
    return value


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def exit_with(code: int) -> None:
    sys.exit(code)


def hard_exit(code: int) -> None:
    os._exit(code)


def kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)


def big_value(size: int) -> bytes:
    return b"x" * size


def unpicklable() -> Any:
    return threading.Lock()


def _say(fifo: str, text: str) -> None:
    with open(fifo, "w") as f:
        f.write(text + "\n")


def block_forever(fifo: str, ignore_sigterm: bool = False) -> None:
    """Report ready, then block until signalled (optionally ignoring SIGTERM)."""
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _say(fifo, f"ready {os.getpid()}")
    threading.Event().wait()


def fail_after_ready(fifo: str, go_fifo: str) -> None:
    """Report ready, wait for the test's go (a FIFO it writes), then fail."""
    _say(fifo, f"ready {os.getpid()}")
    with open(go_fifo) as f:
        f.readline()
    raise RuntimeError("failed on purpose")


def grandchild_then(fifo: str, code: int, ignore_sigterm: bool = False) -> None:
    """Start a grandchild in our process group, report its pid, then exit ``code``.

    With ``code`` < 0, block instead of exiting.
    """
    preexec = None
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "1000"], preexec_fn=preexec)
    _say(fifo, f"grandchild {child.pid}")
    if code == 0:
        return
    if code > 0:
        os._exit(code)
    threading.Event().wait()


def print_and_raise(message: str) -> None:
    print("some output before failing", flush=True)
    raise KeyError(message)


def main() -> None:
    """``python -m tests.children.core COMMAND ARGS...`` for binary workers."""
    command, *args = sys.argv[1:]
    if command == "exit":
        sys.exit(int(args[0]))
    if command == "block":
        block_forever(args[0], ignore_sigterm=len(args) > 1 and args[1] == "ignore")
    if command == "grandchild":
        grandchild_then(args[0], int(args[1]))
    if command == "supervise":
        supervise(args[0], int(args[1]), args[2], float(args[3]))
        return
    if command == "subreaper":
        subreaper_demo(args[0])
        return
    if command == "echo-env":
        print(os.environ.get(args[0], "<unset>"))
        return
    raise SystemExit(f"unknown command {command!r}")


def behave(kind: str, *args: Any) -> Any:
    """One entrypoint, a behaviour per rank: ``args={0: ("raise", "x"), 1: ("block", fifo)}``."""
    actions = {
        "add": add,
        "raise": raise_value_error,
        "block": block_forever,
        "fail_after_ready": fail_after_ready,
        "exit": exit_with,
    }
    return actions[kind](*args)


def supervise(method: str, nprocs: int, fifo: str, hold_seconds: float) -> None:
    """A supervising process for parent-death tests.

    Starts ``nprocs`` blocking workers, prints ``pids <pid>...`` once they are ready,
    then (with ``hold_seconds`` > 0) keeps them past anyio's 10 s idle-thread retirement
    and prints ``alive`` or ``dead`` for them, or else waits to be killed.
    """
    import anyio

    import aioelastic

    async def run() -> None:
        ready_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        _keep_open = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # no hang-up spin
        if method == "binary":
            entry: Any = sys.executable
            args = {r: ("-m", "tests.children.core", "block", fifo) for r in range(nprocs)}
        elif method == "grandchildren":
            entry, args = grandchild_then, {r: (fifo, -1) for r in range(nprocs)}
        else:
            entry, args = block_forever, {r: (fifo,) for r in range(nprocs)}
        async with aioelastic.start_processes(
            "sup",
            entry,
            args,
            {r: {} for r in range(nprocs)},
            start_method="spawn" if method in ("binary", "grandchildren") else method,
        ) as ctx:
            seen = b""
            while seen.count(b"\n") < nprocs:
                await anyio.wait_readable(ready_fd)
                seen += os.read(ready_fd, 4096)
            reported = [int(w) for w in seen.split() if w.isdigit()]
            print("pids", *ctx.pids().values(), "|", *reported, flush=True)
            if hold_seconds <= 0:
                await anyio.sleep_forever()
            # Idle threads of anyio's pool retire after 10 s: make some, then outlive them.
            await anyio.to_thread.run_sync(lambda: None)
            await anyio.sleep(hold_seconds)
            alive = (
                all(
                    os.waitid(os.P_PID, p, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
                    for p in ctx.pids().values()
                )
                if method != "forkserver"
                else all(os.path.exists(f"/proc/{p}") for p in ctx.pids().values())
            )
            print("alive" if alive else "dead", flush=True)

    anyio.run(run)


def escape_group(fifo: str) -> None:
    """Start a grandchild in a new session (out of our process group), report it, block."""
    child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    _say(fifo, f"escaped {child.pid}")
    threading.Event().wait()


def subreaper_demo(fifo: str) -> None:
    """In subreaper mode, close a worker whose child escaped; print what survived."""
    import anyio

    import aioelastic

    async def run() -> None:
        assert aioelastic.enable_subreaper()
        ready_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        _keep_open = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        async with aioelastic.start_processes(
            "sub", escape_group, {0: (fifo,)}, {0: {}}, grace_period=2
        ):
            seen = b""
            while not seen.endswith(b"\n"):
                await anyio.wait_readable(ready_fd)
                seen += os.read(ready_fd, 4096)
            escaped = int(seen.split()[1])
        from tests.support.waits import process_state

        state = process_state(escaped) or "gone"
        print("escaped", escaped, state, flush=True)

    anyio.run(run)


def nested_supervisor(method: str) -> dict[int, int]:
    """A worker that supervises workers of its own (forked: it inherits our state)."""
    import anyio

    import aioelastic

    async def run() -> dict[int, int]:
        result = await aioelastic.run_processes(
            "inner", add, {0: (20, 1), 1: (20, 2)}, {0: {}, 1: {}}, start_method=method
        )
        return dict(result.return_values)

    return anyio.run(run)


#: The preload of the scripts that start workers on a warm fork server of their own.
SERVER_PRELOAD = ("tests.children.core",)


async def one_on_server(name: str, fn: Any, *args: Any) -> Any:
    """``run_processes`` of one worker ``fn(*args)`` on the fork server of SERVER_PRELOAD."""
    import aioelastic

    return await aioelastic.run_processes(
        name,
        fn,
        {0: args},
        {0: {}},
        start_method="forkserver",
        forkserver_preload=SERVER_PRELOAD,
    )


if __name__ == "__main__":
    main()


def whoami(key: str) -> dict[str, Any]:
    """What a worker is, as a fresh fork of its server would be: ids, env, signals, name."""
    with open("/proc/self/comm") as f:
        comm = f.read().rstrip("\n")
    return {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "ppid": os.getppid(),
        "env": os.environ.get(key),
        "sigint": getattr(signal.getsignal(signal.SIGINT), "__name__", None),
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "comm": comm,
        "cwd": os.getcwd(),
    }


def stdin_line() -> tuple[bool, str, int]:
    """Whether stdin is a terminal, the line read from it, and this worker's pid."""
    return os.isatty(0), sys.stdin.readline(), os.getpid()
