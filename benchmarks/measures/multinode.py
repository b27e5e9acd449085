"""k. Several nodes: how long the other launchers of a job take to end after a failure.

Each repetition starts three launchers of one job on this machine, node i on 127.0.0.(i+1)
(``--nnodes 3 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
--local-addr 127.0.0.(i+1)``, ``--rdzv-conf is_host=1`` for node 0, the store's host, and
``is_host=0`` for the others), each in a session of its own as on separate machines, all
running :mod:`benchmarks.programs._multinode_job`. Once every rank said ready (a FIFO), one of:

- ``exit``: the last rank of node 2 exits 7 while every other rank blocks silently, as
  NCCL ranks do when a peer dies; ``--max-restarts 0``. Time: the failing rank's stamp,
  right before its exit, to the last of the three launchers' exits.
- ``gloo``: the same, but the other ranks wait in a gloo ``all_reduce``, which notices the
  dead peer: the backend tells every node, whatever the launcher does.
- ``kill``: node 2's launcher and workers SIGKILLed (a machine lost) while every rank
  blocks silently. Time: the first kill to the last exit of nodes 0 and 1.
- ``store``: node 0, the c10d store's host, SIGKILLed (launcher and workers) while every
  rank blocks silently: the documented single point of failure of c10d. Time: the kill to
  the last exit of nodes 1 and 2 (ours: the store given ``STORE_LOST_AFTER``, 10 s, to
  answer, as an etcd election needs).
- ``term``: node 1's launcher gets SIGTERM while every rank blocks silently. Time: the
  signal to the last exit of nodes 0 and 2.
- ``recover`` and ``recover-silent``: an elastic job (``--nnodes 2:3 --max-restarts 3``)
  loses node 2 (SIGKILLed, as in ``kill``) while the other ranks wait in a gloo
  ``all_reduce`` (``recover``) or block silently (``recover-silent``). Time (*recovered*):
  the kill to the last rank of nodes 0 and 1 back in user code in the next attempt.
  Each side runs at its defaults and, in a row of its own, both tuned alike as a
  knowledgeable user would (``keep_alive_interval=1,keep_alive_max_attempt=2,
  last_call_timeout=1``: a lost node forgotten after 2 s, the round closed 1 s after the
  survivors are in).

*seconds*: to the last watched launcher's exit; *stopped*: to the last of their ranks'
exits (when their devices would be free again). Exits are seen through pidfds, readiness
through a FIFO: nothing sleeps or polls a clock. A repetition whose watched launchers have
not all ended ``cap`` seconds after the event is stopped (every launcher's session and
every worker SIGKILLed) and reported as ``> cap``: torchrun's launchers are expected never
to end in ``exit``, ``kill`` and ``term``, as a node learns of another's failure only
through its own workers.

torch's side is torchrun at its fastest poll, ``--monitor-interval 0.01`` (default 0.1 s).
It needs no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` here (see :mod:`.launcher`): with
``--max-restarts 0`` there is one round, so no attempt can read a previous one's keys.
Ours runs with its defaults.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aioelastic._core.process._platform import proc_stat
from benchmarks.harness._spec import (
    Claim,
    Group,
    Measure,
    Metric,
    RepContext,
    RepTimeout,
    Row,
    System,
)
from benchmarks.measures._common import runnable
from benchmarks.programs._clock import now_ns, read_stamp, seconds
from benchmarks.programs._ready import make_fifo

JOB = Path(__file__).resolve().parents[1] / "programs" / "_multinode_job.py"
NODES = 3
#: The node whose rank fails (``exit``, ``gloo``) or that is SIGKILLed (``kill``), and the
#: one stopped by SIGTERM (``term``): neither hosts the store, which would take the
#: rendezvous away from the others.
FAILING_NODE = 2
TERMINATED_NODE = 1
#: The headline: the event to the last watched launcher's exit.
ENDED = Metric("seconds", "ms to every launcher's exit", scale=1000.0)
#: The event to the last watched worker's exit: when their devices would be free again.
STOPPED = Metric("stopped", "ms to every rank stopped", scale=1000.0)
#: A lost node to every surviving rank back in user code (the ``recover`` cases).
RECOVERED = Metric("recovered", "ms to every survivor back in user code", scale=1000.0)
#: The elastic cases: the cases where the job goes on without the lost node.
RECOVER_CASES = ("recover", "recover-silent")
#: How long three launchers may take to have every rank ready (torch imports in ``gloo``).
START_LIMIT_S = 120.0


@dataclass
class _Node:
    """One launcher of the job: its process, exit watches on it and its workers, its log.

    Attributes:
        index: the node's place in the job (0 hosts the store); ``BENCH_NODE``.
        proc: the launcher.
        pidfd: readable once the launcher has exited.
        log: the launcher's stdout and stderr.
        workers: pidfds of its workers, opened once every rank said ready.
    """

    index: int
    proc: subprocess.Popen[bytes]
    pidfd: int
    log: Path
    workers: list[int] = field(default_factory=list)

    def tail(self, lines: int = 15) -> str:
        """The end of the launcher's output, for an error message."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        code = "" if self.proc.returncode is None else f" (exit {self.proc.returncode})"
        return f"node {self.index}{code}:\n" + "\n".join(text.splitlines()[-lines:])


