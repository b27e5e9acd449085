"""torch's etcd rendezvous backends through ``aioelastic-run``, against a real etcd cluster.

Each test starts a three-member etcd cluster on 127.0.0.1 (`tests.support.etcd_cluster`) and
``aioelastic-run`` launchers as separate processes, two gloo workers each
(tests/children/etcd_job.py), for both of torch's etcd backends:

* ``etcd-v2``: torch's dynamic rendezvous (the one behind ``c10d``) keeping its state in
  etcd (``EtcdRendezvousBackend``, keep-alive heartbeats written into that state), with an
  ``EtcdStore`` for the nodes;
* ``etcd``: torch's original etcd rendezvous (``EtcdRendezvousHandler``), whose nodes keep
  a TTL key each alive (a lease refreshed every 5 s, expiring after 10 s).

Both speak etcd's v2 API through the python-etcd client. torch takes one ``HOST:PORT``
(``aioelastic-run`` also a list, used through the first member that answers): the client
learns the other members from that one (``/v2/machines``) and moves to another when its
member fails, so a node only needs its endpoint up while it starts.

Workers that must be running while the test acts hold at a FIFO the test controls
(`tests.support.etcd_runs.Gate`) after their first ``all_reduce``. Waits are on events
(launcher output, etcd watches), except for torch's lease refreshes, which no watch sees
(`wait_etcd_leases`). A cluster that loses its quorum is tested in
``test_etcd_quorum.py``.

Each test's pytest timeout is the sum of its waits plus an allowance
(`tests.support.etcd_runs.limit`), and fails that test only. Where etcd or python-etcd is
missing the tests skip, saying what to install; under ``CI=true`` they fail instead
(`tests.support.etcd_cluster.unavailable`).
"""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from tests.support.cli_run import Launcher, launch, launcher
from tests.support.etcd_cluster import READY_TIMEOUT, EtcdCluster
from tests.support.etcd_runs import (
    JOB,
    KEEPALIVE_WAIT,
    V2_STATE_KEY,
    Gate,
    both,
    finish_all,
    job,
    limit,
    lines,
    new_run_id,
    still_running,
    wait_held,
    wait_v2_heartbeats,
)

pytestmark = [pytest.mark.torch, pytest.mark.slow]

BACKENDS = ["etcd-v2", "etcd"]

#: torch's ``etcd`` backend's run directory.
ETCD_RUN_DIR = "/torchelastic/p2p/run_{run_id}"
#: torch's ``etcd`` backend: a node's lease key lives this long unless refreshed.
ETCD_KEEPALIVE_TTL = 10.0

#: Seconds a launcher whose etcd member is down may take to exit 1. The member refuses the
#: connection, so this is the launcher's start, torch's import included: 6-9 s here at a
#: load of 5-7 on 2 cores. A client that waited on a silent member instead would take
#: python-etcd's read timeout, 60 s (torch's default ``read_timeout`` too).
FAILS_AT_ONCE = 30.0
#: Seconds a SIGKILLed launcher may take to be reaped with its workers and its output read.
GONE = 30.0


