"""The store killed mid-call, and a node whose stack capture cannot finish.

Launchers on 127.0.0.1, 127.0.0.2, ... over c10d (`tests.support.multinode`), node 0
hosting the store, its ranks blocking silently as NCCL ranks do. To kill the store while a
call is in flight, its host is SIGSTOPped first: the call waits for it (its request unread
in the host's socket, or queued behind the beat's that is), the test sees that it was
made, and only then SIGKILLs the host, whose sockets the kernel resets at once.

Each bound is the mechanism's own time plus an allowance at least twice what is measured
here for the rest (a teardown, a launcher's exit) on this shared 2-core machine.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from aioelastic._core.hangs._stacks import DEFAULT_TIMEOUT
from aioelastic._elastic.channel._job_channel import BEAT
from aioelastic._elastic.channel._link import SINGLE_STORE_LOST_AFTER
from tests.support.multinode import Job, c10d_remedy, job, stopped, wait_unread
from tests.support.waits import wait_all_gone

pytestmark = pytest.mark.torch

#: Beyond the mechanism, for a node that ends: stopping its workers and the launcher's
#: exit. Measured here: the ends came 3.0-4.6 s after the kill (a bound of 1.5 s + 8 s
#: is twice the longest), the failed rendezvous 1.2-3.1 s after it.
ALLOWANCE = 8.0
#: Beyond a beat to hear a stack request, the capture's bound and a beat to see the
#: answer: the answer's store calls and the report's printing. Measured here: under 0.5 s;
#: with 2 s, the bound (8 s) stays under STACKS_TIMEOUT (10 s), "on time".
STACKS_ALLOWANCE = 2.0


def lost_store(running: Job, node: int) -> re.Pattern[str]:
    """What node ``node`` says when it finds the killed store refusing: the error's type
    where a silent store's message says "no answer"."""
    said = f"node {node} (127.0.0.{node + 1}) lost the rendezvous store: " + c10d_remedy(running)
    before, after = said.split("no answer")
    head, tail = after.split("{lasted}")
    return re.compile(re.escape(before) + r"\w+" + re.escape(head) + r"\d+\.\d" + re.escape(tail))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_store_killed_mid_gather_gives_the_askers_stacks_and_names_the_store(
    tmp_path: Path,
) -> None:
    """Node 1 gets ``kill -URG`` while the store's host is stopped: its request for every
    node's stacks waits; the host is killed. Node 1 prints its own ranks' stacks with the
    store named as why the others could not be asked (measured: 0.1-0.2 s after the kill), and
    nodes 1 and 2 end as having lost the store within SINGLE_STORE_LOST_AFTER of failing
    calls and a beat."""
    with job(tmp_path, 3, LOGLEVEL="INFO") as running:
        running.start("--max-restarts=0", f"--log-dir={tmp_path / 'logs'}")
        pids = running.ready()
        asker = running.launchers[1]
        with stopped(running.launchers[0]):
            asker.proc.send_signal(signal.SIGURG)
            asker.wait_for_stderr("asking every node for its ranks' stacks", timeout=30)
            killed_at = running.kill_node(0, pids)
        asker.wait_for_stderr("(also in ", timeout=60)
        reported = time.monotonic() - killed_at
        ends = [(n.finish(60), time.monotonic() - killed_at) for n in running.launchers[1:]]
        assert wait_all_gone(list(pids.values()), 10) == []
    print(f"report {reported:.1f} s after the kill, nodes 1 and 2 ended {ends}")
    stderr = [n.stderr for n in running.launchers]
    assert reported < ALLOWANCE, reported
    assert all(t < SINGLE_STORE_LOST_AFTER + BEAT + ALLOWANCE for _, t in ends), ends
    assert [code for code, _ in ends] == [1, 1], stderr
    report = stderr[1][stderr[1].index("stacks of ") :].splitlines()
    assert report[0] == "stacks of 2 ranks on 1 node, asked by node 1 (127.0.0.2)", report
    assert re.fullmatch(
        rf"the c10d store at {running.endpoint} failed \(\w+: .*\): the other nodes could "
        "not be asked",
        report[1],
    ), report
    assert report[2:4] == ["node 0: no answer", "node 2: no answer"], report
    for node in (1, 2):
        assert lost_store(running, node).search(stderr[node]), stderr[node]
    assert "Traceback" not in stderr[1], stderr[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_store_killed_while_a_node_writes_its_end_leaves_its_own_end_named(
    tmp_path: Path,
) -> None:
    """Rank 5 fails on node 2 while the store's host is stopped: node 2's end ticket call
    waits (behind its beat's); the host is killed. Node 2 says that it could not tell the
    others, naming the store, and reports its own failure (exit 7); node 1 ends as having
    lost the store. Both within SINGLE_STORE_LOST_AFTER, a beat and the allowance."""
    with job(tmp_path, 3, LOGLEVEL="INFO", TEST_FAIL_RANK="5") as running:
        running.start("--max-restarts=0")
        pids = running.ready()
        writer = running.launchers[2]
        with stopped(running.launchers[0]):
            running.trigger()
            writer.wait_for_stderr(
                "telling the other nodes why this node ends: node 2 (127.0.0.3) failed: "
                "rank 5 exited 7",
                timeout=30,
            )
            killed_at = running.kill_node(0, pids)
        ends = [(n.finish(60), time.monotonic() - killed_at) for n in running.launchers[1:]]
        assert wait_all_gone(list(pids.values()), 10) == []
    print(f"nodes 1 and 2 ended {ends} after the kill")
    stderr = [n.stderr for n in running.launchers]
    assert all(t < SINGLE_STORE_LOST_AFTER + BEAT + ALLOWANCE for _, t in ends), ends
    assert [code for code, _ in ends] == [1, 7], stderr
    assert re.search(
        rf"could not tell the other nodes why this node ended: the c10d store at "
        rf"{running.endpoint} failed \(\w+: .*\)",
        stderr[2],
    ), stderr[2]
    assert "rank      : 5 (local_rank: 1)" in stderr[2], stderr[2]
    assert lost_store(running, 1).search(stderr[1]), stderr[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_store_killed_mid_rendezvous_ends_the_waiting_node_with_the_store_named(
    tmp_path: Path,
) -> None:
    """Two nodes of three wait in the first round; the store's host is stopped, and once a
    rendezvous request of node 1's waits unread in the host's socket, killed. Node 1's
    rendezvous fails at once, naming the store (measured: its launcher exits 1.2-3.1 s after
    the kill)."""
    with job(tmp_path, 2, LOGLEVEL="INFO") as running:
        running.start("--max-restarts=0", nnodes="3")
        port = int(running.endpoint.rsplit(":", 1)[1])
        waiting = running.launchers[1]
        waiting.wait_for_stderr(f"rendezvous {running.run_id!r}: joining the next round", 60)
        with stopped(running.launchers[0]):
            wait_unread(port, waiting.proc.pid, timeout=30)
            killed_at = time.monotonic()
            os.killpg(running.launchers[0].proc.pid, signal.SIGKILL)
        code = waiting.finish(60)
        took = time.monotonic() - killed_at
    print(f"node 1 ended {took:.1f} s after the kill")
    assert took < ALLOWANCE, took
    assert code == 1, waiting.stderr
    assert re.search(
        r"aioelastic-run: error: RendezvousConnectionError: "
        + re.escape(f"the c10d store at {running.endpoint} failed (")
        + r"\w+: [^)]*"
        + re.escape(
            ") during the rendezvous; it lives in the launcher of the node at 127.0.0.1, a "
            "single point of failure: --rdzv-backend etcd-v2 keeps the store in a replicated "
            "etcd cluster instead"
        ),
        waiting.stderr,
    ), waiting.stderr
    assert "Traceback" not in waiting.stderr, waiting.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_live_node_whose_capture_cannot_finish_is_named_on_time_not_vanished(
    tmp_path: Path,
) -> None:
    """Rank 5 (node 2) is SIGSTOPped: node 2's launcher beats, but its capture of rank 5
    waits out the capture's bound (DEFAULT_TIMEOUT, as long as DEAD_AFTER). Node 0 asks
    for every rank's stack. Node 2 answers beside its beats, so node 1, its watcher, does
    not take it for vanished, and node 0's report names rank 5 as stopped and not
    answering, within a beat to hear, the capture's bound, a beat to see the answer and
    STACKS_ALLOWANCE: before STACKS_TIMEOUT, when the asker would give up on node 2
    (measured: 5.2-5.5 s). The capture's bound equals DEAD_AFTER here, so answering inside
    the beat loop (as before) loses the race to the watcher only sometimes: that
    regression is pinned by test_protocol_faults.py, where the capture never returns."""
    with job(tmp_path, 3) as running:
        running.start("--max-restarts=0", f"--log-dir={tmp_path / 'logs'}")
        pids = running.ready()
        asker = running.launchers[0]
        os.kill(pids[5], signal.SIGSTOP)
        try:
            asked_at = time.monotonic()
            asker.proc.send_signal(signal.SIGURG)
            asker.wait_for_stderr("(also in ", timeout=60)
            took = time.monotonic() - asked_at
            alive = [n.proc.poll() is None for n in running.launchers]
        finally:
            os.kill(pids[5], signal.SIGCONT)
        asker.proc.send_signal(signal.SIGTERM)
        ends = running.finish(60)
        assert wait_all_gone(list(pids.values()), 10) == []
    print(f"report {took:.1f} s after kill -URG")
    stderr = [n.stderr for n in running.launchers]
    assert alive == [True] * 3, stderr
    assert DEFAULT_TIMEOUT <= took < BEAT + DEFAULT_TIMEOUT + BEAT + STACKS_ALLOWANCE, took
    report = stderr[0][stderr[0].index("stacks of ") :]
    assert report.startswith("stacks of 6 ranks on 3 nodes, asked by node 0 (127.0.0.1)\n")
    assert "no answer" not in report, report
    assert (
        f"rank 5 (node 2 127.0.0.3 pid {pids[5]}): (no Python stack: pid {pids[5]} is stopped "
        "(SIGSTOP, or a debugger holds it) and did not answer SIGURG within 5s)"
    ) in report, report
    assert all("vanished" not in err for err in stderr), stderr
    assert [code for code, _ in ends] == [128 + signal.SIGTERM] * 3, stderr