def _command(ctx: RepContext, module: str, node: int, endpoint: str, run_id: str) -> list[str]:
    case = ctx.str_param("case")
    elastic = case in RECOVER_CASES
    conf = ",".join([f"is_host={int(node == 0)}", *filter(None, [str(ctx.params.get("conf", ""))])])
    return [
        sys.executable,
        "-m",
        module,
        f"--nnodes={NODES - 1}:{NODES}" if elastic else f"--nnodes={NODES}",
        f"--nproc-per-node={ctx.n}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
        f"--local-addr=127.0.0.{node + 1}",
        f"--max-restarts={3 if elastic else 0}",
        *str(ctx.params.get("flags", "")).split(),
        str(JOB),
        str(ctx.workdir),
        "gloo" if case in ("gloo", "recover") else "silent",
        str(FAILING_NODE if case in ("exit", "gloo") else -1),
    ]


def _start(ctx: RepContext, module: str, nodes: list[_Node]) -> None:
    """Start the launchers, each added to ``nodes`` as soon as it runs (for the cleanup)."""
    from aioelastic import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    run_id = uuid.uuid4().hex[:12]
    for index in range(NODES):
        log = ctx.workdir / f"node{index}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                _command(ctx, module, index, endpoint, run_id),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "BENCH_NODE": str(index)},
                # A node of several: its signals, and a kill of its session, reach no other.
                start_new_session=True,
            )
        nodes.append(_Node(index, proc, os.pidfd_open(proc.pid), log))


def _wait_ready(ready_fd: int, count: int, nodes: list[_Node]) -> None:
    """Block until ``count`` ranks said ready; raise if a launcher exits first."""
    poller = select.poll()
    poller.register(ready_fd, select.POLLIN)
    by_fd = {node.pidfd: node for node in nodes}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    deadline = now_ns() + int(START_LIMIT_S * 1e9)
    got = 0
    while got < count:
        remaining_ms = (deadline - now_ns()) // 1_000_000
        if remaining_ms <= 0:
            raise RuntimeError(
                f"{got} of {count} ranks ready after {START_LIMIT_S:g} s:\n"
                + "\n".join(n.tail() for n in nodes)
            )
        for fd, _ in poller.poll(remaining_ms):
            if fd == ready_fd:
                got += len(os.read(ready_fd, count - got))
            else:
                raise RuntimeError(
                    f"a launcher exited before its ranks were ready: {by_fd[fd].tail()}"
                )


