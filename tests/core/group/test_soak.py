"""Fault-injection soak: many random rounds of faults, then an audit of what was left behind.

Each round draws (from a printed seed) a group of 2-4 workers, a start method, redirects,
and for every rank a behaviour: succeed, return a large value, exit non-zero, raise, be
SIGKILLed by the test mid-run, ignore SIGTERM, hang in a blocking call, start grandchildren
(exec'd and forked ones, in the worker's group), and write a lot of output with or without a
trailing newline. Then it ends the round one way: the outcome of one released fault or of
several at once, every worker succeeding, an explicit ``close()``, ``close()`` racing the
workers' own exits, or the supervising task cancelled at a random moment. Some rounds run
in a supervising process of their own, to signal it (SIGINT, SIGTERM, SIGKILL) or to use
subreaper mode with descendants that escape into their own session (``setsid``, a daemon's
double fork) — :func:`aioelastic.enable_subreaper` is irreversible, so never in pytest.
About one round in ten injects a fault of the environment instead (ENV_FAULTS: SIGCHLD
ignored, a low RLIMIT_NOFILE, the console's reader gone, a return value whose unpickling
raises SystemExit, a full log disk) and checks its exact outcome (tests/test_faults.py).

After every round: no process the round started is alive (workers, grandchildren, escaped
descendants), none is an unreaped zombie, no file descriptor is left open, no temporary
file or directory is left behind, every byte written to a redirected stream is in its log
file, and the result's failures are exactly the injected ones: equal to them when one
fault (or none) was released, and when several faults (or close()) race, a non-empty
subset with the exact exit codes — by the API a worker the supervisor signalled before it
was seen exiting is stopped, not failed. The test prints a table of the faults by kind and
of every "lost" count.

Bounded by default: 150 rounds or 70 s, whichever comes first (30-70 s on two shared cores).
Longer runs::

    AIOELASTIC_SOAK_SECONDS=1800 python -m pytest tests/test_soak.py::test_soak
    AIOELASTIC_SOAK_ROUNDS=2000 AIOELASTIC_SOAK_SEED=1234 \
        python -m pytest tests/test_soak.py::test_soak

Every round draws from its own generator (seed and round number), so one round of a failed
run replays alone: AIOELASTIC_SOAK_SEED=<seed> AIOELASTIC_SOAK_FIRST_ROUND=<n>
AIOELASTIC_SOAK_ROUNDS=1 (its timing, of course, is the machine's).
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import aioelastic
from aioelastic import Std
from aioelastic._core.process import _platform
from aioelastic._core.start import _launchers
from aioelastic._core.start._forkserver import fork_server
from tests.children import (
    core as core_children,
    errors as errors_children,
    faults as faults_children,
    soak,
)
from tests.support.audit import (
    Audit,
    audit_fds,
    kill_all,
    new_zombies,
    open_fds,
    processes_with_env,
    reaped,
    zombie_children,
)
from tests.support.waits import ReadyFifo, is_running, process_state

pytestmark = pytest.mark.asyncio

# -- how long ---------------------------------------------------------------------------

_ROUNDS_ENV = os.environ.get("AIOELASTIC_SOAK_ROUNDS")
_SECONDS_ENV = os.environ.get("AIOELASTIC_SOAK_SECONDS")
#: Default bounds: whichever is reached first ends the soak.
DEFAULT_ROUNDS = 150
DEFAULT_SECONDS = 70.0
MAX_ROUNDS = int(_ROUNDS_ENV) if _ROUNDS_ENV else (None if _SECONDS_ENV else DEFAULT_ROUNDS)
MAX_SECONDS = float(_SECONDS_ENV) if _SECONDS_ENV else (None if _ROUNDS_ENV else DEFAULT_SECONDS)
#: A round that takes longer than this has hung: it is failed (and its processes killed).
ROUND_TIMEOUT = 60.0
_TEST_TIMEOUT = (
    (MAX_SECONDS or 0) + (MAX_ROUNDS or 0) * (ROUND_TIMEOUT if _ROUNDS_ENV else 0) + 100
    if (_ROUNDS_ENV or _SECONDS_ENV)
    else 170
)

#: Bugs the soak found are pending a fix in the core (each has an xfail(strict) test at the
#: end of this file). Until they are fixed the soak leaves out the rounds that hit them and
#: shows one kind of leftover apart ("known"), so that CI stays meaningful;
#: AIOELASTIC_SOAK_STRICT=1 (or False here once those tests pass) includes everything:
#: - test_a_failure_while_siblings_start_stops_them_too: a fault while the other workers
#:   are still starting ("early" rounds) leaves the late ones running; the round hangs;
#: - test_a_worker_killed_while_writing_its_error_file_leaves_no_temp_file: a worker
#:   killed while recording its error leaves ``.error-*.json.tmp`` in its log directory;
#: - test_an_interrupt_on_a_workers_way_out_keeps_its_exit_status and
#:   test_a_stopped_worker_that_exits_0_is_not_a_failure: close(SIGINT) racing the workers'
#:   own exits reports a sys.exit(n) as "exited 0 without a return value" (not drawn).
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
#: Faults of the environment, one per "env" round (see tests/test_faults.py for each).
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


def _exited(pidfd: int | None) -> bool:
    if pidfd is None:
        return True
    return bool(select.select([pidfd], [], [], 0)[0])


def processes_with_mark(mark: str) -> list[int]:
    """Live processes (zombies excluded) started under this round's mark."""
    return processes_with_env(soak.ROUND_MARK, mark)


