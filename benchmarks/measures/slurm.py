"""m. SLURM: torchrun and aioelastic-run as job steps of a real three-node SLURM cluster.

The cluster is the tests' (``workloads/slurm_cluster.py``): SLURM 22.05's controller
and one node daemon per node ``n1``..``n3`` on this machine, each node in a UTS and mount
namespace of its own (hostname ``nK``, ``/etc/hosts`` mapping ``nK`` to 127.0.1.K),
``KillWait`` 5 s, ``SlurmdTimeout`` 10 s. It is started once per driver process, on the
first repetition (every system of this measure runs in the one driver :data:`DRIVER`, so
both sides run on the same cluster, interleaved), and stopped when the driver exits.

Every repetition is one job step::

    srun --nodes=3 --ntasks-per-node=1 [--no-kill] sh -c 'echo $$ >DIR/launcher.$(hostname);
        ...; exec python -m LAUNCHER [GLUE] --nproc-per-node 2 [FLAGS] _slurm_job.py DIR MODE'

The ``sh`` records the launcher's pid (the ``exec`` keeps it) and gives no flag; GLUE is
torch's side's usual SLURM glue (see :func:`_glue`). The ranks run
:mod:`benchmarks.programs._slurm_job`: ready through a FIFO once in a gloo group, signals
noted to a file and a FIFO, back in user code after a lost node stamped. The cases:

- ``zero-glue``: mode ``sum`` with no glue at all: the world the ranks formed (the sum of
  an all-reduce of ones), how many jobs (ranks 0), and srun to its exit. torchrun without
  flags makes each node a job of its own on ``127.0.0.1:29500``; the nodes here share one
  network stack, so each node's torchrun gets a master port of its own
  (``PET_MASTER_PORT``), as separate machines have.
- ``scancel``: mode ``train``; once every rank is ready, ``scancel JOB`` (SLURM's SIGTERM
  to every process of the step): the ranks whose SIGTERM handler ran, and the scancel to
  srun's exit.
- ``usr1``: ``scancel --signal=USR1 JOB``: the ranks that noted USR1 within
  :data:`SIGNAL_WAIT_S`, and the ranks still running :data:`SETTLE_S` later.
- ``crash``: ``srun --no-kill``, three nodes fixed; node ``n3`` crashes (every process on
  it SIGKILLed, its daemon too): the crash to both surviving launchers' exit, capped.
- ``elastic``: the same with ``--nnodes 2:3 --max-restarts 3``: the crash to all four
  surviving ranks back in user code in a new round, capped.

The node crashed comes back (its daemon restarted, idle again) after the step, untimed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness._spec import (
    Group,
    Measure,
    Metric,
    NotAvailable,
    RepContext,
    RepTimeout,
    Row,
    System,
)
from benchmarks.measures._common import runnable
from benchmarks.measures.multinode import TORCH_TUNED_CONF, _wait_exits
from benchmarks.programs._clock import now_ns, read_stamp, seconds
from benchmarks.programs._ready import make_fifo
from workloads.slurm_cluster import NODES, SlurmCluster, SlurmUnavailable

JOB = Path(__file__).resolve().parents[1] / "programs" / "_slurm_job.py"
HOSTS = NODES
#: The node that crashes, not the first: torch's glue puts its store on the first host.
LOST = "n3"
#: What a step may take to have every rank ready: six ranks import torch on two cores.
START_LIMIT_S = 180.0
#: From the crash to the survivors' end (``crash``) or return (``elastic``); over it: ``> cap``.
CAP_S = 60.0
#: How long the ranks get to note a user signal, and how long after that a rank still
#: running counts as training on.
SIGNAL_WAIT_S = 5.0
SETTLE_S = 3.0
#: From ``scancel`` to srun's exit: SLURM's KillWait (5 s) sends SIGKILL; past it, a bug.
SCANCEL_LIMIT_S = 40.0
#: Every system here runs in this one driver process, on its one cluster.
DRIVER = "slurm cluster"

_CLUSTER: list[SlurmCluster] = []


def _cluster() -> SlurmCluster:
    """The driver's cluster, started on first use and stopped when the driver exits."""
    if _CLUSTER:
        return _CLUSTER[0]
    # Job ids (so aioelastic-run's derived store ports) apart from other clusters' here.
    first_job_id = random.randrange(1_000, 1_000_000)
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-")), first_job_id=first_job_id)
    atexit.register(cluster.close)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        raise NotAvailable(f"the SLURM cluster did not start: {exc}") from exc
    _CLUSTER.append(cluster)
    return cluster


