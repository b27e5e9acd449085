"""The soak's rounds (tests/core/group/test_soak.py): plans, what workers say, audits.

A round is drawn from a seeded generator (:func:`draw_round`); its workers
(``tests.children.soak``) tell the test through the round's FIFO what they are and what
they started (:class:`Seen`); after the round the audits check that nothing it started is
left: processes, zombies, file descriptors, temporary files, log lines.
"""

from __future__ import annotations

import os
import random
import select
import signal
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

import aioelastic
from aioelastic import Std
from aioelastic._core.process import _platform
from tests.children import (
    soak,
)
from tests.support.audit import (
    Audit,
    kill_all,
    new_zombies,
    processes_with_env,
    reaped,
)
from tests.support.waits import ReadyFifo, is_running, process_state

#: A round that takes longer than this has hung: it is failed (and its processes killed).
ROUND_TIMEOUT = 60.0

#: Bugs the soak found are pending a fix in the core (each has an xfail(strict) test in the
#: room it concerns). Until they are fixed the soak leaves out the rounds that hit them and
#: shows one kind of leftover apart ("known"), so that CI stays meaningful;
#: AIOELASTIC_SOAK_STRICT=1 (or False here once those tests pass) includes everything:
#: - tests/core/group/test_starting.py::test_a_failure_while_siblings_start_stops_them_too:
#:   a fault while the other workers are still starting ("early" rounds) leaves the late
#:   ones running; the round hangs;
#: - tests/core/child/test_error_file.py::
#:   test_a_worker_killed_while_writing_its_error_file_leaves_no_temp_file: a worker
#:   killed while recording its error leaves ``.error-*.json.tmp`` in its log directory;
#: - tests/core/group/test_settle.py: test_an_interrupt_on_a_workers_way_out_keeps_its_exit_status
#:   and test_a_stopped_worker_that_exits_0_is_not_a_failure: close(SIGINT) racing the
#:   workers' own exits reports a sys.exit(n) as "exited 0 without a return value" (not drawn).
KNOWN_BUGS_PENDING = False
STRICT = os.environ.get("AIOELASTIC_SOAK_STRICT", "0" if KNOWN_BUGS_PENDING else "1") == "1"

KIND_WEIGHTS = {
    "ok": 3,
    "big": 1,
    "exit": 2,
    "raise": 2,
    "sigkill": 2,
    "hang": 2,
    "ignore_term": 1,
    "children": 2,
}
FINISHING = ("ok", "big")
FAULTS = ("exit", "raise", "sigkill")
BLOCK_CALLS = ("event", "sleep", "read", "select")
#: Faults of the environment, one per "env" round (see tests/core/group/test_faults.py for each).
ENV_FAULTS = (
    "SIGCHLD ignored",
    "RLIMIT_NOFILE low",
    "console pipe closed",
    "unpickling raises",
    "log disk full",
    "error file is a FIFO",
    "fork server killed",
)
METHOD_WEIGHTS = {"fork": 4, "forkserver": 4, "spawn": 1, "binary": 1}
LOST = ("processes", "zombies", "fds", "temp files", "log lines")


# -- plans ------------------------------------------------------------------------------


@dataclass
class Round:
    """One round: its workers' plans and how it ends."""

    number: int
    where: str  # "here" | "signal" | "subreaper"
    method: str
    plans: list[dict[str, Any]]
    redirects: list[int]
    temp_logs: bool
    grace: float
    ending: str
    close_sig: int = signal.SIGTERM
    cancel_after: float = 0.0
    race_steps: int = 0
    #: For ending "trigger": the one fault released.
    trigger: int | None = None
    signal_to_supervisor: int = 0
    #: For rounds "env": the fault of the environment injected (ENV_FAULTS).
    env_fault: str = ""
    #: In every worker's environment (inherited by all their descendants that exec).
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def nprocs(self) -> int:
        return len(self.plans)

    def describe(self) -> str:
        kinds = ",".join(
            p["kind"] + ("+" + "+".join(p["children"]) if p["children"] else "") for p in self.plans
        )
        extra = (
            f" sig={signal.Signals(self.signal_to_supervisor).name}"
            if self.where == "signal"
            else f" fault={self.env_fault}"
            if self.where == "env"
            else ""
        )
        return (
            f"round {self.number} [{self.where} {self.method} {kinds} ending={self.ending}"
            f" trigger={self.trigger}{extra} temp_logs={self.temp_logs}]"
        )