async def _all_exit(pids: list[int], timeout: float) -> list[int]:
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


def _temp_entries(tmp: Path) -> set[str]:
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
    new = sorted(_temp_entries(tmp) - before)
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


def _release(rnd: Round, ranks: list[int], seen: Seen) -> dict[int, int]:
    """Make these gated workers fail (or finish): SIGUSR1, or SIGKILL for ``sigkill``."""
    injected = {}
    for rank in ranks:
        plan, pid = rnd.plans[rank], seen.ready[rank]
        kind = plan["kind"]
        os.kill(pid, signal.SIGKILL if kind == "sigkill" else signal.SIGUSR1)
        if kind in FAULTS:
            injected[rank] = plan["code"] if kind == "exit" else soak.FAULT_CODES[kind]
    return injected


# -- a round in this process -------------------------------------------------------------


def _start(rnd: Round, log_dir: Path | None) -> aioelastic.PContext:
    entry: Any = soak.run
    args: dict[int, tuple[Any, ...]] = {r: (plan,) for r, plan in enumerate(rnd.plans)}
    if rnd.method == "binary":
        entry = sys.executable
        args = {
            r: ("-m", "tests.children.soak", "worker", json.dumps(plan))
            for r, plan in enumerate(rnd.plans)
        }
    return aioelastic.start_processes(
        f"soak{rnd.number}",
        entry,
        args,
        {r: {soak.ROUND_MARK: rnd.mark} for r in args},
        log_dir=log_dir,
        start_method="spawn" if rnd.method == "binary" else rnd.method,
        redirects={r: Std(v) for r, v in enumerate(rnd.redirects)},
        grace_period=rnd.grace,
    )


