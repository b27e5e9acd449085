"""``--lost-node end``: survivors too few for the job end it at once, naming the lost node.

Three launchers of one job on 127.0.0.1-3 (tests/support/multinode.py), ``--nnodes 3``
and restarts to spare; node 2 is SIGKILLed with its workers, as a machine lost. With
``--lost-node wait`` (torch's way) the survivors would wait for a replacement up to the
rendezvous' join timeout (60 s here); with ``end`` they exit 1 within the job channel's
dead-node bound, each saying which node was lost and why nothing waits for it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.multinode import BEAT, DEAD_AFTER, VANISHED_BOUND, ended_within, job
from tests.support.waits import wait_all_gone

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_lost_node_ends_a_job_that_no_node_can_complete_again(tmp_path: Path) -> None:
    with job(tmp_path, 3) as running:
        running.start("--max-restarts=3", "--lost-node=end")
        pids = running.ready()
        killed_at = running.kill_node(2, pids)
        ends = running.finish()
        took = ended_within(ends[:2], killed_at)
        assert wait_all_gone(list(pids.values()), 10) == []
    assert ends[2][0] == -signal.SIGKILL
    assert [code for code, _ in ends[:2]] == [1, 1]
    # Seen vanished after DEAD_AFTER; well before the join timeout (60 s) a wait would take.
    assert all(DEAD_AFTER - BEAT < t < VANISHED_BOUND for t in took), took
    for node in (0, 1):
        stderr = running.launchers[node].stderr
        assert (
            "NodeLostError: node 2 (127.0.0.3) was lost and no node replaces a lost one here "
            "(replace_lost_nodes is off, as in a SLURM step, whose nodes never come back): "
            "2 of the 3 nodes the job needs remain, so the job ends now, for the scheduler "
            "to requeue it"
        ) in stderr, stderr
