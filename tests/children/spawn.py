"""Workers and programs for tests/compat/test_spawn.py and tests/compat/test_launch.py.

Functions named ``spawn_*`` are `aioelastic.spawn` workers (called ``fn(i, *args)``);
``launch_*`` are `aioelastic.launch` workers (called ``func(args)``); ``torch_*`` run a
gloo all_reduce. Run as a program (``python -m tests.children.spawn launch-until-signal
DIR [--stubborn] [--grace SECONDS]``) it runs `launch` until it is signalled and reports,
on stdout, what a user would see.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _block() -> None:
    """Wait to be stopped; a Python signal handler still runs between sleeps."""
    while True:
        time.sleep(3600)


# --- spawn workers: fn(i, *args) ---------------------------------------------------------


def spawn_scaled(i: int, factor: int) -> int:
    return i * factor


def spawn_raise_at(i: int, bad: int) -> None:
    if i == bad:
        raise ValueError(f"worker {i} failed on purpose")
    _block()


def spawn_exit_at(i: int, bad: int, code: int) -> None:
    if i == bad:
        sys.exit(code)
    _block()


def spawn_sigkill_at(i: int, bad: int) -> None:
    if i == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    _block()


def spawn_stubborn_sibling(i: int, fifo: str) -> None:
    """Rank 1 ignores SIGTERM, then tells rank 0 (through ``fifo``) to fail."""
    if i == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(fifo, "w") as f:
            f.write("ignoring SIGTERM\n")
        _block()
    with open(fifo) as f:
        f.readline()
    raise RuntimeError("rank 0 fails once rank 1 ignores SIGTERM")


# --- launch workers: func(args) ----------------------------------------------------------


def launch_env(args: Any) -> dict[str, Any]:
    return {"args": args, **{name: os.environ.get(name) for name in LAUNCH_ENV}}


def launch_env_when_told(fifos: tuple[str, str]) -> dict[str, str | None]:
    """Say ready through one fifo, wait for "go" on the other, then report the env."""
    ready, go = fifos
    with open(ready, "w") as f:
        f.write("ready\n")
    with open(go) as f:
        f.readline()
    return {name: os.environ.get(name) for name in LAUNCH_ENV}


def launch_exit_at(args: tuple[int, int]) -> None:
    bad, code = args
    if int(os.environ["RANK"]) == bad:
        sys.exit(code)
    _block()


def launch_report_and_block(args: tuple[str, bool]) -> None:
    """Write our pid and a grandchild's pid to ``{dir}/{rank}.pid``, say ready, block.

    With ``stubborn`` SIGTERM is reported and ignored, so only SIGKILL stops us.
    """
    directory, stubborn = args
    rank = os.environ["RANK"]
    if stubborn:

        def on_term(signum: int, frame: FrameType | None) -> None:
            print(f"sigterm {rank}", flush=True)

        signal.signal(signal.SIGTERM, on_term)
    grandchild = subprocess.Popen(["sleep", "3600"])
    Path(directory, f"{rank}.pid").write_text(f"{os.getpid()} {grandchild.pid}\n")
    print(f"ready {rank}", flush=True)
    _block()


# --- torch workers ------------------------------------------------------------------------


def _all_reduce_rank_plus_one(rank: int, world_size: int, init_method: str) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return float(t.item())
    finally:
        dist.destroy_process_group()


def torch_spawn_all_reduce(i: int, world_size: int, port: int) -> float:
    return _all_reduce_rank_plus_one(i, world_size, f"tcp://127.0.0.1:{port}")


def torch_launch_all_reduce(args: None) -> float:
    # env:// reads exactly the variables launch sets.
    return _all_reduce_rank_plus_one(
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
    )


# --- programs -----------------------------------------------------------------------------


def _custom_sigterm(signum: int, frame: FrameType | None) -> None:
    print("custom SIGTERM handler", flush=True)


async def _launch_until_signal(directory: str, stubborn: bool, grace: float) -> int:
    from aioelastic._compat._launch import MainProcessError, launch

    sigint_in_loop = signal.getsignal(signal.SIGINT)  # asyncio.Runner's own handler
    status = 0
    try:
        await launch(launch_report_and_block, (directory, stubborn), nprocs=2, grace_period=grace)
    except MainProcessError as e:
        print(f"MainProcessError signal_no={e.signal_no}: {e}", flush=True)
        status = 128 + e.signal_no
    else:
        print("launch returned without a signal", flush=True)
    print(f"SIGINT restored in loop: {signal.getsignal(signal.SIGINT) is sigint_in_loop}")
    print(f"SIGTERM restored: {signal.getsignal(signal.SIGTERM) is _custom_sigterm}")
    pids = [int(p) for f in Path(directory).glob("*.pid") for p in f.read_text().split()]
    from tests.support.waits import is_running

    print(f"checked {len(pids)} pids, alive: {[p for p in pids if is_running(p)]}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.children.spawn")
    sub = parser.add_subparsers(dest="command", required=True)
    until = sub.add_parser("launch-until-signal")
    until.add_argument("directory")
    until.add_argument("--stubborn", action="store_true")
    until.add_argument("--grace", type=float, default=30.0)
    opts = parser.parse_args(argv)

    # Whatever the test runner left us (a background job starts with SIGINT ignored),
    # start from Python's defaults plus one custom handler that launch must give back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _custom_sigterm)
    status = asyncio.run(_launch_until_signal(opts.directory, opts.stubborn, opts.grace))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        print("SIGINT after launch: nothing happened", flush=True)
    except KeyboardInterrupt:
        print("SIGINT after launch: KeyboardInterrupt", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