async def run_here(
    rnd: Round,
    directory: Path,
    tmp: Path,
    audit: Audit,
    faults: Counter[str],
    contexts: list[aioelastic.PContext],
) -> None:
    """Run a round in this process, then audit it (``contexts`` gets its context)."""
    fifo = SoakFifo(directory)
    seen = Seen()
    log_dir = None if rnd.temp_logs else directory / "logs"
    fds_before = open_fds()
    zombies_before = set(zombie_children())
    temp_before = _temp_entries(tmp)
    ctx = _start(rnd, log_dir)
    contexts.append(ctx)
    result: aioelastic.RunProcsResult | None = None
    released: dict[int, int] = {}
    if rnd.ending == "early":
        assert rnd.trigger is not None
        plan = rnd.plans[rnd.trigger]
        released = {rnd.trigger: plan["code"] if plan["kind"] == "exit" else 1}
    deadline = anyio.current_time() + rnd.cancel_after if rnd.ending == "cancel" else float("inf")
    try:
        with anyio.CancelScope(deadline=deadline) as cancel:
            async with ctx:
                await seen.until_ready(fifo, rnd.plans, ctx.wait)
                if rnd.ending == "trigger":
                    assert rnd.trigger is not None
                    released = _release(rnd, [rnd.trigger], seen)
                elif rnd.ending in ("burst", "cancel"):
                    released = _release(
                        rnd, [r for r, p in enumerate(rnd.plans) if p["kind"] in FAULTS], seen
                    )
                elif rnd.ending == "close_race":
                    gated = [
                        r for r, p in enumerate(rnd.plans) if p.get("gate") or p["kind"] in FAULTS
                    ]
                    released = _release(rnd, gated, seen)
                    for _ in range(rnd.race_steps):
                        await anyio.lowlevel.checkpoint()
                    await ctx.close(rnd.close_sig)
                elif rnd.ending == "close":
                    await ctx.close(rnd.close_sig, rnd.grace)
                result = await ctx.wait()
        if cancel.cancelled_caught:
            faults["supervisor cancelled"] += 1
    finally:
        seen.take(fifo.pending())
        fifo.close()
    pids = ctx.pids()
    _count_faults(rnd, seen, released, faults)
    try:
        if rnd.ending != "cancel" or result is not None:
            audit_result(rnd, result, released, audit)
        await _audit_processes(rnd, pids, seen, zombies_before, audit)
    finally:
        seen.close()
    kept = audit_temp_dirs(rnd, tmp, temp_before, audit)
    log_root = kept if rnd.temp_logs else log_dir
    audit_logs(rnd, log_root, seen, set(pids), audit)
    audit_files(rnd, log_root, audit)
    if kept is not None:
        shutil.rmtree(kept)
    audit_fds(fds_before, audit)


