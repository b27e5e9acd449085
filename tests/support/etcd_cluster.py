"""A real three-member etcd cluster on 127.0.0.1, for the tests of torch's etcd backends.

torch's ``etcd`` and ``etcd-v2`` rendezvous backends speak etcd's v2 API through the
``python-etcd`` client. etcd 3.4 (Debian 12's ``etcd-server``) and 3.5 serve that API only
with ``--enable-v2=true``; 3.6 removed it, so those backends cannot run against it at all.

Every member listens on free ports of 127.0.0.1 and keeps its data under the test's
directory. Readiness is event-driven: each member logs (zap, JSON lines on stderr) when it
has published itself to the cluster through raft (which needs an elected leader) and when
it serves clients; a reader thread per member hands those lines over, and the cluster's
own ``/health`` then confirms. The log of every member incarnation is also kept in
``<directory>/<name>.log`` for a failing test's post-mortem.

``close()`` SIGKILLs and reaps every member still running and joins its reader: nothing
is left behind for the suite's leak check, which would see a stray member by the test's
mark in its environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.support.ports import free_ports

#: The etcd binary the tests use, when set: read before ``PATH`` (CI sets Debian's
#: ``/usr/bin/etcd``, so that another etcd earlier on ``PATH`` cannot stand in for it).
BINARY_VAR = "AIOELASTIC_TEST_ETCD"
#: What to install when the server is missing. Debian 12 ships etcd 3.4, which serves v2.
INSTALL_SERVER = (
    f"needs an etcd server with the v2 API (${BINARY_VAR}, else etcd on PATH): "
    "apt-get install etcd-server "
    "(etcd 3.4 or 3.5; 3.6 removed the v2 API that torch's etcd backends use)"
)
#: What to install when the client torch's etcd backends import is missing.
INSTALL_CLIENT = (
    "needs the python-etcd client of torch's etcd backends: "
    "pip install -e '.[etcd]' (or pip install 'python-etcd>=0.4.5')"
)

#: A member logs these (zap's ``msg``) once it is part of a cluster with a leader, and
#: once its client listener serves; both, and the member is ready.
PUBLISHED = "published local member to cluster through raft"
SERVING = "serving client traffic"
#: raft's line, in every member that learns of a new leader.
ELECTED = re.compile(r"elected leader [0-9a-f]+ at term")

#: Seconds a start, a restart or an election may take before the test fails.
READY_TIMEOUT = 30.0
#: Seconds one HTTP request to a member may take.
REQUEST_TIMEOUT = 5.0


def unavailable(reason: str) -> NoReturn:
    """Skip the test for ``reason``; under ``CI=true``, fail it.

    A developer's machine may lack etcd; CI installs it (``.ci/run``), so there a missing
    server or client is a broken set-up that must not turn the etcd tests into skips and
    leave the run green.
    """
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the etcd tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def etcd_binary() -> str:
    """The etcd server binary, or skip (fail under CI) saying what to install."""
    path = os.environ.get(BINARY_VAR) or shutil.which("etcd")
    if path is None or not os.access(path, os.X_OK):
        named = f" (${BINARY_VAR}={path} is no executable)" if path else ""
        unavailable(INSTALL_SERVER + named)
    version = server_version(path)
    if version is not None and version >= (3, 6):
        unavailable(
            f"etcd {'.'.join(map(str, version))} at {path} has no v2 API; " + INSTALL_SERVER
        )
    return path


def require_client() -> None:
    """Skip (fail under CI) unless torch's etcd client, ``python-etcd``, imports.

    Imported, not looked up among the installed distributions: what counts is the module
    torch will import, ``etcd``, and that it has the two names of python-etcd that torch
    and the launcher use (the PyPI package named ``etcd`` is another client).
    """
    try:
        import etcd  # type: ignore[import-untyped]
    except ImportError as e:
        failed = str(e)
    else:
        failed = None
    if failed is not None:
        unavailable(f"{INSTALL_CLIENT} (import etcd: {failed})")
    if not (hasattr(etcd, "Client") and hasattr(etcd, "EtcdException")):
        where = getattr(etcd, "__file__", None) or etcd.__path__
        unavailable(f"{INSTALL_CLIENT} (the etcd module at {where} is not python-etcd)")


def server_version(path: str) -> tuple[int, int] | None:
    """``(major, minor)`` of the etcd at ``path`` (``None`` if it does not say)."""
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    found = re.search(r"etcd Version: (\d+)\.(\d+)", done.stdout)
    return (int(found[1]), int(found[2])) if found else None


def _server_env() -> dict[str, str]:
    """This process's environment without ``ETCD*`` variables.

    etcd reads every flag from an ``ETCD_<FLAG>`` variable too, so a developer's
    ``ETCD_DATA_DIR`` or ``ETCD_ENABLE_V2=false`` would change the cluster under test.
    The test's leak mark stays: a member left running is found by it.
    """
    return {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}


#: Talks to the members directly: a proxy from the environment must not relay loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Member:
    """One etcd member: its ports, its data directory, and its current process (if any)."""

    def __init__(self, name: str, client_port: int, peer_port: int, directory: Path) -> None:
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = directory / name
        self.log_path = directory / f"{name}.log"
        self.process: subprocess.Popen[str] | None = None
        #: The log lines of the current incarnation, appended by the reader thread.
        self.lines: list[str] = []
        self.exited = False
        self._changed = threading.Condition()
        self._reader: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` of its client API, as ``--rdzv-endpoint`` takes it."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __repr__(self) -> str:
        state = f"pid {self.process.pid}" if self.running else "stopped"  # type: ignore[union-attr]
        return f"<etcd member {self.name} {self.endpoint} {state}>"

    def start(self, binary: str, initial_cluster: str, token: str) -> None:
        """Start its process (a new incarnation: fresh ``lines``); does not wait."""
        assert not self.running, f"{self} already runs"
        argv = [
            binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            # Read only when the data directory is new: a restart rejoins from its data.
            "--initial-cluster", initial_cluster,
            "--initial-cluster-token", token,
            "--initial-cluster-state", "new",
            "--enable-v2=true",
            "--logger=zap",
            "--log-outputs=stderr",
        ]  # fmt: skip
        with self._changed:
            self.lines = []
            self.exited = False
        self.process = subprocess.Popen(
            argv,
            env=_server_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(
            target=self._read, args=(self.process,), name=f"etcd-{self.name}-log", daemon=True
        )
        self._reader.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        with open(self.log_path, "a") as log:
            log.write(f"--- pid {process.pid}\n")
            for line in process.stderr:
                log.write(line)
                log.flush()
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self.exited = True
            self._changed.notify_all()

    def messages(self, since: int = 0) -> list[str]:
        """The ``msg`` of each log line of this incarnation from line ``since`` on."""
        found = []
        with self._changed:
            lines = self.lines[since:]
        for line in lines:
            try:
                found.append(str(json.loads(line).get("msg", "")))
            except ValueError:
                found.append(line.rstrip("\n"))  # not zap's (a Go panic, say)
        return found

    def wait_logged(self, found: Callable[[list[str]], bool], what: str, timeout: float) -> None:
        """Wait until ``found(messages)`` holds for its log; fail if it exits or times out."""
        with self._changed:
            ok = self._changed.wait_for(lambda: self.exited or found(self.messages()), timeout)
        if not ok or not found(self.messages()):
            why = "exited" if self.exited else f"did not within {timeout:g} s"
            raise AssertionError(f"{self} {why} ({what}); its log:\n{self.tail()}")

    def tail(self, count: int = 30) -> str:
        with self._changed:
            return "".join(self.lines[-count:])

    def get(self, path: str) -> Any:
        """``GET`` a JSON document of its client API."""
        with _OPENER.open(self.client_url + path, timeout=REQUEST_TIMEOUT) as response:
            return json.loads(response.read())

    def status(self) -> dict[str, Any]:
        """Its v3 status (ids as decimal strings): ``header.member_id``, ``leader``, ..."""
        request = urllib.request.Request(
            self.client_url + "/v3/maintenance/status", data=b"{}", method="POST"
        )
        with _OPENER.open(request, timeout=REQUEST_TIMEOUT) as response:
            return dict(json.loads(response.read()))

    def kill(self) -> None:
        """SIGKILL it (no goodbye to its peers: a crash), reap it, join its reader."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        if self._reader is not None:
            self._reader.join(timeout=30)
        assert process.stderr is not None
        process.stderr.close()
        self.process = None
        self._reader = None


