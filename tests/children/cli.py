"""Scripts the CLI tests launch, as a user would: ``aioelastic-run ... tests/children/cli.py CMD``.

Runs as a plain script (no ``@record``, no aioelastic import: what torchrun users have) or
as a module (``-m tests.children.cli CMD``). Only the standard library is imported, except
by ``ddp``, which imports torch. Every command that a test will signal prints a ``ready``
line (with its pids) first, and the test waits for that line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

_SLEEPER = (
    "import signal, time\n"
    "for s in (signal.SIGTERM, signal.SIGINT):\n"
    "    signal.signal(s, signal.SIG_IGN)\n"
    "print('ignoring', flush=True)\n"
    "time.sleep(3600)"
)

# A trainer's helper (a data-loader process): answers "saved <request>" to each line on its
# stdin, then, once that closes, waits to be signalled (only a signal ends it).
_HELPER = (
    "import signal, sys\n"
    "if sys.argv[1] == 'ignore':\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('helper ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    print('saved ' + line.strip(), flush=True)\n"
    "while True:\n"
    "    signal.pause()\n"
)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _wait_forever() -> None:
    while True:
        signal.pause()


def cmd_env(args: argparse.Namespace) -> None:
    """Print the worker's environment as one JSON line, ``ENV {...}``."""
    del args
    keys = [
        k
        for k in os.environ
        if k.startswith(("RANK", "LOCAL_", "GROUP_", "ROLE_", "WORLD_", "MASTER_", "TORCHELASTIC_"))
        or k == "OMP_NUM_THREADS"
    ]
    print("ENV " + json.dumps({k: os.environ[k] for k in sorted(keys)}), flush=True)


