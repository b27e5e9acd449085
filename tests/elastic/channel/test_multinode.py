"""Several nodes: ``aioelastic-run`` launchers on 127.0.0.1, 127.0.0.2, ... over c10d.

Each launcher runs in a session of its own, as on separate machines. The workers block the
way NCCL ranks do when a peer dies — in a wait that notices nothing — so whatever stops
them is the launchers telling each other through the rendezvous store, not the collective
backend. Every bound asserted is far above what is measured (about a second for a failure,
``DEAD_AFTER`` plus a beat for a vanished node).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from aioelastic._elastic.channel._job_channel import BEAT
from aioelastic._elastic.channel._liveness import DEAD_AFTER
from aioelastic._elastic.channel._stack_gathering import STACKS_TIMEOUT
from tests.support.multinode import (
    BOUND,
    DONE,
    READY,
    VANISHED_BOUND,
    ended_within,
    job,
    stopped,
)
from tests.support.waits import wait_all_gone

# Every launcher here rendezvouses through torch's c10d store: skipped where torch is not
# installed (CI's runs on 3.10 and 3.13).
pytestmark = pytest.mark.torch


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["hang", "store"])
def test_a_failed_rank_ends_every_node_although_its_peers_notice_nothing(
    tmp_path: Path, mode: str
) -> None:
    with job(tmp_path, 3, mode=mode, TEST_FAIL_RANK="5") as running:
        running.start("--max-restarts=0")
        pids = running.ready()
        failed_at = running.trigger()
        ends = running.finish()
        took = ended_within(ends, failed_at)
        assert all(t < BOUND for t in took), took
        assert [code for code, _ in ends] == [7, 7, 7], [n.stderr for n in running.launchers]
        assert wait_all_gone(list(pids.values()), 10) == []
    for node in (0, 1):
        stderr = running.launchers[node].stderr
        assert "stopped: node 2 (127.0.0.3) failed: rank 5 exited 7" in stderr, stderr
        assert "host      : 127.0.0.3" in stderr
    assert "rank      : 5 (local_rank: 1)" in running.launchers[2].stderr
    assert "host      : 127.0.0.3" in running.launchers[2].stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_after_a_failure_anywhere_every_node_restarts_with_the_jobs_count(
    tmp_path: Path,
) -> None:
    with job(tmp_path, 3, TEST_FAIL_RANK="5") as running:
        running.start("--max-restarts=1")
        running.ready()
        failed_at = running.trigger()
        restarted = running.ready(restart=1)
        assert len(restarted) == 6
        ends = running.finish()
        assert [code for code, _ in ends] == [0, 0, 0], [n.stderr for n in running.launchers]
    # Every node restarted at once, not when its own ranks noticed (they never would).
    assert all(t < 60 for t in ended_within(ends, failed_at))
    done = sorted(
        (int(m.group(1)), int(m.group(2)))
        for launcher in running.launchers
        for m in map(DONE.search, launcher.out)
        if m
    )
    assert done == [(rank, 1) for rank in range(6)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_restart_budget_is_the_jobs_not_each_nodes(tmp_path: Path) -> None:
    # Node 2's rank 5 fails in every attempt; the job may restart twice in all, so every
    # node runs exactly attempts 0, 1 and 2 (torch counts per node: pytorch#108158).
    with job(tmp_path, 2, TEST_FAIL_RANK="3", TEST_FAIL_UNTIL="-1") as running:
        running.start("--max-restarts=2")
        for attempt in range(3):
            running.ready(restart=attempt)
            running.trigger()
        ends = running.finish()
        assert [code for code, _ in ends] == [7, 7]
    for launcher in running.launchers:
        attempts = sorted({int(m.group(2)) for m in map(READY.search, launcher.out) if m})
        assert attempts == [0, 1, 2], launcher.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launcher_stopped_by_sigterm_ends_the_attempt_on_every_node(tmp_path: Path) -> None:
    with job(tmp_path, 3) as running:
        running.start("--max-restarts=0")
        pids = running.ready()
        stopped_at = time.monotonic()
        running.launchers[1].proc.send_signal(signal.SIGTERM)
        ends = running.finish()
        took = ended_within(ends, stopped_at)
        assert all(t < BOUND for t in took), took
        assert wait_all_gone(list(pids.values()), 10) == []
    assert ends[1][0] == 128 + signal.SIGTERM
    for node in (0, 2):
        stderr = running.launchers[node].stderr
        assert "stopped: node 1 (127.0.0.2) was stopped by SIGTERM" in stderr, stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_vanished_node_is_seen_by_the_others_within_seconds(tmp_path: Path) -> None:
    with job(tmp_path, 3) as running:
        running.start("--max-restarts=0")
        pids = running.ready()
        killed_at = running.kill_node(2, pids)
        ends = running.finish()
        took = ended_within(ends[:2], killed_at)
        assert all(DEAD_AFTER - BEAT < t < VANISHED_BOUND for t in took), took
        assert wait_all_gone(list(pids.values()), 10) == []
    assert ends[2][0] == -signal.SIGKILL
    for node in (0, 1):
        stderr = running.launchers[node].stderr
        assert "stopped: node 2 (127.0.0.3) vanished: no heartbeat" in stderr, stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["hang", "gloo"])
def test_a_lost_node_is_replaced_by_a_smaller_round_within_seconds_at_the_defaults(
    tmp_path: Path, mode: str
) -> None:
    # --nnodes 2:3, torch's keep-alive (15 s) and last call (30 s) left at their defaults:
    # the survivors forget the lost node and close the new round as soon as both are in,
    # instead of waiting out about 45 s. With gloo the survivors' ranks fail by themselves
    # first (before the node counts as vanished): the lost node is found silent while
    # the survivors rejoin.
    with job(tmp_path, 3, mode=mode, TEST_HOLD_RANKS="4,5") as running:
        running.start("--max-restarts=1", nnodes="2:3", last_call=False)
        pids = running.ready()
        victim = running.launchers[2]
        killed_at = running.kill_node(2, pids)
        running.launchers = running.launchers[:2]
        again = running.ready(restart=1)
        took = time.monotonic() - killed_at
        ends = running.finish()
        assert [code for code, _ in ends] == [0, 0], [n.stderr for n in running.launchers]
        victim.finish()
    assert took < VANISHED_BOUND, took
    assert sorted(again) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_urg_on_any_launcher_prints_every_ranks_stack_grouped(tmp_path: Path) -> None:
    with job(tmp_path, 3, TEST_ODD_RANK="4") as running:
        running.start("--max-restarts=0", f"--log-dir={tmp_path / 'logs'}")
        pids = running.ready()
        asker = running.launchers[1]
        asker.proc.send_signal(signal.SIGURG)
        asker.wait_for_stderr("(also in ", timeout=30)
        running.launchers[0].proc.send_signal(signal.SIGTERM)
        running.finish()
    report = asker.stderr[asker.stderr.index("stacks of 6 ranks on 3 nodes") :]
    head = report.splitlines()
    assert head[0] == "stacks of 6 ranks on 3 nodes, asked by node 1 (127.0.0.2)"
    # The odd one out first, with its host and pid, then the rest as one group.
    assert head[1].startswith(f"rank 4 (node 2 127.0.0.3 pid {pids[4]}): wait <- ")
    assert "stuck_elsewhere multinode_job.py:" in head[1]
    rest = next(line for line in head if line.startswith("ranks "))
    assert rest.startswith("ranks 0-3,5 (nodes 0,1,2): wait <- wait ")
    assert "main multinode_job.py:" in rest
    for rank in (0, 1, 2, 3, 5):
        host = f"127.0.0.{rank // 2 + 1}"
        assert f"  rank {rank}: node {rank // 2} {host} pid {pids[rank]}" in report
    written = list((tmp_path / "logs").glob("*/stacks-*.txt"))
    assert len(written) == 1
    assert written[0].read_text().startswith(head[0])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stall_on_one_node_reports_every_ranks_stack_across_the_job(tmp_path: Path) -> None:
    """Every rank goes silent; node 1 alone has a stall timeout. Before its workers are
    stopped it prints (and writes) one report: its ranks' last output, then the stacks of
    every rank of every node, grouped, the odd one out (rank 4, on node 2) first."""
    with job(tmp_path, 3, TEST_ODD_RANK="4") as running:
        running.start(
            "--max-restarts=0",
            f"--log-dir={tmp_path / 'logs'}",
            node_flags={1: ["--stall-timeout=3"]},
        )
        pids = running.ready()
        stalled = running.launchers[1]
        stalled.wait_for_stderr("(also in ", timeout=60)
        ends = running.finish()
    assert all(code != 0 for code, _ in ends), [n.stderr for n in running.launchers]
    report = stalled.stderr[stalled.stderr.index("stalled: no worker wrote output") :]
    lines = report.splitlines()
    assert lines[0].endswith("(stall timeout 3s)")
    for rank in (2, 3):  # node 1's own, by global rank
        assert lines[rank - 1].startswith(f"  rank {rank}: last output "), lines[:3]
        assert f"'ready rank={rank} restart=0 pid={pids[rank]}'" in lines[rank - 1]
    assert lines[3] == "stacks of 6 ranks on 3 nodes, asked by node 1 (127.0.0.2)"
    assert lines[4].startswith(f"rank 4 (node 2 127.0.0.3 pid {pids[4]}): wait <- ")
    assert "stuck_elsewhere multinode_job.py:" in lines[4]
    rest = next(line for line in lines if line.startswith("ranks "))
    assert rest.startswith("ranks 0-3,5 (nodes 0,1,2): wait <- wait ")
    for rank in (0, 1, 2, 3, 5):
        host = f"127.0.0.{rank // 2 + 1}"
        assert f"  rank {rank}: node {rank // 2} {host} pid {pids[rank]}" in report
    assert "no answer" not in report
    written = list((tmp_path / "logs").glob("*/stall-*.txt"))
    assert len(written) == 1
    assert written[0].read_text().startswith(lines[0])
    # The other nodes did not stall: they were stopped because node 1 ended the attempt.
    for other in (0, 2):
        assert (
            "stalled: no worker wrote output"
            not in running.launchers[other].stderr.split("Root Cause")[0]
        )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nodes_that_stall_together_still_give_a_report_of_every_rank(tmp_path: Path) -> None:
    """Every node stalls at once, each asking the others for their stacks while they ask
    it: each keeps answering while it waits, so the first to finish has every rank (a node
    that waited for its answers without beating answered nobody: three reports of one node
    each, after 10 s)."""
    with job(tmp_path, 3) as running:
        running.start("--max-restarts=0", "--stall-timeout=3")
        running.ready()
        ends = running.finish()
    assert all(code != 0 for code, _ in ends), [n.stderr for n in running.launchers]
    stderr = [launcher.stderr for launcher in running.launchers]
    full = [err for err in stderr if "stacks of 6 ranks on 3 nodes" in err]
    assert full, stderr
    assert "ranks 0-5 (nodes 0,1,2): wait <- wait " in full[0]
    # The first stall ends the attempt, which may cut another node's gather short: only
    # such a report, which says so, may name a node as not answering; one that waited out
    # its timeout because nobody beat while waiting (the regression) names nodes and not
    # the attempt's end.
    for err in stderr:
        if re.search(r"(?m)^node \d+ \([^)]*\): no answer$", err):
            assert "the attempt ended before every node answered" in err, err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_global_ranks_filter_shows_those_ranks_on_whichever_node_runs_them(
    tmp_path: Path,
) -> None:
    with job(tmp_path, 2, TEST_FAIL_UNTIL="0") as running:
        running.start("--ranks-filter=1-2", "--tee=3")
        ends = running.finish()
        assert [code for code, _ in ends] == [0, 0], [n.stderr for n in running.launchers]
    shown = [
        sorted(int(m.group(1)) for m in map(DONE.search, n.out) if m) for n in running.launchers
    ]
    assert shown == [[1], [2]]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_losing_the_c10d_stores_host_ends_every_node_with_that_reason(tmp_path: Path) -> None:
    with job(tmp_path, 3) as running:
        running.start("--max-restarts=1")
        pids = running.ready()
        killed_at = running.kill_node(0, pids)
        ends = running.finish()
        took = ended_within(ends[1:], killed_at)
        # c10d's store refuses once its launcher is gone: no election to wait out, so the
        # others end as fast as after any failure (etcd's is given 10 s; see test_etcd).
        assert all(t < BOUND for t in took), took
        assert wait_all_gone(list(pids.values()), 10) == []
    for node in (1, 2):
        launcher = running.launchers[node]
        assert ends[node][0] == 1, launcher.stderr
        assert "lost the rendezvous store" in launcher.stderr, launcher.stderr
        assert "a single point of failure: --rdzv-backend etcd-v2 keeps" in launcher.stderr


# -- nodes that never answer -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_node_that_never_answers_is_named_and_the_report_still_comes(tmp_path: Path) -> None:
    """Node 2's launcher is stopped: it neither answers the stack request nor beats, so
    node 1, which watches it, ends the attempt as vanished while node 0's request waits.
    Node 0 still prints (and writes) the report of the ranks that answered, naming node 2,
    within STACKS_TIMEOUT and a margin."""
    with job(tmp_path, 3) as running:
        running.start("--max-restarts=0", f"--log-dir={tmp_path / 'logs'}")
        pids = running.ready()
        asker = running.launchers[0]
        with stopped(running.launchers[2]):
            asked_at = time.monotonic()
            asker.proc.send_signal(signal.SIGURG)
            asker.wait_for_stderr("(also in ", timeout=60)
            took = time.monotonic() - asked_at
        ends = running.finish()
        assert wait_all_gone(list(pids.values()), 10) == []
    assert took < STACKS_TIMEOUT + BOUND, took
    assert all(code != 0 for code, _ in ends), [n.stderr for n in running.launchers]
    report = asker.stderr[asker.stderr.index("stacks of ") :]
    head = report.splitlines()
    assert head[0] == "stacks of 4 ranks on 2 nodes, asked by node 0 (127.0.0.1)", report
    # The report came when the attempt ended (node 2 found vanished), not at the timeout:
    # what pins the early way out, which a wall-clock bound under STACKS_TIMEOUT could not
    # without flaking (about 6 s measured against 10).
    assert head[1] == "the attempt ended before every node answered"
    assert head[2] == "node 2 (127.0.0.3): no answer"
    for rank in range(4):
        assert f"  rank {rank}: node {rank // 2} 127.0.0.{rank // 2 + 1} pid {pids[rank]}" in report
    (written,) = (tmp_path / "logs").glob("*/stacks-*.txt")
    assert written.read_text().startswith(head[0])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_node_whose_peer_never_hears_of_the_end_lingers_no_longer_than_its_bound(
    tmp_path: Path,
) -> None:
    """Rank 1 fails on node 0, which hosts the store: before leaving, node 0 waits until
    every other node heard why (its leaving takes the store away). Node 1 hears; node 2,
    stopped, never does. Nodes 0 and 1 still end within DEAD_AFTER (the linger's bound)
    and a margin, node 1 with the root cause; node 2, continued, finds the store gone."""
    with job(tmp_path, 3, TEST_FAIL_RANK="1") as running:
        running.start("--max-restarts=0")
        pids = running.ready()
        with stopped(running.launchers[2]):
            failed_at = running.trigger()
            ends = [(launcher.finish(DEAD_AFTER + BOUND + 30), time.monotonic())
                    for launcher in running.launchers[:2]]  # fmt: skip
        ends.append((running.launchers[2].finish(), time.monotonic()))
        assert wait_all_gone(list(pids.values()), 10) == []
    took = ended_within(ends[:2], failed_at)
    assert all(t < DEAD_AFTER + BOUND for t in took), took
    assert [code for code, _ in ends[:2]] == [7, 7], [n.stderr for n in running.launchers]
    host = running.launchers[0].stderr
    assert "rank      : 1 (local_rank: 1)" in host
    # The wall-clock bound above is loose (a loaded machine); what pins the linger's own
    # bound is the host's word that it waited exactly DEAD_AFTER for the silent node.
    lingered = f"heard why the attempt ended within {DEAD_AFTER:g} s (1 of 2 did); leaving"
    assert lingered in host, host
    heard = running.launchers[1].stderr
    assert "stopped: node 0 (127.0.0.1) failed: rank 1 exited 7" in heard, heard
    # Node 2, continued after the host left, finds the store gone, and says so.
    assert ends[2][0] == 1, running.launchers[2].stderr
    assert "lost the rendezvous store" in running.launchers[2].stderr
