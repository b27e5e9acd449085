"""The measures' declarations and their own logic: rows, broken-line counting, multinode."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from benchmarks.measures._common import Capture, count_lines

# Moved from the suite's torch-marked test module as they were.
pytestmark = pytest.mark.torch


def _capture(text: bytes) -> Capture:
    capture = Capture()
    capture.data += text
    capture.chunks.append((1, len(text)))
    return capture


def test_count_lines_finds_lost_split_merged_and_duplicated_lines() -> None:
    pad = "x" * 4
    good = "".join(f"[bench{r}]:{r} {i} {pad}\n" for r in range(2) for i in range(3))
    assert count_lines(_capture(good.encode()), n=2, lines=3, width=4).__dict__ == {
        "good": 6,
        "lost": 0,
        "broken": 0,
    }
    damaged = (
        f"[bench0]:0 0 {pad}\n"
        f"[bench0]:0 1 xx\n"  # split: first half ...
        f"[bench0]:xx\n"  # ... and second half
        f"[bench1]:1 0 {pad}[bench1]:1 1 {pad}\n"  # merged
        f"[bench1]:0 2 {pad}\n"  # rank 0's line under rank 1's prefix
        f"[bench0]:0 0 {pad}\n"  # duplicate
        f"[bench1]:1 2 {pad}"  # no final newline
    )
    counted = count_lines(_capture(damaged.encode()), n=2, lines=3, width=4)
    assert counted.good == 1
    assert counted.lost == 5
    assert counted.broken == 6


def test_every_row_names_systems_of_its_group_and_a_metric_of_its_measure() -> None:
    from benchmarks.measures import all_measures

    for measure in all_measures():
        names = {m.name for m in measure.metrics}
        for group in measure.groups:
            labels = {s.label for s in group.systems}
            for row in group.rows:
                where = f"{measure.name}/{group.name}: {row.case}"
                assert row.ours in labels, where
                assert row.theirs is None or row.theirs in labels, where
                assert row.metric is None or row.metric in names, where
                assert row.metrics is None or set(row.metrics) <= names, where
                assert row.metrics is None or (row.metric or measure.metrics[0].name) in (
                    row.metrics
                ), where  # a row shows its own headline metric


def test_a_driver_of_the_shared_systems_runs_only_the_declared_system() -> None:
    # The binary pair and the fork-server trio run in one driver process each (their
    # label) across measures: a system declared by hand under that driver would share a
    # process, and its warm state, with a different system.
    from benchmarks.measures import all_measures
    from benchmarks.measures._systems import binary_pair, forkserver_trio

    shared = {s.label: s for s in (*binary_pair("m"), *forkserver_trio("m"))}
    users = set()
    for measure in all_measures():
        for group in measure.groups:
            for system in group.systems:
                declared = shared.get(system.driver_name)
                if declared is None:
                    continue
                where = f"{measure.name}/{group.name}: {system.label}"
                assert system.label == declared.label, where
                assert (system.kind, dict(system.params)) == (
                    declared.kind,
                    dict(declared.params),
                ), where
                users.add((measure.name, system.label))
    assert {m for m, label in users if label == "torch.mp/forkserver"} == {
        "completion",
        "failure",
        "teardown",
    }


def test_multinode_is_measure_k_and_quick_runs_only_its_exit_and_sigterm_cases() -> None:
    from benchmarks.harness._run import Plan
    from benchmarks.measures import all_measures, multinode

    letters = [m.letter for m in all_measures()]
    assert len(letters) == len(set(letters))
    assert multinode.MEASURE.letter == "k"
    plan = Plan(measures=[multinode.MEASURE], quick=True)
    quick = {g.name: [s.label for s in plan.systems_for(g, 2)] for g in multinode.MEASURE.groups}
    both = ["aioelastic-run", "torchrun --monitor-interval 0.01"]
    # gloo imports torch in 6 ranks per side and a vanished node takes ours ~8 s: full runs only.
    assert quick == {
        "exit": both,
        "gloo": [],
        "kill": [],
        "store": [],
        "term": both,
        "recover": [],
        "recover-silent": [],
    }
    for group in multinode.MEASURE.groups:
        assert group.params["cap"] == 60.0
        assert group.name.startswith("recover") or group.quick_params["cap"] == 10.0


def test_multinode_finds_every_process_of_a_launchers_session() -> None:
    from benchmarks.measures.multinode import _session

    # A leader and its child in a session of their own, as each node's launcher runs.
    leader = subprocess.Popen(
        ["/bin/sh", "-c", "/bin/sleep 60 & echo $!; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        assert sorted(_session(leader.pid)) == sorted([leader.pid, child])
        assert os.getpid() not in _session(leader.pid)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
        assert leader.stdout is not None
        leader.stdout.close()


def test_multinode_stamps_each_exit_and_gives_up_at_the_deadline() -> None:
    from benchmarks.measures.multinode import _wait_exits
    from benchmarks.programs._clock import now_ns

    quick = subprocess.Popen(["/bin/true"])
    stays = subprocess.Popen(["/bin/sleep", "60"])
    fds = [os.pidfd_open(quick.pid), os.pidfd_open(stays.pid)]
    try:
        before = now_ns()
        ended = _wait_exits(fds[:1], before + 10**10)
        assert ended is not None
        assert before < ended[fds[0]] <= now_ns()
        assert _wait_exits(fds, now_ns() + 50_000_000) is None  # 50 ms: sleep still runs
    finally:
        stays.kill()
        for proc in (quick, stays):
            proc.wait(timeout=10)
        for fd in fds:
            os.close(fd)


def test_slurm_runs_in_full_runs_only_on_one_cluster_and_only_torch_has_glue(
    tmp_path: Path,
) -> None:
    from benchmarks.harness._run import Plan, _params
    from benchmarks.harness._spec import RepContext
    from benchmarks.measures import slurm

    assert slurm.MEASURE.letter == "m"
    plan = Plan(measures=[slurm.MEASURE], quick=True)
    for group in slurm.MEASURE.groups:
        # A step imports torch in six ranks (~25 s here): never in --quick.
        assert plan.systems_for(group, 2) == []
        for system in group.systems:
            # One driver, so one cluster, for both sides, repetitions interleaved.
            assert system.driver_name == slurm.DRIVER
            ctx = RepContext(2, _params(group, system, False), tmp_path, False)
            script = slurm._script(ctx, "launcher", "train")
            where = f"{group.name}: {system.label}"
            assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0, where
            ours = system.kind == "aioelastic"
            assert ("--rdzv" in script) == (not ours and system.label != slurm.TORCH_ALONE), where
            assert ("PET_MASTER_PORT" in script) == (system.label == slurm.TORCH_ALONE), where
            assert "exec " in script.splitlines()[-1], where