def cmd_ddp(args: argparse.Namespace) -> None:
    """Train a small model with DDP over gloo; rank 0 writes the final parameters."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"ddp rank={rank} world={world}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args.steps):
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        params = [p.detach().double().flatten().tolist() for p in model.parameters()]
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"world_size": world, "params": params}, f)
        os.replace(tmp, args.out)
    # Without it a fast rank 0 may exit while gloo still talks to rank 1, which then dies
    # in std::terminate (under torchrun too).
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo can abort in a C++ destructor at interpreter exit ("terminate
    # called without an active exception"), under torchrun as under us: the work is done
    # and written, so leave without running those destructors.
    sys.stdout.flush()
    os._exit(0)


def cmd_fail(args: argparse.Namespace) -> None:
    """Rank ``--rank`` fails as ``--how`` says; the others print ready and wait to be stopped."""
    if _rank() != args.rank:
        print(f"ready rank={_rank()} pid={os.getpid()}", flush=True)
        _wait_forever()
    if args.wait_for_file:
        # Fail only once the test saw every rank ready, so the root cause is this rank.
        while not os.path.exists(args.wait_for_file):
            time.sleep(0.01)
    if args.how == "raise":
        raise ValueError(f"deliberate failure in rank {_rank()}")
    if args.how == "exit":
        print(f"rank {_rank()} exits with {args.code}", file=sys.stderr, flush=True)
        sys.exit(args.code)
    os.kill(os.getpid(), getattr(signal, args.how))
    _wait_forever()


def cmd_flaky(args: argparse.Namespace) -> None:
    """Rank 0 exits 3 on the first ``--fail-times`` attempts; every attempt is printed."""
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"attempt restart_count={restart} rank={_rank()}", flush=True)
    if _rank() == 0 and restart < args.fail_times:
        sys.exit(args.code)


def cmd_hold(args: argparse.Namespace) -> None:
    """Start a child that ignores SIGTERM and SIGINT, print ``ready`` with both pids, wait.

    With ``--ignore-signals`` the worker ignores them too, so only SIGKILL stops it. With
    ``--escape`` the child leaves the worker's process group (a new session), out of reach
    of signals sent to the group. The ``ready`` line also goes to the FIFO ``--ready``.
    """
    if args.ignore_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    child = subprocess.Popen(
        [sys.executable, "-c", _SLEEPER], stdout=subprocess.PIPE, start_new_session=args.escape
    )
    assert child.stdout is not None
    child.stdout.readline()  # its handlers are in place: a signal from now on is ignored
    _ready(args, f"ready rank={_rank()} pid={os.getpid()} child={child.pid}")
    _wait_forever()


def cmd_checkpoint(args: argparse.Namespace) -> None:
    """Checkpoint on SIGTERM with a helper's help, as a trainer with data-loader workers does.

    Starts a helper child (in the worker's process group), prints ``ready`` with both pids
    (also to the FIFO ``--ready``, if given) and waits. On SIGTERM it asks the helper to
    save, waits for the answer, writes it (``saved step <rank>``, or ``helper gone`` when
    the helper was stopped with it) to ``<--out>/rank<rank>`` and exits 0. With
    ``--helper-ignores-term`` the helper ignores SIGTERM.
    """
    helper = subprocess.Popen(
        [sys.executable, "-c", _HELPER, "ignore" if args.helper_ignores_term else "default"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert helper.stdin is not None
    assert helper.stdout is not None
    helper.stdout.readline()  # its handlers are in place

    def save(signum: int, frame: object) -> None:
        assert helper.stdin is not None
        assert helper.stdout is not None
        try:
            helper.stdin.write(f"step {_rank()}\n")
            helper.stdin.flush()
            answer = helper.stdout.readline().strip() or "helper gone"
        except BrokenPipeError:
            answer = "helper gone"
        with open(os.path.join(args.out, f"rank{_rank()}"), "w") as f:
            f.write(answer)
        os._exit(0)

    signal.signal(signal.SIGTERM, save)
    _ready(args, f"ready rank={_rank()} pid={os.getpid()} child={helper.pid}")
    _wait_forever()


def _ready(args: argparse.Namespace, line: str) -> None:
    """Say ``line`` on stdout, and to the FIFO ``--ready`` when one is given."""
    print(line, flush=True)
    if args.ready:
        with open(args.ready, "w") as fifo:
            fifo.write(line + "\n")


def cmd_catch(args: argparse.Namespace) -> None:
    """Print ``ready``, then print which signal arrived (SIGINT, SIGTERM, SIGUSR1) and exit 0."""

    def caught(signum: int, frame: object) -> None:
        print(f"caught {signal.Signals(signum).name} rank={_rank()}", flush=True)
        os._exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, caught)
    print(f"ready rank={_rank()} pid={os.getpid()}", flush=True)
    _wait_forever()


def cmd_job(args: argparse.Namespace) -> None:
    """A trainer as a scheduler's signals find it: print ``ready``, then wait for a signal.

    On SIGTERM: write ``<--out>/term<rank>`` (its handler ran), save for ``--save``
    seconds (a checkpoint the grace period must cover), write ``<--out>/saved<rank>``,
    exit 0; a second SIGTERM meanwhile changes nothing. On SIGUSR1 (a checkpoint request):
    print ``handled SIGUSR1 rank=R``, write ``<--out>/usr1<rank>`` and exit 0, the job's
    normal end.
    """
    saving = False

    def mark(name: str) -> None:
        with open(os.path.join(args.out, f"{name}{_rank()}"), "w") as f:
            f.write(str(os.getpid()))

    def on_term(signum: int, frame: object) -> None:
        nonlocal saving
        if saving:
            return
        saving = True
        mark("term")
        time.sleep(args.save)  # the checkpoint's work
        mark("saved")
        os._exit(0)

    def on_usr1(signum: int, frame: object) -> None:
        print(f"handled SIGUSR1 rank={_rank()}", flush=True)
        mark("usr1")
        sys.exit(0)  # the end of the script: a --run-path worker's too

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_usr1)
    print(f"ready rank={_rank()} pid={os.getpid()}", flush=True)
    _wait_forever()


def cmd_lines(args: argparse.Namespace) -> None:
    """Write ``--count`` lines to stdout and stderr; rank ``--fail-rank`` then raises.

    With ``--sync-dir``, the failing rank waits until every other rank wrote its lines, so
    that the launcher does not stop them half-way.
    """
    for i in range(args.count):
        print(f"out rank={_rank()} line={i}", flush=True)
        print(f"err rank={_rank()} line={i}", file=sys.stderr, flush=True)
    if args.sync_dir:
        os.makedirs(args.sync_dir, exist_ok=True)
        open(os.path.join(args.sync_dir, str(_rank())), "w").close()
    if _rank() == args.fail_rank:
        others = int(os.environ["WORLD_SIZE"])
        while args.sync_dir and len(os.listdir(args.sync_dir)) < others:
            time.sleep(0.01)
        raise RuntimeError(f"filtered rank {_rank()} failed")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env")
    ddp = sub.add_parser("ddp")
    ddp.add_argument("--steps", type=int, default=20)
    ddp.add_argument("--out", required=True)
    fail = sub.add_parser("fail")
    fail.add_argument("--rank", type=int, default=0)
    fail.add_argument("--how", default="raise", help="raise, exit, or a signal name")
    fail.add_argument("--code", type=int, default=7)
    fail.add_argument("--wait-for-file", default="")
    flaky = sub.add_parser("flaky")
    flaky.add_argument("--fail-times", type=int, default=1)
    flaky.add_argument("--code", type=int, default=3)
    hold = sub.add_parser("hold")
    hold.add_argument("--ignore-signals", action="store_true")
    hold.add_argument("--escape", action="store_true")
    hold.add_argument("--ready", default="")
    checkpoint = sub.add_parser("checkpoint")
    checkpoint.add_argument("--out", required=True)
    checkpoint.add_argument("--ready", default="")
    checkpoint.add_argument("--helper-ignores-term", action="store_true")
    sub.add_parser("catch")
    job = sub.add_parser("job")
    job.add_argument("--out", required=True)
    job.add_argument("--save", type=float, default=0.0)
    lines = sub.add_parser("lines")
    lines.add_argument("--count", type=int, default=3)
    lines.add_argument("--fail-rank", type=int, default=-1)
    lines.add_argument("--sync-dir", default="")
    args = parser.parse_args(argv)
    {
        "env": cmd_env,
        "ddp": cmd_ddp,
        "catch": cmd_catch,
        "checkpoint": cmd_checkpoint,
        "fail": cmd_fail,
        "flaky": cmd_flaky,
        "hold": cmd_hold,
        "job": cmd_job,
        "lines": cmd_lines,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
