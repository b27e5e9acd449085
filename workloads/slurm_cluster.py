"""A real three-node SLURM cluster on this one machine, for the tests of life under SLURM.

Debian's ``slurmd`` runs several daemons per host (``slurmd -N nK``, each node with its own
``Port``). Each node gets a hostname of its own (``unshare --uts --mount``: ``hostname nK``)
and a hosts file bind-mounted over ``/etc/hosts`` inside its mount namespace that maps
``n1``..``n3`` to 127.0.1.1..3, so a job's tasks on node K see ``hostname`` = ``nK`` and
resolve the other nodes as a real cluster's would. All nodes share one network namespace:
a fixed port taken on one node is taken on all of them (as the issue says, a port per job
and step is what keeps two steps apart).

The controller, munge (its own key and socket, named to SLURM by ``AuthInfo``) and the
node daemons run in the foreground as children of the test process, with a log each in the
cluster's directory; ``proctrack/linuxproc``, ``task/none``, no accounting. A crashed node
is every process in its UTS namespace SIGKILLed at once (the daemon, its step daemons and
the job's processes), as a machine that loses power; :meth:`SlurmCluster.restart` brings
the daemon back and waits for the controller to call the node idle again.

Readiness has no event to wait on (the controller announces nothing), so the waits poll
``sinfo`` with a deadline. Where SLURM cannot run here, :class:`SlurmUnavailable` says
why: the tests skip on it (fail under ``CI=true``, where ``.ci/run`` installed SLURM), the
benchmark reports ``n/a``.

Used by ``tests/support/slurm_cluster.py`` (the tests' session fixture) and
``benchmarks/measures/slurm.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aioelastic import free_port

#: The node names, their addresses and how many CPUs each tells the controller it has.
NODES = ("n1", "n2", "n3")
ADDRESSES = {name: f"127.0.1.{k}" for k, name in enumerate(NODES, start=1)}
CPUS = 2
#: Seconds between SLURM's SIGTERM and its SIGKILL of a job's processes (30 by default;
#: short here so a test of a job that ignores SIGTERM ends soon).
KILL_WAIT = 5
#: Seconds without an answer from a node before the controller declares it DOWN.
SLURMD_TIMEOUT = 10
#: Seconds a job step's credential lives; a requeued job becomes eligible after it.
CRED_EXPIRE = 10
#: Seconds a start, a restart or a job's end may take before the test fails.
READY_TIMEOUT = 60.0
#: What to install when a program is missing.
INSTALL = "apt-get install slurmd slurmctld slurm-client munge"
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo", "unshare")


class SlurmUnavailable(RuntimeError):
    """SLURM cannot run here: a program is missing or a daemon did not start (the reason)."""


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free a moment ago."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def missing_programs() -> list[str]:
    """The programs the cluster needs that are not on ``PATH``."""
    return [name for name in PROGRAMS if shutil.which(name) is None]


def _config(directory: Path, ports: Sequence[int], first_job_id: int) -> str:
    controller_port, *node_ports = ports
    lines = [
        "ClusterName=aioelastic",
        # aioelastic-run's store port comes from the job id: two clusters on one machine
        # (test sessions, a benchmark) that both count from 1 would meet on it.
        f"FirstJobId={first_job_id}",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={controller_port}",
        "AuthType=auth/munge",
        # cred_expire: a requeued job waits this long plus one second before it may run
        # again (120 s by default); short here so a requeue test does not wait minutes.
        f"AuthInfo=socket={directory / 'munge.socket'},cred_expire={CRED_EXPIRE}",
        "CredType=cred/munge",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool'}/%n",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd'}-%n.pid",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'slurmd'}-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        # A node that comes back after a crash serves again without an administrator.
        "ReturnToService=2",
        f"KillWait={KILL_WAIT}",
        f"SlurmdTimeout={SLURMD_TIMEOUT}",
        "InactiveLimit=0",
        "MinJobAge=2",
        "JobRequeue=1",
    ]
    for (name, address), port in zip(ADDRESSES.items(), node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeAddr={address} NodeHostname={name} Port={port} "
            f"CPUs={CPUS} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName=main Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES"
    )
    return "\n".join(lines) + "\n"


def _uts_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return None


@dataclass
class Run:
    """A SLURM command's exit status and output."""

    code: int
    out: str
    err: str