def _open_workers(ctx: RepContext, node: _Node) -> None:
    """Watch the node's workers, by the pids they wrote before saying ready.

    Called once every rank said ready (all blocked, so alive), and after a failed start
    for the ranks that got as far as their pid: a missing or half-written file is a rank
    that did not.
    """
    for local_rank in range(ctx.n):
        try:
            pid = int((ctx.workdir / f"pid{node.index}.{local_rank}").read_text())
            node.workers.append(os.pidfd_open(pid))
        except (FileNotFoundError, ValueError, ProcessLookupError):
            continue


def _wait_exits(fds: list[int], deadline_ns: int) -> dict[int, int] | None:
    """When the kernel reported each process's exit (pidfd -> ns); None at the deadline."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ended: dict[int, int] = {}
    while len(ended) < len(fds):
        remaining_ms = -(-(deadline_ns - now_ns()) // 1_000_000)
        if remaining_ms <= 0:
            return None
        events = poller.poll(remaining_ms)
        seen = now_ns()
        for fd, _ in events:
            poller.unregister(fd)
            ended[fd] = seen
    return ended


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (from ``/proc``; its leader must not be reaped yet)."""
    members = []
    for entry in os.listdir("/proc"):
        fields = proc_stat(entry, 4) if entry.isdigit() else None
        if fields is not None and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def _kill_node(node: _Node) -> None:
    """SIGKILL the launcher, then the rest of its session, then its workers.

    The launcher first: a launcher that saw its workers die first would report their
    failure, which a lost machine never does. torchrun starts each worker in a session of
    its own, hence the workers by pidfd.
    """
    leader = node.proc.pid
    for pid in sorted(_session(leader), key=lambda pid: pid != leader):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for fd in node.workers:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)


@contextlib.contextmanager
def _job(ctx: RepContext, module: str) -> Iterator[list[_Node]]:
    """The three launchers, every rank ready; on the way out, whatever is left killed."""
    ready_fd = os.open(make_fifo(ctx.workdir / "ready"), os.O_RDWR | os.O_NONBLOCK)
    nodes: list[_Node] = []
    try:
        try:
            make_fifo(ctx.workdir / "go")
            make_fifo(ctx.workdir / "back")
            _start(ctx, module, nodes)
            _wait_ready(ready_fd, NODES * ctx.n, nodes)
        finally:
            for node in nodes:
                _open_workers(ctx, node)
        yield nodes
    finally:
        for node in nodes:
            # A launcher not reaped yet: its session id is still its own (see _session).
            _kill_node(node)
            node.proc.wait()
            for fd in (node.pidfd, *node.workers):
                os.close(fd)
        os.close(ready_fd)


def _run(ctx: RepContext, module: str) -> dict[str, float]:
    case = ctx.str_param("case")
    cap = ctx.float_param("cap")
    with _job(ctx, module) as nodes:
        if case in ("exit", "gloo"):
            go = os.open(ctx.workdir / "go", os.O_RDWR)
            started = now_ns()
            os.write(go, b"g")
            os.close(go)
            watched = nodes
        elif case == "kill":
            victim = nodes[FAILING_NODE]
            started = now_ns()
            _kill_node(victim)
            watched = [n for n in nodes if n is not victim]
        elif case in RECOVER_CASES:
            return _recover(ctx, nodes, cap)
        elif case == "store":
            victim = nodes[0]
            started = now_ns()
            _kill_node(victim)
            watched = [n for n in nodes if n is not victim]
        elif case == "term":
            victim = nodes[TERMINATED_NODE]
            started = now_ns()
            victim.proc.send_signal(signal.SIGTERM)
            watched = [n for n in nodes if n is not victim]
        else:
            raise ValueError(
                f"unknown case {case!r}; expected exit, gloo, kill, term, recover or recover-silent"
            )
        launchers = [n.pidfd for n in watched]
        workers = [fd for n in watched for fd in n.workers]
        ended = _wait_exits(launchers + workers, started + int(cap * 1e9))
        if ended is None:
            raise RepTimeout(cap)
        if case in ("exit", "gloo"):
            started = read_stamp(ctx.workdir / "fail")
    # Reaped only now: until then every launcher's pid, and so its session id, is its own.
    if any(n.proc.returncode == 0 for n in watched):
        raise RuntimeError(
            "a launcher whose ranks never finish exited 0:\n" + "\n".join(n.tail() for n in nodes)
        )
    return {
        "seconds": seconds(max(ended[fd] for fd in launchers) - started),
        "stopped": seconds(max(ended[fd] for fd in workers) - started),
    }


