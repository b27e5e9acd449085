"""``aioelastic-run`` launchers of one job over an etcd cluster, for the etcd tests.

The launchers run ``tests/children/etcd_job.py`` (two gloo workers each), whose workers
hold at a FIFO the test controls (`Gate`) while the test acts on the cluster
(`tests.support.etcd_cluster`). Shared by the tests of ``tests/elastic/rendezvous/``: the
backends at work (``test_etcd.py``) and a cluster that loses its quorum
(``test_etcd_quorum.py``).

Each test's pytest timeout is the sum of its waits plus `ALLOWANCE` (`limit`), and fails
that test only.
"""

from __future__ import annotations

import base64
import os
import pickle
import re
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.cli_run import Launcher
from tests.support.etcd_cluster import EtcdCluster
from tests.support.paths import CHILDREN
from tests.support.waits import make_fifo

SCRIPT = str(CHILDREN / "etcd_job.py")
#: A worker of a four-worker job holding at the gate.
READY = re.compile(r"^ready .*world=4 ")

#: torch's key of an ``etcd-v2`` run's state.
V2_STATE_KEY = "/torch/elastic/rendezvous/{run_id}"
#: How long a node's keep-alive may take to go through again after a member is lost:
#: etcd fails a write caught by a leader's loss after 5 s plus twice its election timeout
#: (7 s), and a heartbeat or lease refresh comes every 5 s.
KEEPALIVE_WAIT = 20.0

#: Seconds a job may take to reach what the test waits for (its workers holding at the
#: gate, or its end): the launcher's start with torch's import, the rendezvous through
#: etcd, gloo's set-up and an all_reduce or two. 10-20 s here, on 2 loaded cores.
JOB = 50.0
#: Seconds a test may take beyond the sum of its waits: starting and SIGKILLing processes
#: (the launchers', the members'), etcd's short requests (milliseconds here, at most
#: `tests.support.etcd_cluster.REQUEST_TIMEOUT` each), the checks.
ALLOWANCE = 20.0


def limit(*waits: float) -> pytest.MarkDecorator:
    """The test's timeout: the sum of its ``waits`` plus `ALLOWANCE`; it fails that test only.

    The suite's timeouts use the "thread" method (pyproject.toml), which ends the whole
    session, because the "signal" method can hang an event loop's shielded teardown. These
    tests run no event loop: they block in the main thread (a process's wait, a condition,
    an HTTP read), which SIGALRM interrupts; its exception fails the test, and the
    fixtures still kill the launchers and the cluster on the way out.
    """
    return pytest.mark.timeout(sum(waits) + ALLOWANCE, method="signal")


class Gate:
    """A FIFO that workers hold at until the test closes its end.

    The test's end is opened read-write, so neither its open nor the workers' (read-only)
    opens block; each worker then reads until EOF, which comes for all of them when the
    test closes its end (`release`).
    """

    def __init__(self, directory: Path) -> None:
        self.path = make_fifo(directory, "gate.fifo")
        self._fd: int | None = os.open(self.path, os.O_RDWR)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def job(
    backend: str,
    endpoint: str,
    run_id: str,
    *,
    nnodes: str = "2",
    conf: str = "",
    max_restarts: int = 0,
    gate: Gate | None = None,
    flags: Sequence[str] = (),
) -> list[str]:
    """``aioelastic-run`` arguments: two workers of etcd_job.py on this node; ``flags``
    go before the script."""
    argv = ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", backend,
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--max-restarts", str(max_restarts), *flags]  # fmt: skip
    if conf:
        argv += ["--rdzv-conf", conf]
    argv.append(SCRIPT)
    if gate is not None:
        argv += ["--gate", str(gate.path)]
    return argv


def lines(run: Launcher, kind: str) -> list[dict[str, str]]:
    """The ``kind`` lines of etcd_job.py on a launcher's stdout, as ``{field: value}``."""
    return [
        dict(item.split("=", 1) for item in line.split()[1:])
        for line in run.out
        if line.startswith(f"{kind} ")
    ]


def both(runs: tuple[Launcher, ...], kind: str) -> list[dict[str, str]]:
    return [found for run in runs for found in lines(run, kind)]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def finish_all(runs: tuple[Launcher, ...], timeout: float) -> list[int]:
    """The exit statuses of ``runs``, which all end within one ``timeout``."""
    deadline = time.monotonic() + timeout
    return [run.finish(max(0.0, deadline - time.monotonic())) for run in runs]


def wait_held(runs: tuple[Launcher, ...], timeout: float) -> None:
    """Wait until the two workers of each of ``runs`` hold at the gate, within ``timeout``."""
    deadline = time.monotonic() + timeout
    for run in runs:
        run.wait_for(READY, 2, max(0.0, deadline - time.monotonic()))


def still_running(runs: tuple[Launcher, ...]) -> None:
    """Fail, with its output, if a launcher exited while the test waits on its job."""
    for run in runs:
        assert run.proc.poll() is None, (
            f"a launcher exited ({run.proc.returncode}):\n{run.stdout}\n{run.stderr}"
        )


def v2_heartbeats(node: dict[str, object] | None) -> dict[str, datetime]:
    """``{node: last heartbeat}`` of torch's ``etcd-v2`` state, as its key holds it."""
    if node is None or "value" not in node:
        return {}
    # torch's own pickle of its state (base64 in the key); unpickling imports torch.
    state = pickle.loads(base64.b64decode(str(node["value"])))
    return {repr(n): state.last_heartbeats[n] for n in state.participants}


def wait_v2_heartbeats(
    cluster: EtcdCluster, run_id: str, since: float, runs: tuple[Launcher, ...]
) -> None:
    """Wait until every node of the round wrote a keep-alive heartbeat after ``since``.

    Each heartbeat rewrites the run's state key, so this watches that key (a watch
    returns at the next write, or after at most a second to look at the launchers).
    """
    key = V2_STATE_KEY.format(run_id=run_id)
    deadline = time.monotonic() + KEEPALIVE_WAIT
    node, index = cluster.read(key)
    while True:
        beats = v2_heartbeats(node)
        if beats and all(beat.timestamp() > since for beat in beats.values()):
            return
        still_running(runs)
        left = deadline - time.monotonic()
        assert left > 0, f"heartbeats not renewed since the loss: {beats}\n" + "\n".join(
            run.stderr for run in runs
        )
        event = cluster.watch(key, index, min(left, 1.0))
        if event is not None:
            node, index = event["node"], int(event["node"]["modifiedIndex"])