async def _audit_processes(
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
        if not _exited(fd):
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


def _count_faults(rnd: Round, seen: Seen, released: dict[int, int], faults: Counter[str]) -> None:
    names = {"exit": "exit non-zero", "raise": "raise", "sigkill": "SIGKILL mid-run"}
    for rank in released:
        faults[names[rnd.plans[rank]["kind"]]] += 1
    for rank, plan in enumerate(rnd.plans):
        if rank not in seen.ready:
            continue
        kind = plan["kind"]
        if kind == "ignore_term":
            faults["ignores SIGTERM"] += 1
        elif kind == "hang":
            faults[f"hangs in a blocking call ({plan['block']})"] += 1
        elif kind == "big":
            faults["large return value"] += 1
        for how in plan["children"]:
            label = "escaped" if how in ("setsid", "daemon") else "in group"
            faults[f"grandchild, {how} ({label})"] += 1
        for stream in plan["output"].values():
            faults["output streams"] += 1
            faults["output lines"] += stream["lines"]
            if not stream["newline"]:
                faults["output without final newline"] += 1
    if rnd.ending == "close_race":
        faults["close() racing exits"] += 1
    if rnd.ending == "close":
        faults[f"close({signal.Signals(rnd.close_sig).name})"] += 1
    if rnd.ending == "burst":
        faults["faults released at once"] += 1
    if rnd.ending == "early":
        faults["fault while siblings start"] += 1
    if rnd.where == "signal":
        faults[f"{signal.Signals(rnd.signal_to_supervisor).name} to the supervisor"] += 1


# -- a round in a supervising process of its own -----------------------------------------


async def run_in_child(rnd: Round, directory: Path, audit: Audit, faults: Counter[str]) -> None:
    """Run a round in a child supervisor; signal it or let it end; audit."""
    fifo = SoakFifo(directory)
    seen = Seen()
    tmp = directory / "tmp"
    tmp.mkdir()
    log_dir = None if rnd.temp_logs else str(directory / "logs")
    config = {
        "plans": rnd.plans,
        "method": rnd.method,
        "log_dir": log_dir,
        "redirects": rnd.redirects,
        "grace": rnd.grace,
        "subreaper": rnd.where == "subreaper",
    }
    env = {**os.environ, soak.ROUND_MARK: rnd.mark, "TMPDIR": str(tmp)}
    released: dict[int, int] = {}
    report: dict[str, Any] | None = None
    pids: dict[int, int] = {}
    zombies_before = set(zombie_children())
    proc = await anyio.open_process(
        [sys.executable, "-m", "tests.children.soak", "supervise", json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        out = BufferedByteReceiveStream(proc.stdout)
        head = await out.receive_until(b"\n", 1 << 20)
        pids = {int(k): v for k, v in json.loads(head.split(b" ", 1)[1]).items()}
        await seen.until_ready(fifo, rnd.plans, proc.wait)
        if rnd.ending == "signal":
            proc.send_signal(rnd.signal_to_supervisor)
        elif rnd.ending == "trigger":
            assert rnd.trigger is not None
            released = _release(rnd, [rnd.trigger], seen)
        else:
            await proc.stdin.send(b"close\n")
        returncode = await proc.wait()
        rest = b""
        try:
            while True:
                rest += await out.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass
        for line in rest.decode().splitlines():
            if line.startswith("report "):
                report = json.loads(line.split(" ", 1)[1])
        graceful = rnd.ending != "signal" or rnd.signal_to_supervisor == signal.SIGINT
        expected_rc = (
            {signal.SIGINT: 130, signal.SIGTERM: -15, signal.SIGKILL: -9}.get(
                rnd.signal_to_supervisor, 0
            )
            if rnd.ending == "signal"
            else 0
        )
        if returncode != expected_rc:
            audit.fail(None, f"supervisor exited {returncode}, expected {expected_rc}")
        seen.take(fifo.pending())
        if graceful:
            # Its workers and their descendants were gone before it printed the report.
            for rank, pid in pids.items():
                if is_running(pid):
                    audit.fail("processes", f"worker {rank} (pid {pid}) outlived close()")
            for pid, fd in seen.grandchildren.items():
                if not _exited(fd):
                    audit.fail("processes", f"grandchild {pid} outlived close()")
            if report is None:
                audit.fail(None, "the supervisor printed no report")
            else:
                if report["zombies"]:
                    audit.fail(
                        "zombies",
                        f"supervisor kept zombies {report['zombies']}",
                        len(report["zombies"]),
                    )
                if report["live_children"]:
                    audit.fail(
                        "processes",
                        f"supervisor still has children {report['live_children']}",
                        len(report["live_children"]),
                    )
                if report["new_fds"]:
                    audit.fail(
                        "fds", f"supervisor leaked fds {report['new_fds']}", len(report["new_fds"])
                    )
                if rnd.ending != "signal":
                    got = {int(r): c for r, c in report["failures"].items()}
                    if got != released:
                        audit.fail(None, f"failures {got}, injected {released}")
    finally:
        fifo.close()
        await proc.aclose()
    # Whatever the way it ended, every process of the round ends — after an abrupt death
    # through the kernel's parent-death signal and the watchdog, which take a moment.
    known = [*pids.values(), *seen.grandchildren]
    left = await _all_exit(known, 10.0)
    deadline = time.monotonic() + 10.0
    marked = processes_with_mark(rnd.mark)
    while marked and time.monotonic() < deadline:
        marked = await _all_exit(marked, deadline - time.monotonic())
    leftovers = sorted(set(left) | set(marked))
    if leftovers:
        audit.fail("processes", f"processes of the round still alive: {leftovers}", len(leftovers))
        kill_all(leftovers)
    seen.close()
    zombies = new_zombies(zombies_before)
    if zombies:
        audit.fail("zombies", f"unreaped children: {zombies}", len(zombies))
    _count_faults(rnd, seen, released, faults)
    graceful = rnd.ending != "signal" or rnd.signal_to_supervisor == signal.SIGINT
    if graceful:
        kept = audit_temp_dirs(rnd, tmp, set(), audit)
        log_root = kept if rnd.temp_logs else Path(str(log_dir))
        audit_logs(rnd, log_root, seen, set(pids), audit)
        audit_files(rnd, log_root, audit)


async def run_env_fault(rnd: Round, directory: Path, audit: Audit, faults: Counter[str]) -> None:
    """One fault of the environment; the outcome must be exact, in time, nothing left.

    The process-wide faults (a signal disposition, an fd limit, the console) are made in a
    supervising process of their own (tests/children/faults.py); the others here.
    """
    rng = random.Random(rnd.mark)
    kind = rnd.env_fault
    env = {**os.environ, soak.ROUND_MARK: rnd.mark}
    ok = {"exitcodes": {}, "messages": {}, "failed": False}
    if kind == "log disk full" and not _mount_tmpfs(directory / "disk"):
        kind = "unpickling raises"  # no tmpfs without root: another fault instead
    faults[f"env: {kind}"] += 1

    def child(*argv: str, close_after_first_line: bool = False) -> tuple[int, list[Any]]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.children.faults", *argv],
            cwd=Path(__file__).resolve().parents[3],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None
        assert proc.stderr is not None
        if close_after_first_line:
            proc.stdout.readline()
            proc.stdout.close()
            err = proc.stderr.read()
            proc.wait(timeout=ROUND_TIMEOUT)
        else:
            _, err = proc.communicate(timeout=ROUND_TIMEOUT)
        lines = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
        return proc.returncode, lines

    got: Any
    want: Any
    if kind == "SIGCHLD ignored":
        code, lines = await anyio.to_thread.run_sync(child, "sigchld_ignored", rnd.method)
        got = (code, [sorted(x.get("exitcodes", {}).values()) for x in lines])
        want = (0, [[], [3], [-9], []])
    elif kind == "RLIMIT_NOFILE low":
        limit = str(rng.randint(14, 60))
        code, lines = await anyio.to_thread.run_sync(child, "nofile_sweep", limit, limit, "3")
        run = lines[0] if lines else {}
        got = (code, "ulimit -n" in run.get("error", "") or not run.get("failed", True), lines[1:])
        want = (0, True, [{"children": [], "fds": []}])
    elif kind == "console pipe closed":
        code, lines = await anyio.to_thread.run_sync(
            lambda: child("tee_lines", "5000", close_after_first_line=True)
        )
        got, want = (code, lines), (0, [{**ok, "return_values": {"0": "5000"}}])
    elif kind == "unpickling raises":
        result = await aioelastic.run_processes(
            "evil",
            faults_children.returns_exit,
            {0: ()},
            {0: {soak.ROUND_MARK: rnd.mark}},
            start_method=rnd.method,
        )
        got = {r: (f.exitcode, f.message) for r, f in result.failures.items()}
        want = {
            0: (
                0,
                "worker 0 its return value could not be unpickled by the supervisor: SystemExit(3)",
            )
        }
    elif kind == "error file is a FIFO":
        # The worker replaces its error file by a FIFO and exits 7: reading it must not
        # block, and the report keeps the worker's own exit code.
        result = await aioelastic.run_processes(
            "fifo",
            errors_children.sabotage,
            {0: ("fifo", "7")},
            {0: {soak.ROUND_MARK: rnd.mark}},
            start_method=rnd.method,
        )
        got = {
            r: (f.exitcode, "error file unreadable" in f.message)
            for r, f in result.failures.items()
        }
        want = {0: (7, True)}
    elif kind == "fork server killed":
        # A warm server killed between two starts is replaced on the next one.
        preload = ("tests.children.core",)
        first = await aioelastic.run_processes(
            "warm",
            core_children.add,
            {0: (1, 2)},
            {0: {}},
            start_method="forkserver",
            forkserver_preload=preload,
        )
        server = fork_server(preload).pid
        if server is not None:
            os.kill(server, signal.SIGKILL)
        second = await aioelastic.run_processes(
            "again",
            core_children.add,
            {0: (2, 2), 1: (3, 3)},
            {0: {}, 1: {}},
            start_method="forkserver",
            forkserver_preload=preload,
        )
        got = (first.return_values, second.return_values, fork_server(preload).pid != server)
        want = ({0: 3}, {0: 4, 1: 6}, True)
    else:
        try:
            result = await aioelastic.run_processes(
                "full",
                faults_children.write_bytes,
                {0: (200_000,)},
                {0: {soak.ROUND_MARK: rnd.mark}},
                log_dir=directory / "disk" / "logs",
                redirects=Std.OUT,
                start_method=rnd.method,
            )
        finally:
            subprocess.run(["umount", "-l", str(directory / "disk")], check=True)
        messages = [f.message for f in result.failures.values()]
        got = [("No space left on device" in m, "not written past byte" in m) for m in messages]
        want = [(True, True)]
    if got != want:
        audit.fail(None, f"{kind}: got {got!r}, expected {want!r}")
    left = processes_with_mark(rnd.mark)
    if left:
        audit.fail("processes", f"{kind}: processes left alive {left}", len(left))
        kill_all(left)


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``exc`` itself."""
    inner = getattr(exc, "exceptions", None)
    if inner is None:
        return [exc]
    return [leaf for e in inner for leaf in _leaves(e)]


async def _rescue(rnd: Round, contexts: list[aioelastic.PContext], audit: Audit) -> None:
    """Unstick a hung round: its shielded teardown waits for exits that never come.

    ``fail_after`` cannot interrupt a shielded wait, so after the round's time is up
    this kills what the round started, letting those waits end and the round fail.
    """
    await anyio.sleep(ROUND_TIMEOUT + 5)
    pids = [p for ctx in contexts for p in ctx.pids().values()]
    pids += processes_with_mark(rnd.mark)
    audit.fail("processes", f"round hung; killed its processes {pids}", len(pids))
    kill_all(pids)


# -- the soak ------------------------------------------------------------------------------


def _table(
    rounds: Counter[str],
    faults: Counter[str],
    lost: Counter[str],
    known: Counter[str],
    seed: int,
    seconds: float,
) -> str:
    width = max(len(k) for k in [*faults, *rounds, *LOST, *known]) + 4
    mode = "strict" if STRICT else "known bugs pending: early faults, SIGINT races off"
    lines = [
        f"aioelastic soak: seed {seed}, {sum(rounds.values())} rounds in {seconds:.1f} s ({mode})",
        "rounds".ljust(width) + str(sum(rounds.values())),
    ]
    lines += [f"  {k}".ljust(width) + str(v) for k, v in sorted(rounds.items())]
    lines.append("faults injected, by kind")
    lines += [f"  {k}".ljust(width) + str(v) for k, v in sorted(faults.items())]
    lines.append("lost")
    lines += [f"  {k}".ljust(width) + str(lost[k]) for k in LOST]
    if known:
        lines.append("known, pending a fix (not counted as lost)")
        lines += [f"  {k}".ljust(width) + str(v) for k, v in sorted(known.items())]
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(_TEST_TIMEOUT)
async def test_soak(tmp_path: Path, private_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed = int(os.environ.get("AIOELASTIC_SOAK_SEED") or random.SystemRandom().randrange(1 << 32))
    with capsys.disabled():
        print(f"\naioelastic soak seed: {seed} (AIOELASTIC_SOAK_SEED={seed} repeats it)")
    rounds: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    known: Counter[str] = Counter()
    problems: list[str] = []
    started = time.monotonic()
    first = number = int(os.environ.get("AIOELASTIC_SOAK_FIRST_ROUND", "0"))
    while (MAX_ROUNDS is None or number - first < MAX_ROUNDS) and (
        MAX_SECONDS is None or time.monotonic() - started < MAX_SECONDS
    ):
        rng = random.Random(f"{seed}/{number}")
        directory = tmp_path / f"round{number}"
        directory.mkdir()
        rnd = draw_round(rng, number, directory)
        audit = Audit()
        contexts: list[aioelastic.PContext] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_rescue, rnd, contexts, audit)
                with anyio.fail_after(ROUND_TIMEOUT):
                    if rnd.where == "here":
                        await run_here(rnd, directory, private_tmp, audit, faults, contexts)
                    elif rnd.where == "env":
                        await run_env_fault(rnd, directory, audit, faults)
                    else:
                        await run_in_child(rnd, directory, audit, faults)
                tg.cancel_scope.cancel()
        except Exception as exc:
            for error in _leaves(exc):
                where = traceback.format_tb(error.__traceback__)[-1].strip().replace("\n", " | ")
                audit.fail(None, f"{type(error).__name__}: {error} (at {where})")
            kill_all(processes_with_mark(rnd.mark))
        rounds[
            "in this process"
            if rnd.where == "here"
            else "a fault of the environment"
            if rnd.where == "env"
            else f"in a supervising process ({rnd.where})"
        ] += 1
        lost.update(audit.lost)
        known.update(audit.known)
        problems += [f"{rnd.describe()}: {p}" for p in audit.problems]
        number += 1
    with capsys.disabled():
        print(_table(rounds, faults, lost, known, seed, time.monotonic() - started))
    assert not problems, "\n".join(problems)
    assert all(lost[k] == 0 for k in LOST)


# -- the audit itself, and races found by the soak -----------------------------------------


async def test_the_audit_catches_what_a_round_leaves_behind(tmp_path: Path) -> None:
    """Each audit fails on the leftover it exists for (so a clean soak means something)."""
    stream = {"tag": "t", "lines": 100, "seed": 1, "newline": True, "long": 0}
    plan = {"rank": 0, "kind": "hang", "children": [], "output": {"stdout": stream}}
    rnd = Round(0, "here", "fork", [plan], [int(Std.OUT)], True, 0.0, "close")
    audit = Audit()
    # Two "workers" of the round: one nobody stopped, one killed but never reaped.
    env = {**os.environ, soak.ROUND_MARK: rnd.mark}
    # Each leads its own process group, as a worker does (start_new_session: Python 3.10
    # has no process_group=).
    alive = subprocess.Popen(["sleep", "1000"], env=env, start_new_session=True)
    zombie = subprocess.Popen(["sleep", "1000"], env=env, start_new_session=True)
    zombie.kill()
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
    await _audit_processes(rnd, {0: alive.pid, 1: zombie.pid}, Seen(), set(), audit)
    alive.wait()  # killed by the audit
    zombie.returncode = -signal.SIGKILL  # reaped by the audit
    assert audit.lost["processes"] == 1
    assert audit.lost["zombies"] == 1
    # A log file missing its last lines, and an empty temporary directory.
    logs = tmp_path / "logs"
    (logs / "0").mkdir(parents=True)
    (logs / "0" / "stdout.log").write_bytes(soak.expected_output(stream)[:-100])
    audit_logs(rnd, logs, Seen(wrote={0}), {0}, audit)
    assert audit.lost["log lines"] >= 2
    tmp = tmp_path / "tmp"
    (tmp / "aioelastic_x_1").mkdir(parents=True)
    audit_temp_dirs(rnd, tmp, set(), audit)
    (logs / "0" / "stray.tmp").write_text("{")
    audit_files(rnd, logs, audit)
    assert audit.lost["temp files"] == 2
    before = open_fds()
    r, w = os.pipe()
    audit_fds(before, audit)
    os.close(r)
    os.close(w)
    assert audit.lost["fds"] == 2


@pytest.mark.timeout(60)
async def test_a_failure_while_siblings_start_stops_them_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails before rank 1 is started: rank 1 must be stopped all the same.

    Deterministic version of a race the soak finds (AIOELASTIC_SOAK_STRICT=1) and
    tests/test_pcontext.py::test_unpicklable_return_value_fails_that_rank[fork] hits now
    and then: rank 1's launch is held until rank 0's failure has been handled.
    """
    from aioelastic._core.worker._teardown import stop_workers
    from tests.children import core

    fifo = ReadyFifo(tmp_path)
    real = _launchers.on_launcher_thread
    forks = 0
    first: list[int] = []
    first_started = anyio.Event()

    async def held(fn: Callable[..., Any], *args: object) -> Any:
        nonlocal forks
        if fn is not _launchers.start_fork:
            return await real(fn, *args)
        forks += 1
        if forks == 1:
            launched = await real(fn, *args)
            first.append(launched.pid)
            first_started.set()
            return launched
        await first_started.wait()
        pidfd = os.pidfd_open(first[0])
        try:
            await anyio.wait_readable(pidfd)  # rank 0 exited...
        finally:
            os.close(pidfd)
        await anyio.wait_all_tasks_blocked()  # ...and the supervisor has reacted
        return await real(fn, *args)

    monkeypatch.setattr(_launchers, "on_launcher_thread", held)
    ctx = aioelastic.start_processes(
        "early",
        core.behave,
        {0: ("exit", 3), 1: ("block", str(fifo.path))},
        {0: {}, 1: {}},
        start_method="fork",
        grace_period=1,
    )
    done = anyio.Event()
    result: list[aioelastic.RunProcsResult | None] = []

    async def supervise() -> None:
        async with ctx:
            result.append(await ctx.wait())
        done.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervise)
            with anyio.move_on_after(8):  # well under a second once fixed
                await done.wait()
            in_time = done.is_set()
            if not in_time:
                # The bug: rank 1 was never signalled and the block waits for its exit.
                # Stop the missed workers with the core's own teardown to end the test.
                left = [w for w in ctx._workers if not w.reaped]
                await stop_workers(left, signal.SIGKILL, 0, anyio.Event())
    finally:
        fifo.close()
    assert in_time, "rank 1, started after rank 0 failed, was never stopped"
    assert result[0] is not None
    assert {r: f.exitcode for r, f in result[0].failures.items()} == {0: 3}


@pytest.mark.timeout(60)
async def test_a_worker_killed_while_writing_its_error_file_leaves_no_temp_file(
    tmp_path: Path,
) -> None:
    """The soak's "temp files" finding, made deterministic.

    Two ways a worker dies while recording an error: the supervisor's SIGTERM/SIGKILL
    of a failed group reaching a sibling that is raising too, or a close() with SIGINT
    (KeyboardInterrupt is recorded) followed by SIGKILL. The worker here stops right
    before it publishes the file, and is SIGKILLed there.
    """
    fifo = ReadyFifo(tmp_path)
    log_dir = tmp_path / "logs"
    try:
        async with aioelastic.start_processes(
            "errfile",
            soak.stop_while_publishing_error_file,
            {0: (str(fifo.path),)},
            {0: {}},
            log_dir=log_dir,
            start_method="fork",
        ) as ctx:
            word, pid = (await fifo.lines(1))[0].split()
            assert word == "publishing"
            os.kill(int(pid), signal.SIGKILL)
            result = await ctx.wait()
    finally:
        fifo.close()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGKILL
    left = sorted(p.name for p in (log_dir / "0").iterdir())
    assert left == [], f"left in the worker's log dir: {left}"


@pytest.mark.parametrize("method", ["fork", "forkserver"])
@pytest.mark.timeout(60)
async def test_an_interrupt_on_a_workers_way_out_keeps_its_exit_status(method: str) -> None:
    """Found by the soak (close(SIGINT) racing exits): a worker's sys.exit(7) became exit 0."""
    result = await aioelastic.run_processes(
        "way_out",
        soak.exit_interrupted_on_the_way_out,
        {0: (7,)},
        {0: {}},
        start_method=method,
        grace_period=5,
    )
    failure = result.failures[0]
    assert failure.exitcode == 7, failure.message


@pytest.mark.timeout(60)
async def test_a_stopped_worker_that_exits_0_is_not_a_failure(tmp_path: Path) -> None:
    fifo = ReadyFifo(tmp_path)
    try:
        async with aioelastic.start_processes(
            "graceful", soak.exit_0_on_sigterm, {0: (str(fifo.path),)}, {0: {}}, start_method="fork"
        ) as ctx:
            await fifo.lines(1)
            await ctx.close()
            result = await ctx.wait()
    finally:
        fifo.close()
    assert result is not None
    assert result.failures == {}


async def test_default_mode_cannot_stop_a_descendant_in_its_own_session(tmp_path: Path) -> None:
    """The documented limit (README "Limits"): without subreaper mode a ``setsid`` escapes.

    Run in a supervisor of its own that is a subreaper for the kernel only, so the escaped
    process is re-parented to it: aioelastic's default mode does not stop it at close(),
    the supervisor reports it alive, then kills and reaps it itself. The soak's subreaper
    rounds show the same descendants stopped when subreaper mode is on.
    """
    fifo = SoakFifo(tmp_path)
    plan = {
        "rank": 0,
        "kind": "hang",
        "fifo": str(fifo.path),
        "block": "event",
        "children": ["setsid", "daemon"],
        "output": {},
    }
    config = {
        "plans": [plan],
        "method": "fork",
        "log_dir": str(tmp_path / "logs"),
        "redirects": [0],
        "grace": 0.5,
        "kernel_subreaper_only": True,
    }
    seen = Seen()
    try:
        async with await anyio.open_process(
            [sys.executable, "-m", "tests.children.soak", "supervise", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
        ) as proc:
            assert proc.stdin is not None
            assert proc.stdout is not None
            out = BufferedByteReceiveStream(proc.stdout)
            await out.receive_until(b"\n", 1 << 20)
            await seen.until_ready(fifo, [plan], proc.wait)
            await proc.stdin.send(b"close\n")
            line = await out.receive_until(b"\n", 1 << 20)
            assert await proc.wait() == 0
    finally:
        fifo.close()
        seen.close()
    report = json.loads(line.split(b" ", 1)[1])
    assert sorted(report["escaped_alive"]) == sorted(seen.grandchildren)
    assert len(seen.grandchildren) == 2
    assert report["zombies"] == []