def _recover(ctx: RepContext, nodes: list[_Node], cap: float) -> dict[str, float]:
    """Lose node 2; the kill to the last rank of nodes 0 and 1 back in user code."""
    back_fd = os.open(ctx.workdir / "back", os.O_RDWR | os.O_NONBLOCK)
    try:
        victim = nodes[FAILING_NODE]
        survivors = [n for n in nodes if n is not victim]
        started = now_ns()
        _kill_node(victim)
        poller = select.poll()
        poller.register(back_fd, select.POLLIN)
        deadline = started + int(cap * 1e9)
        got = 0
        while got < len(survivors) * ctx.n:
            remaining_ms = -(-(deadline - now_ns()) // 1_000_000)
            if remaining_ms <= 0:
                raise RepTimeout(cap)
            if poller.poll(remaining_ms):
                got += len(os.read(back_fd, len(survivors) * ctx.n - got))
    finally:
        os.close(back_fd)
    backs = [
        read_stamp(ctx.workdir / f"back{n.index}.{rank}")
        for n in survivors
        for rank in range(ctx.n)
    ]
    return {"recovered": seconds(max(backs) - started)}


def aio_run(ctx: RepContext) -> dict[str, float]:
    """Three ``python -m aioelastic.run`` launchers."""
    return _run(ctx, runnable("aioelastic.run"))


def torchrun(ctx: RepContext) -> dict[str, float]:
    """Three ``python -m torch.distributed.run`` launchers (torchrun)."""
    return _run(ctx, "torch.distributed.run")


_M = "benchmarks.measures.multinode"
TORCHRUN = "torchrun --monitor-interval 0.01"
#: Longest wait for the launchers to end, from the event; a repetition over it is ``> CAP``.
CAP_S = 60.0
#: The same under ``--quick``, long enough for ours (about 2 s in ``exit`` and ``term``).
QUICK_CAP_S = 10.0


def _group(case: str, title: str, *, quick: bool) -> Group:
    """Both launchers on one case; ``quick``: in ``--quick`` too, its claim checked there.

    The claim (ratio >= 1) is that our launchers all end within the cap, before torchrun's:
    a side that never ends has no median, so a regression that leaves a node running
    fails the check.
    """
    return Group(
        name=case,
        systems=(
            System("aioelastic-run", "aioelastic", f"{_M}:aio_run", quick=quick),
            System(
                TORCHRUN,
                "torch",
                f"{_M}:torchrun",
                {"flags": "--monitor-interval 0.01"},
                quick=quick,
            ),
        ),
        rows=(
            Row(
                title,
                "aioelastic-run",
                TORCHRUN,
                # Recorded: a lower bound set by the full run's 60 s cap (torchrun's
                # launchers never ended); under --quick's 10 s cap the same outcome is a
                # ratio of about 5. What is claimed is the outcome: >= 1, ours ended first.
                quick_min_ratio=Claim(2, recorded=None, target=1.0) if quick else None,
                metrics=("seconds", "stopped"),
            ),
        ),
        ns=(2,),
        quick_ns=(2,),
        default_reps=3,
        params={"case": case, "cap": CAP_S},
        quick_params={"cap": QUICK_CAP_S},
        # Every repetition starts fresh launchers: no warm state to discard first.
        warmup=False,
        rep_timeout=CAP_S + START_LIMIT_S + 60.0,
    )


#: torch's dynamic rendezvous tuned for a fast recovery: a lost node forgotten after two
#: missed 1 s keep-alives, the round closed 1 s after the minimum of nodes is in.
TORCH_TUNED_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
TORCHRUN_TUNED = f"torchrun --monitor-interval 0.01 --rdzv-conf {TORCH_TUNED_CONF}"
OURS_TUNED = f"aioelastic-run --rdzv-conf {TORCH_TUNED_CONF}"


def _recover_group(case: str, title: str) -> Group:
    """A node lost from an elastic job: ours at its defaults, torchrun at its and tuned."""
    return Group(
        name=case,
        systems=(
            System("aioelastic-run", "aioelastic", f"{_M}:aio_run", quick=False),
            System(
                OURS_TUNED, "aioelastic", f"{_M}:aio_run", {"conf": TORCH_TUNED_CONF}, quick=False
            ),
            System(
                TORCHRUN,
                "torch",
                f"{_M}:torchrun",
                {"flags": "--monitor-interval 0.01"},
                quick=False,
            ),
            System(
                TORCHRUN_TUNED,
                "torch",
                f"{_M}:torchrun",
                {"flags": "--monitor-interval 0.01", "conf": TORCH_TUNED_CONF},
                quick=False,
            ),
        ),
        rows=(
            Row(
                f"{title}, torchrun at its defaults",
                "aioelastic-run",
                TORCHRUN,
                metric="recovered",
                metrics=("recovered",),
            ),
            Row(
                f"{title}, both tuned alike",
                OURS_TUNED,
                TORCHRUN_TUNED,
                metric="recovered",
                metrics=("recovered",),
            ),
        ),
        ns=(2,),
        quick_ns=(2,),
        default_reps=3,
        params={"case": case, "cap": CAP_S},
        warmup=False,
        rep_timeout=CAP_S + START_LIMIT_S + 60.0,
    )


MEASURE = Measure(
    name="multinode",
    letter="k",
    title="three nodes: a failure on one to every other launcher's exit",
    metrics=(ENDED, STOPPED, RECOVERED),
    notes=(
        "Three launchers of one job on 127.0.0.1-3 (c10d, `--rdzv-endpoint 127.0.0.1:PORT`, "
        "`--rdzv-conf is_host=1` on node 0 and `is_host=0` on the others, `--local-addr`, "
        "`--max-restarts 0`), each in a session of its own, N ranks per node. *exit*: node "
        "2's last rank exits 7 while the others block silently (as NCCL ranks do when a peer "
        "dies), from its exit; *gloo*: the same with the others in a gloo `all_reduce`, "
        "which notices the dead peer; *SIGKILLed node*: node 2's launcher and workers "
        "SIGKILLed, from the kill, nodes 0 and 1 watched; *the store's host*: node 0 SIGKILLed "
        "likewise, nodes 1 and 2 watched; *SIGTERM'd launcher*: node 1's "
        "launcher gets SIGTERM, from the signal, nodes 0 and 2 watched. To the last watched "
        "launcher's exit, and to the last of their ranks stopped. A repetition whose "
        f"launchers have not all ended {CAP_S:g} s after the event ({QUICK_CAP_S:g} s with "
        "`--quick`) is stopped and shown as `> cap`: it did not end within the cap."
    ),
    groups=(
        _group("exit", "exit, the others wait silently", quick=True),
        _group("gloo", "exit, the others in a gloo all_reduce", quick=False),
        _group("kill", "SIGKILLed node, the others wait silently", quick=False),
        _group("store", "the store's host SIGKILLed, the others wait silently", quick=False),
        _group("term", "SIGTERM'd launcher, the others wait silently", quick=True),
        _recover_group("recover", "node lost, the others in a gloo all_reduce"),
        _recover_group("recover-silent", "node lost, the others wait silently"),
    ),
)
