"""Several ``aioelastic-run`` launchers of one job on 127.0.0.1, 127.0.0.2, ... over c10d.

Each launcher runs in a session of its own, as on separate machines, and runs
``tests/children/multinode_job.py``, whose ranks block the way NCCL ranks do. Shared by the
multi-node tests (``tests/elastic/channel/``);
`lasted_pattern` by every test that reads a node's report of a lost store.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from aioelastic._elastic.channel._job_channel import BEAT
from aioelastic._elastic.channel._liveness import DEAD_AFTER
from tests.support.cli_run import Launcher, with_env
from tests.support.paths import CHILDREN
from tests.support.ports import free_port
from tests.support.waits import make_fifo

JOB = str(CHILDREN / "multinode_job.py")
READY = re.compile(r"ready rank=(\d+) restart=(\d+) pid=(\d+)")
DONE = re.compile(r"done rank=(\d+) restart=(\d+)")
#: What "every node ended or restarted in seconds" means here for an end told through the
#: store (measured: about 1 s; the regression it guards, an end heard by no one, never ends).
BOUND = 10.0
#: The same for a node found vanished: DEAD_AFTER of silence and a beat, then the launchers'
#: way out, which took 1-2.7 s on a loaded 2-core machine (6-7.7 s in all), given twice
#: that and some (10 s). Still far under what it guards against: without the liveness ring
#: silent ranks never end, and torch's keep-alive and last call take about 45 s.
VANISHED_BOUND = DEAD_AFTER + BEAT + 10.0


class Job:
    """``nodes`` launchers of one job, node i on 127.0.0.(i+1), node 0 hosting the store."""

    def __init__(self, tmp_path: Path, nodes: int, *, mode: str = "hang", **env: str) -> None:
        self.tmp_path = tmp_path
        self.nodes = nodes
        self.go = make_fifo(tmp_path, "go")
        self.mode = mode
        self.env = with_env(**env)
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.run_id = uuid.uuid4().hex[:8]
        self.launchers: list[Launcher] = []

    def start(
        self,
        *flags: str,
        nnodes: str | None = None,
        last_call: bool = True,
        node_flags: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        """Start the launchers; ``last_call=False`` keeps torch's last call (30 s).

        ``node_flags``: flags given to one node's launcher only, by node.
        """
        for node in range(self.nodes):
            conf = f"join_timeout=60,is_host={int(node == 0)}"
            if last_call:
                conf += ",last_call_timeout=1"
            self.launchers.append(
                Launcher(
                    [
                        f"--nnodes={nnodes or self.nodes}",
                        "--nproc-per-node=2",
                        "--rdzv-backend=c10d",
                        f"--rdzv-endpoint={self.endpoint}",
                        f"--rdzv-id={self.run_id}",
                        f"--rdzv-conf={conf}",
                        f"--local-addr=127.0.0.{node + 1}",
                        "--monitor-interval=0.1",
                        *flags,
                        *(node_flags or {}).get(node, ()),
                        JOB,
                        self.mode,
                        str(self.tmp_path),
                    ],
                    self.env,
                    new_session=True,
                )
            )

    def ready(self, restart: int = 0, timeout: float = 90) -> dict[int, int]:
        """Wait until every worker of attempt ``restart`` said ready; pids by rank."""
        pids = {}
        for node, launcher in enumerate(self.launchers):
            pattern = re.compile(rf"ready rank=(\d+) restart={restart} pid=(\d+)")
            for match in launcher.wait_for(pattern, 2, timeout):
                pids[int(match.group(1))] = int(match.group(2))
            assert len(pids) == 2 * (node + 1), pids
        return pids

    def trigger(self, timeout: float = 30) -> float:
        """Let the failing rank fail (it reads ``go``); when that was, monotonic."""
        opened = threading.Event()

        def open_for_writing() -> None:
            os.close(os.open(self.go, os.O_WRONLY))
            opened.set()

        thread = threading.Thread(target=open_for_writing, daemon=True)
        thread.start()
        assert opened.wait(timeout), "the failing rank never opened its FIFO"
        return time.monotonic()

    def finish(self, timeout: float = 90) -> list[tuple[int, float]]:
        """Each launcher's exit status and when it was seen, in node order."""
        ends = []
        for launcher in self.launchers:
            code = launcher.finish(timeout)
            ends.append((code, time.monotonic()))
        return ends

    def kill_node(self, node: int, pids: dict[int, int]) -> float:
        """SIGKILL node ``node``'s launcher and its workers, as when a machine is lost; when."""
        killed_at = time.monotonic()
        os.killpg(self.launchers[node].proc.pid, signal.SIGKILL)
        for rank in (2 * node, 2 * node + 1):
            os.kill(pids[rank], signal.SIGKILL)
        return killed_at

    def kill_all(self) -> None:
        for launcher in self.launchers:
            if launcher.proc.poll() is None:
                os.killpg(launcher.proc.pid, signal.SIGKILL)
            launcher.finish()


@contextmanager
def job(tmp_path: Path, nodes: int, **kwargs: str) -> Iterator[Job]:
    """A `Job`, every launcher's session killed on the way out (only on a failed test)."""
    running = Job(tmp_path, nodes, **kwargs)
    with ExitStack() as stack:
        stack.callback(running.kill_all)
        yield running


def ended_within(ends: list[tuple[int, float]], since: float) -> list[float]:
    return [round(seen - since, 2) for _, seen in ends]


def _tcp_rows() -> Iterator[tuple[int, int, int, int]]:
    """``(local port, remote port, unread bytes, inode)`` of every TCP socket (IPv4, IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                yield local, remote, int(fields[4].split(":")[1], 16), int(fields[9])


def request_unread(port: int, pid: int) -> bool:
    """Whether a request of process ``pid``'s sits unread at the server on ``port``: the
    server's end of a connection from one of ``pid``'s sockets holds bytes not read yet.

    With the server stopped, that is a call of ``pid``'s in flight, waiting for it. (Every
    node connects from 127.0.0.1 here: a connection is told by its client's port.)
    """
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    rows = list(_tcp_rows())
    clients = {local for local, remote, _, inode in rows if remote == port and inode in inodes}
    return any(local == port and remote in clients and unread for local, remote, unread, _ in rows)


def wait_unread(port: int, pid: int, timeout: float) -> None:
    """Wait until `request_unread` (the kernel's tables read every 10 ms: nothing else tells)."""
    deadline = time.monotonic() + timeout
    while not request_unread(port, pid):
        assert time.monotonic() < deadline, f"no request of pid {pid} waits at port {port}"
        time.sleep(0.01)


def c10d_remedy(running: Job) -> str:
    return (
        f"the c10d store at {running.endpoint} gave no answer for {{lasted}} s; it lives in "
        "the launcher of the node at 127.0.0.1, a single point of failure: --rdzv-backend "
        "etcd-v2 keeps the store in a replicated etcd cluster instead"
    )


def lasted_pattern(message: str) -> re.Pattern[str]:
    """``message`` with ``{lasted}`` standing for a duration (``10.0``)."""
    head, tail = message.split("{lasted}")
    return re.compile(re.escape(head) + r"(\d+\.\d)" + re.escape(tail))


@contextmanager
def stopped(launcher: Launcher) -> Iterator[None]:
    """``launcher`` SIGSTOPped (a wedged machine: it answers nothing), continued on exit."""
    os.kill(launcher.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(launcher.proc.pid, signal.SIGCONT)
