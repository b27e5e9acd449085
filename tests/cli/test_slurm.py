"""``srun aioelastic-run`` on a real three-node SLURM cluster (tests/support/slurm_cluster.py).

Each test runs a real job step, one launcher task per node and two gloo ranks per
launcher (tests/children/slurm_train.py), and reads what ``srun`` prints: every rank's
``ready`` line says the world it formed and the host it runs on. Nothing is synchronised
with sleeps: a test waits for lines, for the signals file's lines, for the job to leave the
queue. Bounds: SLURM's own (``KillWait``, ``SlurmdTimeout`` of the test cluster) or ours
(the grace period, the dead-node bound), each with the allowance its comment states.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.cli_run import Launcher
from tests.support.multinode import BEAT, DEAD_AFTER
from tests.support.paths import CHILDREN, REPO
from tests.support.slurm_cluster import (
    CRED_EXPIRE,
    KILL_WAIT,
    NODES,
    SLURMD_TIMEOUT,
    SlurmCluster,
)

pytestmark = [pytest.mark.torch, pytest.mark.timeout(240)]

TRAIN = str(CHILDREN / "slurm_train.py")
READY = re.compile(r"ready rank=(\d+) world=(\d+) sum=(\d+) host=(\S+) restart=(\d+) requeue=(\S+)")
#: Seconds of grace the launchers give their workers between SIGTERM and SIGKILL here:
#: inside the test cluster's KillWait, as a real job's must be inside SLURM's.
GRACE = 3
#: What a step's start may take: three launchers, six ranks importing torch on two cores.
START_TIMEOUT = 120.0
#: Seconds from a node's crash until the survivors are back in user code: the dead-node
#: bound of the job channel (`DEAD_AFTER` plus a beat); the survivors' workers ending
#: (their SIGTERM handler, then the interpreter's exit: over a second for a process that
#: imported torch, on two loaded cores; the grace period at most); the new round (torch's
#: join loop syncs once a second: two syncs) and the workers' start, with 1 s for srun's
#: forwarding of their first line: 11.5 s, doubled for a loaded 2-core machine. Measured
#: here: 7.5 s idle (benchmark m), 9.4-11.3 s while another cluster ran jobs. Without the
#: lost node forgotten at once, torch's keep-alive expiry and last call take ~45 s, and
#: without --lost-node end a fixed-size job waits out the join timeout: both fail it.
CRASH_BOUND = 2 * (DEAD_AFTER + BEAT + GRACE + 3)
#: A requeued job's ready lines: attempt 0 of the job's second run.
READY_REQUEUED = re.compile(READY.pattern.replace(r"requeue=(\S+)", "requeue=(1)"))
#: Until a requeued job runs again: SLURM makes it eligible after the credential's life,
#: then it starts as any job.
REQUEUE_TIMEOUT = CRED_EXPIRE + 5 + START_TIMEOUT


@contextmanager
def step(
    cluster: SlurmCluster,
    mode: str,
    out: Path,
    *flags: str,
    srun: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[Launcher]:
    """``srun -N3 --ntasks-per-node=1 aioelastic-run --nproc-per-node 2 ... TRAIN MODE OUT``.

    No rendezvous flag: what SLURM says is the whole of the glue. Killed with ``scancel``
    on the way out if still running.
    """
    run = Launcher(
        [
            "--nproc-per-node=2",
            "--monitor-interval=0.1",
            f"--shutdown-timeout={GRACE}",
            *flags,
            TRAIN,
            mode,
            str(out),
        ],
        {**cluster.env, **(env or {})},
        command=(
            "srun",
            f"--nodes={len(NODES)}",
            "--ntasks-per-node=1",
            f"--job-name={out.name}",
            *srun,
            sys.executable,
            "-m",
            "aioelastic.run",
        ),
    )
    try:
        yield run
    finally:
        if run.proc.poll() is None:
            cluster.command(["scancel", f"--name={out.name}"])
        run.finish(KILL_WAIT + 30)


def ready_lines(run: Launcher, count: int, restart: int = 0) -> list[re.Match[str]]:
    """The ``count`` ready lines of attempt ``restart``."""
    pattern = re.compile(READY.pattern.replace(r"restart=(\d+)", f"restart=({restart})"))
    return run.wait_for(pattern, count, START_TIMEOUT)


def assert_one_job(lines: list[re.Match[str]], world: int) -> None:
    """Every rank of ``lines`` is in one job of ``world`` ranks, two per node."""
    assert sorted(int(m.group(1)) for m in lines) == list(range(world))
    assert {(m.group(2), m.group(3)) for m in lines} == {(str(world), str(world))}
    hosts = [m.group(4) for m in lines]
    assert all(hosts.count(h) == 2 for h in hosts), hosts


def job_id(cluster: SlurmCluster, name: str) -> str:
    """The id of the running job named ``name``."""
    found = cluster.command(["squeue", "-h", f"--name={name}", "-o", "%i"]).out.split()
    assert len(found) == 1, found
    return found[0]


def signal_lines(out: Path, name: str) -> set[int]:
    """The ranks that noted signal ``name`` in ``out/signals``."""
    path = out / "signals"
    text = path.read_text() if path.exists() else ""
    return {int(r) for r in re.findall(rf"rank=(\d+) {name}$", text, re.MULTILINE)}


def wait_signal_lines(out: Path, name: str, ranks: int, timeout: float) -> set[int]:
    """Wait until ``ranks`` ranks noted ``name`` (polling the file: no event says so)."""
    deadline = time.monotonic() + timeout
    while len(seen := signal_lines(out, name)) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def wait_log(
    path: Path, pattern: re.Pattern[str], count: int, timeout: float = START_TIMEOUT
) -> None:
    """Wait until ``count`` lines of the batch job's output match (polled: a file)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if len(pattern.findall(text)) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"wanted {count} x {pattern.pattern!r} in {path}:\n{text}")