class SlurmCluster:
    """Three nodes, a controller and munge, all under ``directory``; see the module doc."""

    def __init__(
        self, directory: Path, private_env: Sequence[str] = (), first_job_id: int = 1
    ) -> None:
        """A cluster under ``directory``.

        Args:
            directory: where its configuration, state, sockets and logs go.
            private_env: variables of this process's environment the daemons do not get.
            first_job_id: the first job's id (SLURM's ``FirstJobId``).
        """
        self.directory = directory
        self._private_env = tuple(private_env)
        self._first_job_id = first_job_id
        self.conf = directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    # -- life -----------------------------------------------------------------------------

    def start(self) -> None:
        """Write the configuration, start munge, the controller and every node; wait idle."""
        missing = missing_programs()
        if missing:
            raise SlurmUnavailable(f"SLURM is not installed (no {', '.join(missing)}): {INSTALL}")
        for sub in ("state", "spool", "munge"):
            (self.directory / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in NODES:
            (self.directory / "spool" / name).mkdir(exist_ok=True)
        key = self.directory / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(
            _config(self.directory, _free_ports(1 + len(NODES)), self._first_job_id)
        )
        (self.directory / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in ADDRESSES.items())
        )
        self._daemon(
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={self.directory / 'munge.socket'}",
                f"--pid-file={self.directory / 'munge' / 'munged.pid'}",
                f"--seed-file={self.directory / 'munge' / 'seed'}",
                f"--log-file={self.directory / 'munged.log'}",
            ],
        )
        self._wait_path(self.directory / "munge.socket", "munged")
        self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
        for name in NODES:
            self._start_node(name)
        self.wait_idle(NODES)

    def _daemon(self, name: str, argv: list[str]) -> None:
        # The daemons' environment without, say, the leak check's mark of the test that
        # happens to start the cluster: they outlive it on purpose (see `pids`).
        env = {k: v for k, v in self.env.items() if k not in self._private_env}
        with open(self.directory / f"{name}.out", "ab") as out:
            self._daemons[name] = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )

    def _start_node(self, name: str) -> None:
        # A private mount namespace, so the bind mount over /etc/hosts is this node's only;
        # `exec` keeps the daemon's pid the one `Popen` knows (and reaps).
        script = (
            f"hostname {name} && mount --bind {self.directory / 'hosts'} /etc/hosts && "
            f"exec slurmd -D -f {self.conf} -N {name}"
        )
        self._daemon(
            name, ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script]
        )

    def _wait_path(self, path: Path, daemon: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not path.exists():
            if self._daemons[daemon].poll() is not None:
                raise SlurmUnavailable(f"{daemon} exited at start: {self.log(daemon)[-2000:]}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"{daemon} did not start in {READY_TIMEOUT} s")
            time.sleep(0.05)

    def log(self, daemon: str) -> str:
        """What ``daemon`` (``munged``, ``slurmctld``, ``n1``...) wrote, for a failure's story."""
        parts = []
        for path in (
            self.directory / f"{daemon}.out",
            self.directory / f"{'slurmd-' if daemon in NODES else ''}{daemon}.log",
        ):
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` tells it (``idle``, ``alloc``, ``down*``...)."""
        run = self.command(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10)
        states = {}
        for line in run.out.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def wait_idle(self, names: Sequence[str], timeout: float = READY_TIMEOUT) -> None:
        """Poll until every node of ``names`` is idle (no event tells it); else skip/fail."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for daemon, proc in self._daemons.items():
                if proc.poll() is not None and (daemon not in NODES or daemon in names):
                    raise SlurmUnavailable(f"{daemon} exited: {self.log(daemon)[-2000:]}")
            states = self.node_states()
            if all(states.get(name) == "idle" for name in names):
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"the nodes did not all become idle in {timeout} s: {states}")

    def pids(self) -> set[int]:
        """The daemons' pids: long-lived on purpose, not a test's leak."""
        return {proc.pid for proc in self._daemons.values() if proc.poll() is None}

    def node_pids(self, name: str) -> list[int]:
        """Every process on node ``name``: those in its daemon's UTS namespace."""
        namespace = _uts_namespace(self._daemons[name].pid)
        if namespace is None:
            return []
        return [
            int(entry)
            for entry in os.listdir("/proc")
            if entry.isdigit() and _uts_namespace(int(entry)) == namespace
        ]

    def crash(self, name: str) -> None:
        """Node ``name`` loses power: every process on it SIGKILLed, the daemon reaped."""
        # Repeated until none is left: a step daemon may fork while the first round runs.
        for _ in range(20):
            pids = self.node_pids(name)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._daemons[name].wait(timeout=10)
        self._daemons[name].wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start node ``name``'s daemon again and wait until the controller calls it idle."""
        self._start_node(name)
        self.wait_idle([name], timeout=SLURMD_TIMEOUT * 3 + READY_TIMEOUT)

    def close(self) -> None:
        """Stop every node (its processes too), the controller and munge; reap them all."""
        for name in NODES:
            if name in self._daemons and self._daemons[name].poll() is None:
                self.crash(name)
        for proc in self._daemons.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    # -- jobs -----------------------------------------------------------------------------

    def command(self, argv: Sequence[str], timeout: float = 30, **env: str) -> Run:
        """Run a SLURM client command (``squeue``, ``scancel``, ``sbatch``...) to its end."""
        done = subprocess.run(
            list(argv), env={**self.env, **env}, capture_output=True, text=True, timeout=timeout
        )
        return Run(done.returncode, done.stdout, done.stderr)

    def popen(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[str]:
        """Start a SLURM client command (``srun ...``) with the cluster's configuration."""
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            list(argv), env={**self.env, **(env or {})}, text=True, **kwargs
        )

    def job_state(self, job_id: str) -> str:
        """The job's state (``RUNNING``, ``PENDING``...), or ``""`` once it left the queue."""
        return self.command(["squeue", "-h", "-j", job_id, "-o", "%T"]).out.strip()