def _glue(ctx: RepContext, port: int) -> str:
    """The flags a torchrun user writes into the job script (parameter ``glue``).

    ``slurm``: one c10d rendezvous on the first host of the allocation (``scontrol show
    hostnames``) on a port of the benchmark's, the job's id as its id. Anything else: none.
    """
    if ctx.str_param("glue") != "slurm":
        return ""
    first = '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    return (
        f"--nnodes {ctx.params.get('nnodes', len(HOSTS))} --rdzv-backend c10d "
        f'--rdzv-endpoint "{first}:{port}" --rdzv-id "$SLURM_JOB_ID"'
    )


def _script(ctx: RepContext, module: str, mode: str) -> str:
    from aioelastic import free_port

    port, ports = free_port(), [free_port() for _ in HOSTS]
    directory = shlex.quote(str(ctx.workdir))
    lines = [f'echo $$ >{directory}/launcher.$(hostname); echo "$SLURM_JOB_ID" >{directory}/job']
    if ctx.str_param("glue") == "separate":
        # torchrun's default master port, one per node: separate machines' 127.0.0.1.
        choices = " ".join(f"{i}) p={p};;" for i, p in enumerate(ports))
        lines.append(f'case "$SLURM_NODEID" in {choices} esac; export PET_MASTER_PORT=$p')
    lines.append(
        f"exec {shlex.quote(sys.executable)} -m {module} {_glue(ctx, port)} "
        f"--nproc-per-node {ctx.n} {ctx.params.get('flags', '')} "
        f"{shlex.quote(str(JOB))} {directory} {mode}"
    )
    return "\n".join(lines)


def _gather(fd: int, want: int, deadline_ns: int, watch: int | None = None) -> int:
    """Bytes read from the FIFO ``fd`` until ``want`` or the deadline (or ``watch``'s exit)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if watch is not None:
        poller.register(watch, select.POLLIN)
    got = 0
    while got < want:
        remaining_ms = -(-(deadline_ns - now_ns()) // 1_000_000)
        if remaining_ms <= 0:
            break
        events = dict(poller.poll(remaining_ms))
        if fd in events:
            got += len(os.read(fd, want - got))
        elif watch in events:
            break
    return got


@dataclass
class _Step:
    """One ``srun`` job step: its process, the FIFOs' read ends, its files in ``dir``."""

    cluster: SlurmCluster
    dir: Path
    name: str
    proc: subprocess.Popen[str]
    pidfd: int
    fifos: dict[str, int]

    def tail(self, lines: int = 30) -> str:
        """The end of what srun printed (every task's output), for an error message."""
        text = (self.dir / "srun.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def ready(self, count: int) -> None:
        """Wait until ``count`` ranks are ready; raise if srun ends or the limit passes."""
        deadline = now_ns() + int(START_LIMIT_S * 1e9)
        got = _gather(self.fifos["ready"], count, deadline, watch=self.pidfd)
        if got < count:
            raise RuntimeError(f"{got} of {count} ranks ready:\n{self.tail()}")

    def job(self) -> str:
        """The job's id, as the tasks wrote it."""
        return (self.dir / "job").read_text().strip()

    @contextlib.contextmanager
    def pidfds(self, prefix: str) -> Iterator[dict[str, int]]:
        """Pidfds of the processes that wrote ``DIR/PREFIX.KEY`` (alive now), by ``KEY``."""
        fds: dict[str, int] = {}
        try:
            for path in sorted(self.dir.glob(f"{prefix}.*")):
                fds[path.name.removeprefix(f"{prefix}.")] = os.pidfd_open(int(path.read_text()))
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)

    def wait(self, limit_s: float) -> int | None:
        """srun's exit status, ``None`` if it is still running after ``limit_s``."""
        try:
            return self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            return None

    def noted(self, signal_name: str) -> list[str]:
        """The ranks' notes of ``signal_name`` (one per delivery), by ``HOST.LOCAL_RANK``."""
        path = self.dir / "signals"
        text = path.read_text() if path.exists() else ""
        return [w for w, s in (line.split() for line in text.splitlines()) if s == signal_name]