def wait_state(cluster: SlurmCluster, job: str, state: str, timeout: float) -> None:
    """Wait until the job's state is ``state`` (``""``: it left the queue)."""
    deadline = time.monotonic() + timeout
    while (now := cluster.job_state(job)) != state:
        assert time.monotonic() < deadline, f"job {job} is {now!r}, not {state!r}"
        time.sleep(0.2)


def test_the_step_alone_forms_one_job_of_every_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    # The zero-glue line: three separate jobs of world 2 before; one of world 6 now.
    out = tmp_path / "zero-glue"
    out.mkdir()
    with step(slurm, "sum", out) as run:
        lines = ready_lines(run, 6)
        assert run.finish(START_TIMEOUT) == 0, run.stderr
    assert_one_job(lines, 6)
    assert sorted({m.group(4) for m in lines}) == list(NODES)
    # One line per launcher says what SLURM gave.
    assert run.stderr.count("from SLURM") == 3, run.stderr


def test_scancel_lets_every_rank_on_every_node_run_its_handler(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # SLURM sends SIGCONT+SIGTERM to every process of the job at once: launchers, their
    # helpers and the workers. Before, a TERM that reached the watchdog SIGKILLed the ranks
    # before their handlers ran (3 of 6 saw it).
    out = tmp_path / "scancel"
    out.mkdir()
    with step(slurm, "train", out) as run:
        ready_lines(run, 6)
        run.wait_for(re.compile(r"training rank="), 6, START_TIMEOUT)
        cancelled = time.monotonic()
        assert slurm.command(["scancel", job_id(slurm, out.name)]).code == 0
        code = run.finish(KILL_WAIT + 30)
        ended = time.monotonic() - cancelled
    assert signal_lines(out, "TERM") == set(range(6)), (out / "signals").read_text()
    assert len(re.findall(r"checkpointed rank=", run.stdout)) == 6, run.stdout
    # The launchers end before SLURM's SIGKILL at KillWait (the grace fits inside it),
    # with up to 5 s for SLURM to notice the tasks' end and srun to close.
    assert ended < KILL_WAIT + 5, ended
    # 143: every launcher ended by itself, stopped by SIGTERM; SLURM's SIGKILL at KillWait
    # (a grace longer than KillWait) would leave srun reporting a task killed instead.
    assert code == 128 + signal.SIGTERM, run.stderr
    assert run.stderr.count("aioelastic-run: stopped by SIGTERM") == 3, run.stderr


def test_a_user_signal_reaches_every_rank_and_the_job_goes_on(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # `sbatch --signal=USR1@120` before the time limit, `scancel --signal=USR1 JOB` now:
    # before, the launchers died of the signal's default action and every rank stopped.
    out = tmp_path / "usr1"
    out.mkdir()
    # SLURM signals every process of the step; nothing to forward (--forward-signals is
    # for a signal that reaches the launcher alone: tests/cli/test_scheduler_signals.py).
    with step(slurm, "train", out) as run:
        ready_lines(run, 6)
        run.wait_for(re.compile(r"training rank="), 6, START_TIMEOUT)
        job = job_id(slurm, out.name)
        assert slurm.command(["scancel", "--signal=USR1", job]).code == 0
        assert wait_signal_lines(out, "USR1", 6, 10) == set(range(6))
        # Still training: nothing ended, nothing restarted.
        assert run.proc.poll() is None
        assert "checkpointed" not in run.stdout
        assert slurm.job_state(job) == "RUNNING"
        assert slurm.command(["scancel", job]).code == 0
        run.finish(KILL_WAIT + 30)
    assert signal_lines(out, "TERM") == set(range(6))


def test_a_failing_rank_restarts_every_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    # Before, each node was its own job and only the failing rank's node restarted.
    out = tmp_path / "restart"
    out.mkdir()
    with step(slurm, "fail", out, "--max-restarts=1", env={"TEST_FAIL_RANK": "3"}) as run:
        ready_lines(run, 6, restart=0)
        lines = ready_lines(run, 6, restart=1)
        assert run.finish(START_TIMEOUT) == 0, run.stderr
    assert_one_job(lines, 6)


def test_a_crashed_node_leaves_the_others_training_in_a_new_round(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # `--no-kill`: SLURM leaves the step running when a node goes DOWN, and the launchers
    # recover by themselves (elastic bounds: two nodes are enough).
    out = tmp_path / "crash-elastic"
    out.mkdir()
    try:
        with step(
            slurm, "train", out, "--nnodes=2:3", "--max-restarts=3", srun=("--no-kill",)
        ) as run:
            ready_lines(run, 6)
            crashed = time.monotonic()
            slurm.crash("n3")
            run.wait_for(re.compile(r"started rank=\d+ restart=1"), 4, CRASH_BOUND + 30)
            back = time.monotonic() - crashed
            lines = ready_lines(run, 4, restart=1)
            assert slurm.command(["scancel", f"--name={out.name}"]).code == 0
            run.finish(KILL_WAIT + 30)
    finally:
        slurm.restart("n3")
    assert_one_job(lines, 4)
    assert "n3" not in {m.group(4) for m in lines}
    # The survivors are back in user code within the dead-node bound.
    assert back < CRASH_BOUND, back


#: What each surviving launcher says as it ends a job that lost a node for good.
NODE_LOST = "aioelastic-run: error: NodeLostError: node 2 (n3) was lost"


def test_a_crashed_node_ends_a_fixed_size_job_for_slurm_to_requeue(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # Three nodes or none: no node can replace n3 inside the step, so every launcher ends
    # at once, naming it, instead of waiting out the rendezvous' timeout (pytorch#76287),
    # restarts to spare or not (with none left, the vanished node ends the run anyway).
    out = tmp_path / "crash-fixed"
    out.mkdir()
    try:
        with step(slurm, "train", out, "--max-restarts=3", srun=("--no-kill",)) as run:
            ready_lines(run, 6)
            crashed = time.monotonic()
            slurm.crash("n3")
            run.wait_for_stderr(NODE_LOST, CRASH_BOUND + 30, count=2)
            ended = time.monotonic() - crashed
            # srun itself ends once SLURM calls n3 DOWN, SlurmdTimeout or more after.
            code = run.finish(SLURMD_TIMEOUT * 3 + 30)
    finally:
        slurm.restart("n3")
    assert code != 0
    assert run.stderr.count(NODE_LOST) == 2, run.stderr
    assert ended < CRASH_BOUND, ended


BATCH = """#!/bin/sh
mode=train
[ -n "$SLURM_RESTART_COUNT" ] && mode=sum
exec srun --ntasks-per-node=1 {python} -m aioelastic.run --nproc-per-node=2 \\
    --monitor-interval=0.1 --shutdown-timeout={grace} {train} $mode {out}
"""


def test_a_requeued_job_forms_a_fresh_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "requeue"
    out.mkdir()
    script = out / "job.sh"
    script.write_text(BATCH.format(python=sys.executable, grace=GRACE, train=TRAIN, out=out))
    log = out / "job.out"
    submitted = slurm.command(
        [
            "sbatch",
            "--parsable",
            f"--nodes={len(NODES)}",
            "--requeue",
            f"--output={log}",
            f"--chdir={REPO}",
            str(script),
        ]
    )
    assert submitted.code == 0, submitted.err
    job = submitted.out.strip().split(";")[0]
    try:
        wait_log(log, re.compile(r"training rank="), 6)
        assert slurm.command(["scontrol", "requeue", job]).code == 0
        wait_log(log, READY_REQUEUED, 6, timeout=REQUEUE_TIMEOUT)
        wait_state(slurm, job, "", timeout=START_TIMEOUT)
    finally:
        slurm.command(["scancel", job])
        wait_state(slurm, job, "", timeout=KILL_WAIT + 30)
    lines = [m for line in log.read_text().splitlines() if (m := READY_REQUEUED.search(line))]
    assert_one_job(lines, 6)