def _expiry(text: str) -> float:
    """etcd's ``expiration`` (RFC 3339 with nanoseconds, UTC) as epoch seconds."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(whole + "+00:00").timestamp()
    return seconds + float(f"0.{fraction or '0'}")


#: What a launcher prints when torch's ``etcd`` backend lost a node's lease thread: its
#: ``lease_worker`` ends at the first error other than "key not found" (torch 2.13), such
#: as the "request timed out, possibly due to previous leader failure" of a refresh that
#: the loss of etcd's leader caught. That refresh hangs 7 s, 5 s after the previous one,
#: so the 10 s lease has expired by then anyway.
LEASE_THREAD_DIED = "(lease_worker):"


def wait_lease_thread_death(runs: tuple[Launcher, ...], key: str) -> str:
    """The stderr of the launcher owning the expired lease ``key``, once its thread died."""
    rank = key.rsplit("_", 1)[1]  # .../rank_<group rank>
    owner = next(run for run in runs if any(s["group"] == rank for s in lines(run, "sum")))
    owner.wait_for_stderr(LEASE_THREAD_DIED, KEEPALIVE_WAIT)
    return owner.stderr


def wait_etcd_leases(
    cluster: EtcdCluster, run_id: str, since: float, runs: tuple[Launcher, ...]
) -> list[str]:
    """Wait until every node of the round refreshed its lease key after ``since``.

    A refresh moves the key's expiry to its time plus the TTL. Refreshing a TTL is no
    event a watch sees, so the keys are read at short intervals, bounded: the only
    polling here. Returns the stderr of the launchers whose lease thread died instead
    (torch's bug, `LEASE_THREAD_DIED`), as soon as one did.
    """
    run_dir = ETCD_RUN_DIR.format(run_id=run_id)
    active, _ = cluster.read(f"{run_dir}/rdzv/active_version")
    assert active is not None, f"no active rendezvous under {run_dir}"
    leases = json.loads(str(active["value"]))["keep_alives"]
    assert leases, active
    deadline = time.monotonic() + KEEPALIVE_WAIT
    waiting = set(leases)
    while waiting:
        died = [run.stderr for run in runs if LEASE_THREAD_DIED in run.stderr]
        if died:
            return died
        still_running(runs)
        for key in sorted(waiting):
            node, _ = cluster.read(key)
            if node is None:
                # Expired: a refresh caught by the leader's loss hangs for etcd's 7 s,
                # after the 5 s since the last one, past the 10 s TTL; the thread then
                # dies of the error. Anything else expiring a lease is not torch's bug.
                return [wait_lease_thread_death(runs, key)]
            if _expiry(str(node["expiration"])) > since + ETCD_KEEPALIVE_TTL:
                waiting.discard(key)
        assert time.monotonic() < deadline, f"leases not renewed since the loss: {waiting}\n" + (
            "\n".join(run.stderr for run in runs)
        )
        if waiting:
            time.sleep(0.2)
    return []


# -- a job ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@limit(READY_TIMEOUT, JOB)  # 30 s the cluster + 50 s the job + 20 s = 100 s
def test_two_launchers_run_a_two_node_gloo_job(cluster: EtcdCluster, backend: str) -> None:
    run_id = new_run_id()
    # Each node names another member: any one of them leads to the cluster.
    first = job(backend, cluster.members[0].endpoint, run_id)
    second = job(backend, cluster.members[1].endpoint, run_id)
    with launcher(*first) as a, launcher(*second) as b:
        assert finish_all((a, b), JOB) == [0, 0], a.stderr + b.stderr

    sums = both((a, b), "sum")
    assert sorted(int(s["rank"]) for s in sums) == [0, 1, 2, 3]
    assert {(s["world"], s["sum"], s["restart"]) for s in sums} == {("4", "6", "0")}
    # One node per group rank, its two workers together.
    assert sorted(sorted({s["group"] for s in lines(run, "sum")}) for run in (a, b)) == [
        ["0"],
        ["1"],
    ]


def launch_at_once(*argv: str) -> Launcher:
    """Run a launcher that must fail at once; fail the test if it took `FAILS_AT_ONCE`."""
    started = time.monotonic()
    run = launch(*argv, timeout=FAILS_AT_ONCE)
    took = time.monotonic() - started
    assert took < FAILS_AT_ONCE, f"took {took:.1f} s:\n{run.stderr}"
    return run


@pytest.mark.parametrize("backend", BACKENDS)
@limit(READY_TIMEOUT, FAILS_AT_ONCE)  # 30 s the cluster + 30 s the launcher + 20 s = 80 s
def test_a_launcher_whose_etcd_member_is_down_fails_at_once(
    cluster: EtcdCluster, backend: str
) -> None:
    # The client learns the cluster from its endpoint, so that member must be up when a
    # node starts (later, any member will do).
    member = cluster.kill(cluster.followers()[0])
    run = launch_at_once(*job(backend, member.endpoint, new_run_id(), nnodes="1"))
    assert run.proc.returncode == 1, run.stderr
    assert "Could not get the list of servers" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("backend", BACKENDS)
@limit(READY_TIMEOUT, JOB)  # 30 s the cluster + 50 s the job + 20 s = 100 s
def test_a_list_of_members_reaches_the_cluster_through_any_that_is_up(
    cluster: EtcdCluster, backend: str
) -> None:
    # --rdzv-endpoint h1:p1,h2:p2: the first member is down when the nodes start; each
    # connects through the next one (and its client learns the whole cluster from it).
    down = cluster.kill(cluster.followers()[0])
    others = [m.endpoint for m in cluster.members if m is not down]
    endpoint = ",".join([down.endpoint, *others])
    run_id = new_run_id()
    with (
        launcher(*job(backend, endpoint, run_id)) as a,
        launcher(*job(backend, endpoint, run_id)) as b,
    ):
        assert finish_all((a, b), JOB) == [0, 0], a.stderr + b.stderr
    assert {(s["world"], s["sum"]) for s in both((a, b), "sum")} == {("4", "6")}


@limit(READY_TIMEOUT, FAILS_AT_ONCE)  # 30 s the cluster + 30 s the launcher + 20 s = 80 s
def test_a_list_of_members_none_up_names_each(cluster: EtcdCluster) -> None:
    down = [cluster.kill(m) for m in cluster.followers()]
    endpoint = ",".join(m.endpoint for m in down)
    run = launch_at_once(*job("etcd-v2", endpoint, new_run_id(), nnodes="1"))
    assert run.proc.returncode == 1, run.stderr
    assert f"no member of --rdzv-endpoint {endpoint!r} answered" in run.stderr
    for member in down:
        assert f"{member.endpoint}: " in run.stderr
    assert "Traceback" not in run.stderr


# -- losing an etcd member --------------------------------------------------------------


@pytest.mark.parametrize("victim", ["leader", "follower"])
@pytest.mark.parametrize("backend", BACKENDS)
# 30 s the cluster + 50 s the job to the gate + 30 s an election + 2 x 20 s the keep-alives
# (etcd: the leases, then a lease thread's death) + 50 s the job's end + 30 s the member's
# restart + 20 s = 250 s
@limit(READY_TIMEOUT, JOB, READY_TIMEOUT, 2 * KEEPALIVE_WAIT, JOB, READY_TIMEOUT)
def test_a_running_job_outlives_the_loss_of_its_etcd_member(
    cluster: EtcdCluster, gate: Gate, backend: str, victim: str
) -> None:
    member = cluster.leader() if victim == "leader" else cluster.followers()[0]
    run_id = new_run_id()
    # Both nodes name the member that is lost: their client has to move to another one.
    argv = job(backend, member.endpoint, run_id, gate=gate)
    with launcher(*argv) as a, launcher(*argv) as b:
        wait_held((a, b), JOB)
        lost_at = time.time()
        cluster.kill(member)  # the leader: returns once the others elected a new one
        # The job goes on meanwhile: hold it until torch's keep-alive of every node went
        # through etcd again, past the writes that the loss failed.
        lease_lost: list[str] = []
        if backend == "etcd-v2":
            wait_v2_heartbeats(cluster, run_id, lost_at, (a, b))
        else:
            lease_lost = wait_etcd_leases(cluster, run_id, lost_at, (a, b))
        gate.release()
        assert finish_all((a, b), JOB) == [0, 0], a.stderr + b.stderr

    done = both((a, b), "done")
    assert sorted(int(d["rank"]) for d in done) == [0, 1, 2, 3]
    assert {(d["world"], d["sum"], d["restart"]) for d in done} == {("4", "6", "0")}
    # The member comes back from its data and rejoins: three healthy members again.
    cluster.restart(member)
    assert len(cluster.running) == 3
    assert cluster.leader() in cluster.running
    if lease_lost:
        # The job finished, but its nodes' leases are gone: a node that joins later
        # finds the round dead. torch's bug, not this launcher's; 5 runs of 9 here.
        pytest.xfail(f"torch's etcd lease thread died on the leader's loss:\n{lease_lost[0]}")


# -- losing a node ----------------------------------------------------------------------

#: ``--rdzv-conf`` for a quick recovery. torch's defaults wait 30 s (``last_call_timeout``)
#: for more nodes once the survivor alone is enough, and ``etcd-v2`` takes 15 s
#: (``keep_alive_interval`` 5 s x ``keep_alive_max_attempt`` 3) to drop a silent node;
#: ``etcd`` drops a node when its lease expires, 10 s after its last refresh (torch's
#: constant, no option).
QUICK_RECOVERY = {
    # Nothing: the agents forget the lost node and close the round themselves.
    "etcd-v2": "",
    "etcd": "last_call_timeout=1",
}
#: Seconds from the SIGKILL to the survivor's workers running again, at most. Measured
#: here (2 cores): 3-5 s for etcd-v2 at torch's defaults, 8-9 s for etcd with
#: QUICK_RECOVERY.
RECOVERY_LIMIT = 20.0


#: Seconds the first node may take to write the run's rendezvous into etcd: the
#: launcher's start and its join.
JOINED = 30.0


def wait_joined(cluster: EtcdCluster, backend: str, run_id: str, timeout: float = JOINED) -> None:
    """Wait until a node wrote the run's rendezvous into etcd (it joined)."""
    key = (
        V2_STATE_KEY.format(run_id=run_id)
        if backend == "etcd-v2"
        else ETCD_RUN_DIR.format(run_id=run_id) + "/rdzv/active_version"
    )
    node, index = cluster.read(key)
    if node is None:
        assert cluster.watch(key, index, timeout) is not None, f"nobody joined at {key}"


@pytest.mark.parametrize("victim", ["first", "second"])
@pytest.mark.parametrize("backend", BACKENDS)
# 30 s the cluster + 30 s the first node's join + 50 s the job to the gate + 30 s the
# killed launcher's end + 50 s the survivor's restart and end + 20 s = 210 s
@limit(READY_TIMEOUT, JOINED, JOB, GONE, JOB)
def test_the_survivor_of_a_killed_launcher_restarts_alone_and_finishes(
    cluster: EtcdCluster,
    gate: Gate,
    backend: str,
    victim: str,
    record_property: pytest.RecordProperty,
) -> None:
    run_id = new_run_id()
    argv = job(
        backend,
        cluster.members[0].endpoint,
        run_id,
        nnodes="1:2",
        conf=QUICK_RECOVERY[backend],
        max_restarts=1,
        gate=gate,
    )
    with launcher(*argv) as first:
        # The first node is in the rendezvous before the second starts. (It may start
        # alone, last_call_timeout being short, and grow to two nodes when the second
        # joins: the workers hold at the gate only at four.)
        wait_joined(cluster, backend, run_id)
        with launcher(*argv) as second:
            wait_held((first, second), JOB)
            killed, survivor = (first, second) if victim == "first" else (second, first)
            killed_group = {r["group"] for r in lines(killed, "ready")}
            killed_at = time.time()
            killed.proc.kill()  # SIGKILL: no goodbye; its workers die with it
            killed.finish(GONE)
            # The survivor's workers go on into an all_reduce with the dead peers, fail,
            # and the survivor restarts alone.
            gate.release()
            assert survivor.finish(JOB) == 0, survivor.stderr

    again = [s for s in lines(survivor, "sum") if s["restart"] == "1"]
    assert sorted(int(s["rank"]) for s in again) == [0, 1], survivor.stdout
    assert {(s["world"], s["group"], s["sum"]) for s in again} == {("2", "0", "1")}
    restarted = max(float(s["time"]) for s in lines(survivor, "start") if s["restart"] == "1")
    summed = max(float(s["time"]) for s in again)
    recovery = restarted - killed_at
    record_property("killed_group_rank", ",".join(sorted(killed_group)))
    record_property("recovery_to_user_code_s", round(recovery, 2))
    record_property("recovery_to_first_all_reduce_s", round(summed - killed_at, 2))
    assert recovery < RECOVERY_LIMIT, f"recovery took {recovery:.1f} s:\n{survivor.stderr}"