@contextlib.contextmanager
def _step(ctx: RepContext, module: str, mode: str, *srun: str) -> Iterator[_Step]:
    """The running step, named ``ctx.workdir.name``; on the way out, cancelled if running."""
    cluster = _cluster()
    name = _name(ctx)
    fifos = {
        fifo: os.open(make_fifo(ctx.workdir / fifo), os.O_RDWR | os.O_NONBLOCK)
        for fifo in ("ready", "noted", "back")
    }
    argv = ["srun", f"--nodes={len(HOSTS)}", "--ntasks-per-node=1", f"--job-name={name}", *srun]
    try:
        with open(ctx.workdir / "srun.log", "w") as log:
            proc = cluster.popen(
                [*argv, "sh", "-c", _script(ctx, module, mode)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        step = _Step(cluster, ctx.workdir, name, proc, os.pidfd_open(proc.pid), fifos)
        try:
            yield step
        finally:
            if proc.poll() is None:
                cluster.command(["scancel", f"--name={name}"])
            _kill_leftovers(ctx.workdir)
            if step.wait(SCANCEL_LIMIT_S) is None:
                proc.kill()
                proc.wait()
            os.close(step.pidfd)
    finally:
        for fd in fifos.values():
            os.close(fd)


def _alive(pidfd: int) -> bool:
    return not select.select([pidfd], [], [], 0)[0]


def _kill_leftovers(directory: Path) -> None:
    """SIGKILL the step's ranks still running: orphans SLURM no longer counts as its own.

    ``proctrack/linuxproc`` (the test cluster's) finds a step's processes by parentage: a
    launcher that dies leaves its ranks, re-parented, outside the step, and the job
    completing forever. (``proctrack/cgroup`` would find and kill them.)
    """
    for path in directory.glob("pid.*"):
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            pid = int(path.read_text())
            if JOB.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


def _name(ctx: RepContext) -> str:
    """The repetition's job name."""
    return f"bench-{ctx.workdir.name}"


def _gone(cluster: SlurmCluster, name: str) -> None:
    """Wait until the job named ``name`` left the queue (polled: SLURM announces nothing)."""
    deadline = time.monotonic() + SCANCEL_LIMIT_S
    while cluster.command(["squeue", "-h", f"--name={name}", "-o", "%i"]).out.strip():
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {name} still queued {SCANCEL_LIMIT_S:g} s after its end")
        time.sleep(0.2)


def _zero_glue(ctx: RepContext, module: str) -> dict[str, float]:
    started = now_ns()
    with _step(ctx, module, "sum") as step:
        if step.wait(START_LIMIT_S) is None:
            raise RepTimeout(START_LIMIT_S)
        ended = now_ns()
    worlds = [p.read_text().split() for p in ctx.workdir.glob("world.*")]
    return {
        "world": max((int(total) for _, total in worlds), default=0),
        "jobs": sum(rank == "0" for rank, _ in worlds),
        "step": seconds(ended - started),
    }


def _scancel(ctx: RepContext, module: str) -> dict[str, float]:
    with _step(ctx, module, "train") as step:
        step.ready(ctx.n * len(HOSTS))
        started = now_ns()
        step.cluster.command(["scancel", step.job()])
        code = step.wait(SCANCEL_LIMIT_S)
        if code is None:
            raise RepTimeout(SCANCEL_LIMIT_S)
        ended = now_ns()
        return {
            "handled": len(set(step.noted("TERM"))),
            "ended": seconds(ended - started),
            "status": code,
        }


def _usr1(ctx: RepContext, module: str) -> dict[str, float]:
    with _step(ctx, module, "train") as step:
        step.ready(ctx.n * len(HOSTS))
        with step.pidfds("pid") as workers, step.pidfds("launcher") as launchers:
            started = now_ns()
            step.cluster.command(["scancel", "--signal=USR1", step.job()])
            _gather(step.fifos["noted"], ctx.n * len(HOSTS), started + int(SIGNAL_WAIT_S * 1e9))
            # Watched for SETTLE_S more (or until every rank exited): who runs then?
            _wait_exits(list(workers.values()), now_ns() + int(SETTLE_S * 1e9))
            running = [key.split(".")[0] for key, fd in workers.items() if _alive(fd)]
            led = [host for host in running if _alive(launchers[host])]
        notes = step.noted("USR1")
        return {
            "usr1": len(set(notes)),
            "deliveries": len(notes),
            "training": len(led),
            "orphaned": len(running) - len(led),
        }


def _crash(ctx: RepContext, module: str, elastic: bool) -> dict[str, float]:
    cluster = _cluster()
    crashed = False
    try:
        with _step(ctx, module, "train", "--no-kill") as step:
            step.ready(ctx.n * len(HOSTS))
            survivors = [h for h in HOSTS if h != LOST]
            with step.pidfds("launcher") as pidfds:
                launchers = [fd for host, fd in pidfds.items() if host != LOST]
                started = now_ns()
                cluster.crash(LOST)
                crashed = True
                deadline = started + int(CAP_S * 1e9)
                if elastic:
                    want = ctx.n * len(survivors)
                    if _gather(step.fifos["back"], want, deadline) < want:
                        raise RepTimeout(CAP_S)
                    backs = [read_stamp(p) for p in ctx.workdir.glob("back.*")]
                    return {"recovered": seconds(max(backs) - started)}
                ended = _wait_exits(launchers, deadline)
                if ended is None:
                    raise RepTimeout(CAP_S)
                return {"lost": seconds(max(ended.values()) - started)}
    finally:
        if crashed:
            cluster.restart(LOST)


def _run(ctx: RepContext, module: str) -> dict[str, float]:
    """One repetition of ``case``; the next starts on a cluster with no job left."""
    case = ctx.str_param("case")
    cases = {"zero-glue": _zero_glue, "scancel": _scancel, "usr1": _usr1}
    try:
        if case in ("crash", "elastic"):
            return _crash(ctx, module, elastic=case == "elastic")
        if case not in cases:
            raise ValueError(f"unknown case {case!r}; expected {', '.join(cases)}, crash, elastic")
        return cases[case](ctx, module)
    finally:
        if _CLUSTER:
            _gone(_CLUSTER[0], _name(ctx))


def aio_run(ctx: RepContext) -> dict[str, float]:
    """``srun ... python -m aioelastic.run``."""
    return _run(ctx, runnable("aioelastic.run"))


def torchrun(ctx: RepContext) -> dict[str, float]:
    """``srun ... python -m torch.distributed.run`` (torchrun)."""
    return _run(ctx, "torch.distributed.run")


_M = "benchmarks.measures.slurm"
WORLD = Metric("world", "ranks in the largest job formed (of 6)", True, ratio=False, count=True)
JOBS = Metric("jobs", "jobs formed", ratio=False, count=True)
STEP = Metric("step", "ms from srun to its exit", scale=1000.0)
HANDLED = Metric("handled", "ranks whose SIGTERM handler ran (of 6)", True, ratio=False, count=True)
ENDED = Metric("ended", "ms from scancel to srun's exit", scale=1000.0)
STATUS = Metric("status", "srun's exit status (143: SIGTERM's)", ratio=False, count=True)
USR1 = Metric("usr1", "ranks that noted USR1 (of 6)", True, ratio=False, count=True)
DELIVERIES = Metric("deliveries", "USR1 notes, one per delivery", ratio=False, count=True)
TRAINING = Metric(
    "training",
    f"ranks still training in the job {SETTLE_S:g} s later (of 6)",
    True,
    ratio=False,
    count=True,
)
ORPHANED = Metric("orphaned", "ranks left running without their launcher", ratio=False, count=True)
LOST_ENDED = Metric("lost", "ms from the crash to both surviving launchers' exit", scale=1000.0)
RECOVERED = Metric(
    "recovered", "ms from the crash to the 4 survivors back in user code", scale=1000.0
)

OURS = "aioelastic-run"
TORCH_ALONE = "torchrun (no flag)"
TORCH_GLUE = (
    "torchrun --nnodes 3 --rdzv-backend c10d --rdzv-endpoint $first_host:PORT "
    "--rdzv-id $SLURM_JOB_ID --monitor-interval 0.01"
)
ELASTIC = "--nnodes 2:3 --max-restarts 3"
TORCH_ELASTIC = TORCH_GLUE.replace("--nnodes 3", "--nnodes 2:3 --max-restarts 3") + (
    f" --rdzv-conf {TORCH_TUNED_CONF}"
)


def _ours(flags: str = "") -> System:
    label = f"{OURS} {flags}".strip()
    return System(
        label, "aioelastic", f"{_M}:aio_run", {"flags": flags}, quick=False, driver=DRIVER
    )


def _torch(label: str, glue: str, flags: str = "", nnodes: str = "3") -> System:
    params = {"glue": glue, "flags": flags, "nnodes": nnodes}
    return System(label, "torch", f"{_M}:torchrun", params, quick=False, driver=DRIVER)


TORCH_SLURM = _torch(TORCH_GLUE, "slurm", "--monitor-interval 0.01")


def _group(case: str, systems: tuple[System, ...], rows: tuple[Row, ...]) -> Group:
    """One case, both sides on the one cluster; not in ``--quick`` (a step costs ~30 s)."""
    return Group(
        name=case,
        systems=systems,
        rows=rows,
        ns=(2,),
        quick_ns=(2,),
        default_reps=3,
        params={"case": case, "glue": "none"},
        # Every repetition is a fresh job step: no warm state to discard first.
        warmup=False,
        rep_timeout=START_LIMIT_S + CAP_S + 2 * SCANCEL_LIMIT_S + 180.0,
    )


def _row(case: str, ours: System, theirs: System, *metrics: Metric) -> Row:
    names = tuple(m.name for m in metrics)
    return Row(case, ours.label, theirs.label, metric=names[0], metrics=names)


_OURS, _ELASTIC = _ours(), _ours(ELASTIC)
_ALONE = _torch(TORCH_ALONE, "separate")
_TORCH_ELASTIC = _torch(
    TORCH_ELASTIC,
    "slurm",
    f"--max-restarts 3 --monitor-interval 0.01 --rdzv-conf {TORCH_TUNED_CONF}",
    nnodes="2:3",
)
_STEP = "srun -N3 --ntasks-per-node=1 LAUNCHER --nproc-per-node 2"

MEASURE = Measure(
    name="slurm",
    letter="m",
    title="a real three-node SLURM cluster: the job a step forms, scancel, signals, a lost node",
    metrics=(
        WORLD,
        JOBS,
        STEP,
        HANDLED,
        ENDED,
        STATUS,
        USR1,
        DELIVERIES,
        TRAINING,
        ORPHANED,
        LOST_ENDED,
        RECOVERED,
    ),
    notes=(
        "SLURM 22.05 on this machine: a controller and three node daemons n1..n3, each node in "
        "a UTS and mount namespace of its own, KillWait 5 s, SlurmdTimeout 10 s. Each "
        f"repetition is a job step `{_STEP} ... train.py MODE`, N ranks per node (gloo), the "
        "launcher started by `sh -c '...; exec LAUNCHER ...'`, which records its pid. *the "
        "step alone*: no flag on either side (torchrun's master port one per node, as on "
        "separate machines); *scancel*: `scancel JOB` while every rank trains (a rank "
        "exits at once, `os._exit(0)`, once its handler ran); *USR1*: "
        f"`scancel --signal=USR1 JOB`, the ranks that noted it within {SIGNAL_WAIT_S:g} s and "
        f"those still running {SETTLE_S:g} s later; *node lost*: `srun --no-kill`, n3 crashes "
        "(every process on it SIGKILLed, its daemon too), to both surviving launchers' exit or, "
        "elastic, to the 4 survivors back in user code in a new round; a repetition over "
        f"{CAP_S:g} s is stopped and shown as `> cap`. torchrun has the usual SLURM glue "
        "(c10d on the first host of `scontrol show hostnames`, `--rdzv-id $SLURM_JOB_ID`) "
        "everywhere but the first row; ours never has any."
    ),
    groups=(
        _group(
            "zero-glue",
            (_OURS, _ALONE, TORCH_SLURM),
            (
                _row("the step alone, no flag on either side", _OURS, _ALONE, WORLD, JOBS, STEP),
                _row(
                    "the step alone; torchrun with the usual glue",
                    _OURS,
                    TORCH_SLURM,
                    WORLD,
                    JOBS,
                    STEP,
                ),
            ),
        ),
        _group(
            "scancel",
            (_OURS, TORCH_SLURM),
            (_row("scancel while training", _OURS, TORCH_SLURM, HANDLED, ENDED, STATUS),),
        ),
        _group(
            "usr1",
            (_OURS, TORCH_SLURM),
            (
                _row(
                    "scancel --signal=USR1 while training",
                    _OURS,
                    TORCH_SLURM,
                    USR1,
                    TRAINING,
                    DELIVERIES,
                    ORPHANED,
                ),
            ),
        ),
        _group(
            "crash",
            (_OURS, TORCH_SLURM),
            (_row("node lost, three nodes fixed, srun --no-kill", _OURS, TORCH_SLURM, LOST_ENDED),),
        ),
        _group(
            "elastic",
            (_ELASTIC, _TORCH_ELASTIC),
            (
                _row(
                    "node lost, elastic 2:3, srun --no-kill, torchrun tuned",
                    _ELASTIC,
                    _TORCH_ELASTIC,
                    RECOVERED,
                ),
            ),
        ),
    ),
)