def _weighted(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _plan_worker(
    rng: random.Random, rank: int, kind: str, method: str, redirect: int, fifo: str
) -> dict[str, Any]:
    if method == "binary" and kind == "big":
        kind = "ok"  # binary workers have no return value
    plan: dict[str, Any] = {
        "rank": rank,
        "kind": kind,
        "fifo": fifo,
        "block": rng.choice(BLOCK_CALLS),
        "children": [],
        "output": {},
    }
    if kind == "exit":
        plan["code"] = rng.choice([2, 3, 7, 42, 255])
    if kind == "big":
        plan["size"] = rng.choice([1 << 20, 4 << 20, 16 << 20])
        plan["seed"] = rng.randrange(1 << 30)
    if kind == "children" or rng.random() < 0.25:
        plan["children"] = rng.sample(["exec", "fork"], k=rng.randint(1, 2))
    for stream, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
        if redirect & bit and rng.random() < 0.75:
            plan["output"][stream] = {
                "tag": f"r{rank}{stream[3:]}",
                "lines": rng.choice([1, 40, 3000, 20000]),
                "seed": rng.randrange(1 << 30),
                "newline": rng.random() < 0.5,
                "long": rng.choice([0, 0, 0, 300_000]),
            }
    return plan


def draw_round(rng: random.Random, number: int, directory: Path) -> Round:
    """A random round (all choices from ``rng``)."""
    fifo = str(directory / "ready.fifo")
    roll = rng.random()
    where = (
        "signal"
        if roll < 0.08
        else "subreaper"
        if roll < 0.16
        else "env"
        if roll < 0.26
        else "here"
    )
    method = _weighted(rng, METHOD_WEIGHTS)
    nprocs = rng.randint(2, 4)
    redirects = [rng.choice([0, 0, 1, 2, 3]) for _ in range(nprocs)]
    weights = dict(KIND_WEIGHTS)
    if where == "signal":
        # Nothing to release: the signal to the supervisor ends the round.
        weights = {"ok": 1, "hang": 2, "ignore_term": 1, "children": 2}
    kinds = [_weighted(rng, weights) for _ in range(nprocs)]
    plans = [_plan_worker(rng, r, kinds[r], method, redirects[r], fifo) for r in range(nprocs)]
    kinds = [p["kind"] for p in plans]
    rnd = Round(
        number=number,
        where=where,
        method=method,
        plans=plans,
        redirects=redirects,
        temp_logs=rng.random() < 0.5,
        grace=rng.choice([0.0, 0.2, 0.5]),
        ending="",
    )
    faults = [r for r, k in enumerate(kinds) if k in FAULTS]
    if where == "env":
        rnd.ending = "env"
        rnd.env_fault = rng.choice(ENV_FAULTS)
        rnd.method = rng.choice(["spawn", "fork"])
        return rnd
    if where == "signal":
        rnd.ending = "signal"
        rnd.signal_to_supervisor = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
        # Nobody is left to clean a temporary directory after SIGTERM or SIGKILL.
        rnd.temp_logs = rnd.temp_logs and rnd.signal_to_supervisor == signal.SIGINT
        return rnd
    if where == "subreaper":
        escaper = rng.randrange(nprocs)
        plans[escaper]["children"] = [
            *plans[escaper]["children"],
            *rng.sample(["setsid", "daemon"], k=rng.randint(1, 2)),
        ]
        rnd.ending = "trigger" if faults and rng.random() < 0.6 else "close"
    elif faults:
        rnd.ending = _weighted(rng, {"trigger": 5, "burst": 2, "cancel": 2, "close_race": 1})
        early = [r for r in faults if kinds[r] in ("exit", "raise")]
        if STRICT and early and rng.random() < 0.3:
            rnd.ending = "early"
            rnd.trigger = rng.choice(early)
            plans[rnd.trigger]["early"] = True
    elif all(k in FINISHING for k in kinds):
        rnd.ending = _weighted(rng, {"natural": 3, "close_race": 2, "cancel": 1})
    else:
        rnd.ending = _weighted(rng, {"close": 3, "cancel": 2})
    if rnd.ending == "trigger":
        rnd.trigger = rng.choice(faults)
    if rnd.ending == "cancel":
        rnd.cancel_after = rng.uniform(0.0, 0.6)
    if rnd.ending in ("close", "close_race"):
        rnd.close_sig = rng.choice([signal.SIGTERM, signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
        if rnd.ending == "close_race" and rnd.close_sig == signal.SIGINT and not STRICT:
            rnd.close_sig = signal.SIGTERM
    if rnd.ending == "close_race":
        rnd.race_steps = rng.randrange(6)
        for plan in plans:
            if plan["kind"] in FINISHING:
                plan["gate"] = True
    return rnd


# -- watching a round's processes --------------------------------------------------------


class SoakFifo(ReadyFifo):
    """The round's FIFO: ready lines, grandchildren and "wrote" notes from every worker."""

    def pending(self) -> list[str]:
        """Every complete line already written, without waiting."""
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [line.decode() for line in lines]


@dataclass
class Seen:
    """What the round's workers told the test."""

    ready: dict[int, int] = field(default_factory=dict)
    wrote: set[int] = field(default_factory=set)
    #: grandchild pid -> pidfd taken when it was reported (``None`` if already gone).
    grandchildren: dict[int, int | None] = field(default_factory=dict)

    def take(self, lines: list[str]) -> None:
        """Record what these FIFO lines say."""
        for line in lines:
            words = line.split()
            if not words:
                continue
            if words[0] == "ready":
                self.ready[int(words[1])] = int(words[2])
            elif words[0] == "wrote":
                self.wrote.add(int(words[1]))
            elif words[0] == "grandchild":
                pid = int(words[2])
                if pid not in self.grandchildren:
                    self.grandchildren[pid] = _pidfd(pid)

    async def until_ready(
        self,
        fifo: SoakFifo,
        plans: list[dict[str, Any]],
        group_over: Callable[[], Any],
    ) -> None:
        """Wait until every worker said ready, or until the group ended without that."""
        async with anyio.create_task_group() as tg:

            async def watch_outcome() -> None:
                await group_over()
                tg.cancel_scope.cancel()

            tg.start_soon(watch_outcome)
            while len(self.ready) < len(plans):
                self.take(await fifo.lines(1, timeout=ROUND_TIMEOUT))
            tg.cancel_scope.cancel()

    def close(self) -> None:
        """Close the pidfds held for the grandchildren."""
        for fd in self.grandchildren.values():
            if fd is not None:
                os.close(fd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def exited(pidfd: int | None) -> bool:
    if pidfd is None:
        return True
    return bool(select.select([pidfd], [], [], 0)[0])


def processes_with_mark(mark: str) -> list[int]:
    """Live processes (zombies excluded) started under this round's mark."""
    return processes_with_env(soak.ROUND_MARK, mark)


async def all_exit(pids: list[int], timeout: float) -> list[int]:
    """Wait (event-driven, bounded) for ``pids`` to exit; return those still running."""
    fds = {pid: _pidfd(pid) for pid in pids}
    try:
        with anyio.move_on_after(timeout):
            for fd in fds.values():
                if fd is not None:
                    await anyio.wait_readable(fd)
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    return [pid for pid in pids if is_running(pid)]


# -- auditing a round --------------------------------------------------------------------


def temp_entries(tmp: Path) -> set[str]:
    return {p.name for p in tmp.iterdir() if p.name.startswith("aioelastic_")}


_LOG_FILES = {"stdout.log", "stderr.log", "error.json"}


def audit_files(rnd: Round, log_root: Path | None, audit: Audit) -> None:
    """Only expected files in the log directory."""
    if log_root is None or not log_root.exists():
        return
    for path in log_root.rglob("*"):
        if not path.is_file() or (path.name in _LOG_FILES and path.parent.name.isdigit()):
            continue
        if not STRICT and path.name.startswith(".error-") and path.name.endswith(".json.tmp"):
            audit.known["error-file temp files (pending fix)"] += 1
        else:
            audit.fail("temp files", f"unexpected file left in the log dir: {path}")


def audit_temp_dirs(rnd: Round, tmp: Path, before: set[str], audit: Audit) -> Path | None:
    """The rule of _preparing.GroupFiles.remove_temporary: a temp dir is kept iff it holds a file.

    Returns the round's temporary log directory, if one was kept.
    """
    new = sorted(temp_entries(tmp) - before)
    kept = None
    for name in new:
        path = tmp / name
        files = [p for p in path.rglob("*") if p.is_file()]
        if not rnd.temp_logs:
            audit.fail("temp files", f"temp dir {name} made although log_dir was given")
        elif not files:
            audit.fail("temp files", f"empty temp dir {name} left behind")
        kept = path
    if len(new) > 1:
        audit.fail("temp files", f"{len(new)} temp dirs for one context: {new}")
    return kept


def _common_prefix_length(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def audit_logs(
    rnd: Round, log_root: Path | None, seen: Seen, started: set[int], audit: Audit
) -> None:
    """Every byte each worker wrote to a redirected stream is in its log file."""
    for rank, plan in enumerate(rnd.plans):
        for stream, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
            if not rnd.redirects[rank] & bit or rank not in started:
                continue
            expected = (
                soak.expected_output(plan["output"][stream]) if stream in plan["output"] else b""
            )
            path = None if log_root is None else log_root / str(rank) / f"{stream}.log"
            if path is None or not path.exists():
                audit.fail(
                    "log lines",
                    f"rank {rank} {stream}: log file {path} missing",
                    expected.count(b"\n") + 1,
                )
                continue
            content = path.read_bytes()
            complete = rank in seen.wrote
            # stderr may go on with a traceback (a raise, a SIGINT) after the planned bytes.
            ok = (
                content.startswith(expected)
                if complete
                else expected.startswith(content) or content.startswith(expected)
            )
            if stream == "stdout" and complete:
                ok = content == expected
            if not ok:
                same = _common_prefix_length(content, expected)
                lost = expected.count(b"\n") - expected[:same].count(b"\n") + 1
                audit.fail(
                    "log lines",
                    f"rank {rank} {stream}: log has {len(content)} bytes, expected "
                    f"{'all ' if complete else 'a prefix of '}{len(expected)}; they differ "
                    f"after byte {same}",
                    lost,
                )


def audit_result(
    rnd: Round, result: aioelastic.RunProcsResult | None, released: dict[int, int], audit: Audit
) -> None:
    """The failures are exactly the injected ones (workers we stopped are not failures)."""
    if result is None:
        return
    got = {r: f.exitcode for r, f in result.failures.items()}
    if rnd.ending in ("trigger", "early", "natural", "close") and rnd.where != "signal":
        if got != released:
            audit.fail(None, f"failures {got}, injected {released}")
    elif not (set(got) <= set(released) and all(released[r] == c for r, c in got.items())):
        audit.fail(None, f"failures {got} are not among the injected {released}")
    if rnd.ending == "burst" and not got:
        audit.fail(None, f"no failure reported, injected {released}")
    for rank, failure in result.failures.items():
        if rnd.plans[rank]["kind"] == "raise" and "soak fault in rank" not in failure.message:
            audit.fail(None, f"rank {rank}'s failure message lacks its error: {failure.message!r}")
    if rnd.where != "here":
        return
    for rank, value in result.return_values.items():
        plan = rnd.plans[rank]
        want: Any = None
        if rnd.method != "binary" and plan["kind"] == "ok":
            want = rank * 10
        elif rnd.method != "binary" and plan["kind"] == "big":
            want = soak.big_value(plan["size"], plan["seed"])
        if value != want:
            audit.fail(None, f"rank {rank} returned a wrong value ({type(value).__name__})")
    if rnd.ending == "natural" and set(result.return_values) != set(range(rnd.nprocs)):
        audit.fail(None, f"return values only for ranks {sorted(result.return_values)}")


async def audit_processes(
    rnd: Round, pids: dict[int, int], seen: Seen, zombies_before: set[int], audit: Audit
) -> None:
    """Count each live leftover and each zombie once, whichever check saw it first."""
    alive: dict[int, str] = {}
    zombies: dict[int, str] = {}
    for rank, pid in pids.items():
        # Our own children are reaped by the time close() returns; a fork server, and
        # the watchdog for the binary workers it spawned, reap theirs when released,
        # moments later.
        released = rnd.method in ("forkserver", "binary")
        state = await reaped(pid, 5.0) if released else process_state(pid)
        if state == "Z":
            zombies[pid] = f"worker {rank}"
        elif state is not None:
            alive[pid] = f"worker {rank} (state {state})"
    for pid, fd in seen.grandchildren.items():
        if not exited(fd):
            alive.setdefault(pid, "grandchild")
    for pgid, live in _platform.live_group_members(set(pids.values())).items():
        for pid in live:
            alive.setdefault(pid, f"member of worker group {pgid}")
    for pid in processes_with_mark(rnd.mark):
        alive.setdefault(pid, "carries the round's mark")
    for pid in new_zombies(zombies_before):
        zombies.setdefault(pid, "child of the test process")
    for pid, what in sorted(alive.items()):
        audit.fail("processes", f"pid {pid} still alive: {what}")
    for pid, what in sorted(zombies.items()):
        audit.fail("zombies", f"pid {pid} is an unreaped zombie: {what}")
    kill_all(list(alive))
    for pid in zombies:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # a fork server's worker: not ours to reap