class EtcdCluster:
    """Three (or ``size``) etcd members on 127.0.0.1 with the v2 API on.

    Use as a context manager (`etcd_cluster`): ``start()`` on entry waits until every
    member is ready, ``close()`` on exit leaves no process behind.
    """

    def __init__(self, directory: Path, size: int = 3, binary: str | None = None) -> None:
        self.directory = directory
        self.binary = binary or etcd_binary()
        ports = free_ports(2 * size)
        self.members = [
            Member(f"m{i}", ports[2 * i], ports[2 * i + 1], directory) for i in range(size)
        ]
        self.token = uuid.uuid4().hex
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def __repr__(self) -> str:
        return f"<EtcdCluster {self.members}>"

    @property
    def running(self) -> list[Member]:
        return [m for m in self.members if m.running]

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def start(self) -> None:
        """Start every member together (a new cluster needs a quorum) and wait for all."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for m in self.members:
            m.start(self.binary, self.initial_cluster, self.token)
        self.wait_ready(self.members)

    def wait_ready(self, members: list[Member], timeout: float = READY_TIMEOUT) -> None:
        """Wait until ``members`` published themselves and serve; confirm with ``/health``."""
        deadline = time.monotonic() + timeout
        for m in members:
            m.wait_logged(
                lambda msgs: (
                    any(x == PUBLISHED for x in msgs) and any(x.startswith(SERVING) for x in msgs)
                ),
                "publish itself to the cluster and serve clients",
                max(0.0, deadline - time.monotonic()),
            )
        for m in self.running:
            health = m.get("/health")
            assert health.get("health") == "true", f"{m}: /health says {health}"

    def leader(self) -> Member:
        """The raft leader now: the member every running member names as leader.

        Asked through the v3 status call, which reads raft's own state: after a leader's
        loss, the v2 ``/v2/stats/self`` of both survivors was seen saying ``StateLeader``.
        """
        statuses = {m.name: m.status() for m in self.running}
        named = {status["leader"] for status in statuses.values()}
        assert len(named) == 1, f"the members name different leaders: {statuses}"
        leaders = [m for m in self.running if statuses[m.name]["header"]["member_id"] in named]
        assert len(leaders) == 1, f"no running member is the leader: {statuses}"
        return leaders[0]

    def followers(self) -> list[Member]:
        leader = self.leader()
        return [m for m in self.running if m is not leader]

    def kill(self, member: Member | None = None) -> Member:
        """SIGKILL one member (the leader unless ``member``) and reap it; return it.

        When it was the leader, waits until the others elected a new one.
        """
        victim = member or self.leader()
        was_leader = victim is self.leader()
        survivors = [m for m in self.running if m is not victim]
        marks = {m.name: len(m.lines) for m in survivors}
        victim.kill()
        if was_leader:
            self.wait_new_leader(survivors, marks)
        return victim

    def wait_new_leader(
        self, survivors: list[Member], marks: dict[str, int], timeout: float = READY_TIMEOUT
    ) -> Member:
        """Wait until every survivor logged an election after its line ``marks[name]``.

        Returns the new leader, as the members report it.
        """
        deadline = time.monotonic() + timeout
        for m in survivors:
            since = marks[m.name]
            m.wait_logged(
                lambda msgs, since=since: any(ELECTED.search(x) for x in msgs[since:]),
                "learn of a new leader",
                max(0.0, deadline - time.monotonic()),
            )
        return self.leader()

    def read(self, key: str, **params: str) -> tuple[dict[str, Any] | None, int]:
        """A key (or directory) through the v2 API, and the cluster's index then.

        Returns ``(None, index)`` when the key does not exist. Asks a running member.
        """
        query = urllib.parse.urlencode(params)
        url = f"{self.running[0].client_url}/v2/keys{key}" + (f"?{query}" if query else "")
        try:
            with _OPENER.open(url, timeout=REQUEST_TIMEOUT) as response:
                return json.loads(response.read())["node"], int(response.headers["X-Etcd-Index"])
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            return None, int(e.headers["X-Etcd-Index"])

    def watch(
        self, key: str, after: int, timeout: float, recursive: bool = False
    ) -> dict[str, Any] | None:
        """The first change of ``key`` (or under it) past index ``after``; None on timeout.

        Served from etcd's event history when it already happened, else a long poll.
        Refreshing a key's TTL without a value is not an event: that is not seen here.
        """
        params = {"wait": "true", "waitIndex": str(after + 1)}
        if recursive:
            params["recursive"] = "true"
        url = f"{self.running[0].client_url}/v2/keys{key}?{urllib.parse.urlencode(params)}"
        try:
            with _OPENER.open(url, timeout=max(0.1, timeout)) as response:
                # etcd sends the headers at once and the event when it happens.
                return dict(json.loads(response.read()))
        except TimeoutError:
            return None

    def kill_all_but(self, keep: Member) -> list[Member]:
        """SIGKILL and reap every running member but ``keep``; return them.

        Two of three: the cluster loses its quorum, and no election can follow (unlike
        `kill`, this waits for none). Every write then fails after etcd's request timeout.
        """
        victims = [m for m in self.running if m is not keep]
        for m in victims:
            m.kill()
        return victims

    def restart(self, *members: Member) -> None:
        """Start killed members again from their data directories, all at once (two of
        three bring the quorum back together); wait until every one serves."""
        for m in members:
            m.start(self.binary, self.initial_cluster, self.token)
        self.wait_ready(list(members))

    def close(self) -> None:
        """SIGKILL and reap every member; nothing stays running."""
        errors = []
        for m in self.members:
            try:
                m.kill()
            except Exception as e:  # keep killing the others
                errors.append(e)
        if errors:
            raise errors[0]


@contextlib.contextmanager
def etcd_cluster(directory: Path, size: int = 3) -> Iterator[EtcdCluster]:
    """A started cluster of ``size`` members under ``directory``, closed on the way out.

    Skips the test (fails it under ``CI=true``) when no etcd server with the v2 API is
    installed.
    """
    cluster = EtcdCluster(directory, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
