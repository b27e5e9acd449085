"""Worker programs, and a one-node agent program, for the elastic-agent tests.

Function workers (importable by spawned interpreters as ``tests.children.agent``) record
what they saw to ``out_dir`` as ``{tag}-{restart}-{rank}.json`` and may tell the test they
are running by connecting to its Unix socket (``notify``).

As a program::

    python -m tests.children.agent env OUT_DIR [TAG]    # a binary worker: dumps os.environ
    python -m tests.children.agent agent [options]      # one node: an elastic_launch agent

The agent program prints one ``EVENT {json}`` line per lifecycle event and, at the end,
``RESULT {json}`` (return values by global rank), then exits 0; a failed run exits 1 and
a signal 128+N.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

TORCHRUN_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
)


def _restart() -> int:
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def seen() -> dict[str, Any]:
    """The torchrun variables this worker sees, plus its pid and parent pid."""
    info: dict[str, Any] = {k: os.environ[k] for k in TORCHRUN_KEYS if k in os.environ}
    info["pid"] = os.getpid()
    info["ppid"] = os.getppid()
    return info


def record(out_dir: str, tag: str, data: dict[str, Any]) -> None:
    """Write ``data`` whole or not at all: a worker stopped mid-write (a sibling failed)
    must not leave an empty file for the test to read."""
    path = Path(out_dir) / f"{tag}-{_restart()}-{os.environ['RANK']}.json"
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def notify(address: str, payload: dict[str, Any]) -> None:
    """Tell the test something (a "ready" line) over its Unix socket."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(address)
        s.sendall(json.dumps(payload).encode() + b"\n")


def report(out_dir: str) -> dict[str, Any]:
    """Record and return what this worker saw; succeed."""
    info = seen()
    record(out_dir, "seen", info)
    return info


def fail_until(out_dir: str, restarts: int, local_rank: int, code: int) -> dict[str, Any]:
    """Local rank ``local_rank`` exits with ``code`` while fewer than ``restarts`` happened."""
    info = report(out_dir)
    if _restart() < restarts and int(os.environ["LOCAL_RANK"]) == local_rank:
        sys.exit(code)
    return info


def hold(address: str, ignore_sigterm: bool = False) -> None:
    """Say ready, then run until stopped (optionally deaf to SIGTERM)."""
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    notify(address, {"rank": int(os.environ["RANK"]), "pid": os.getpid()})
    threading.Event().wait()


def collective(out_dir: str, scenario: str) -> dict[str, Any]:
    """Join a gloo process group and all_reduce the ranks.

    Scenarios: ``once`` (all_reduce and return); ``restart`` (rank 1 exits 3 after the
    all_reduce of the first attempt); ``grow`` (below 4 workers, say ready and
    wait to be restarted at 4); ``lose_peer`` (at 4 workers, all_reduce once and say
    ready, then the workers of the node started with ``TEST_NODE=victim`` wait while the
    others block in a second all_reduce, which fails once the victim node is gone; at 2
    workers, return). "Say ready" is a `notify` to ``TEST_READY`` when that is set.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        if scenario == "grow" and world < 4:
            record(out_dir, "small", seen())
            _ready(rank)
            threading.Event().wait()
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        result = {**seen(), "sum": value.item()}
        record(out_dir, f"result-{world}", result)
        if scenario == "restart" and _restart() == 0 and rank == 1:
            sys.exit(3)
        if scenario == "lose_peer" and world == 4:
            record(out_dir, "ready", result)
            _ready(rank)
            if os.environ.get("TEST_NODE") == "victim":
                threading.Event().wait()
            dist.all_reduce(value)
            sys.exit(7)  # never reached: the victim's workers never join this one
        return result
    finally:
        dist.destroy_process_group()


def _ready(rank: int) -> None:
    address = os.environ.get("TEST_READY")
    if address:
        notify(address, {"rank": rank, "pid": os.getpid()})


def _event_json(event: Any) -> str:
    fields: dict[str, Any] = {"kind": event.kind}
    for name in (
        "timestamp",
        "attempt",
        "restart_count",
        "group_rank",
        "group_world_size",
        "world_size",
        "delay",
        "exitcode",
        "global_rank",
    ):
        if hasattr(event, name):
            fields[name] = getattr(event, name)
    for name in ("reason",):
        if hasattr(event, name):
            fields[name] = getattr(event, name).value
    if hasattr(event, "pids"):
        fields["pids"] = {str(k): v for k, v in event.pids.items()}
    return json.dumps(fields)


async def _run_agent(opts: argparse.Namespace) -> int:
    import anyio

    from aioelastic._core.aio._signals import SignalReceived
    from aioelastic._core.reports._failures import ChildFailedError
    from aioelastic._elastic.launch._elastic_launch import LaunchConfig, elastic_launch

    min_nodes, _, max_nodes = opts.nnodes.partition(":")
    conf: dict[str, Any] = {
        "join_timeout": 60,
        "last_call_timeout": opts.last_call,
        "close_timeout": 5,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3,
        "is_host": opts.host,
    }
    config = LaunchConfig(
        min_nodes=int(min_nodes),
        max_nodes=int(max_nodes or min_nodes),
        nproc_per_node=opts.nproc,
        run_id=opts.run_id,
        rdzv_endpoint=opts.endpoint,
        rdzv_backend="c10d",
        rdzv_configs=conf,
        max_restarts=opts.max_restarts,
        start_method="forkserver",
        forkserver_preload=("torch", "torch.distributed"),
        local_addr=opts.local_addr,
        log_dir=opts.log_dir,
        exit_barrier_timeout=30,
        shutdown_timeout=5,
    )
    launch = elastic_launch(config, collective)
    events = launch.events()

    async def show() -> None:
        async for event in events:
            print("EVENT", _event_json(event), flush=True)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(show)
            result = await launch(opts.out, opts.scenario)
    except ChildFailedError as e:
        print("FAILED", e.format_msg(), flush=True)
        return 1
    except SignalReceived as e:
        return e.exit_code
    print("RESULT", json.dumps({str(k): v for k, v in result.items()}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"]:
        name = "-".join([os.environ["RANK"], *argv[2:3]])
        path = Path(argv[1]) / f"{name}.json"
        path.write_text(json.dumps(dict(os.environ)))
        return 0
    if argv[:1] != ["agent"]:
        print(f"usage: python -m tests.children.agent env|agent ..., got {argv}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="tests.children.agent agent")
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--local-addr", default="127.0.0.1")
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--last-call", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--scenario", default="once")
    parser.add_argument("--out", required=True)
    parser.add_argument("--log-dir", required=True)
    opts = parser.parse_args(argv[1:])

    import anyio

    return anyio.run(_run_agent, opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
