"""Running a soak round (tests/core/group/test_soak.py): here, in a supervisor, or a fault.

A round runs in this process (:func:`run_here`), in a supervising process of its own that
the test signals (:func:`run_in_child`), or as one fault of the environment with its exact
outcome (:func:`run_env_fault`); each audits what the round left behind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.buffered import BufferedByteReceiveStream

import aioelastic
from aioelastic import Std
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
    zombie_children,
)
from tests.support.paths import REPO
from tests.support.soak_rounds import (
    FAULTS,
    ROUND_TIMEOUT,
    Round,
    Seen,
    SoakFifo,
    all_exit,
    audit_files,
    audit_logs,
    audit_processes,
    audit_result,
    audit_temp_dirs,
    exited,
    processes_with_mark,
    temp_entries,
)
from tests.support.waits import is_running


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
    temp_before = temp_entries(tmp)
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
        await audit_processes(rnd, pids, seen, zombies_before, audit)
    finally:
        seen.close()
    kept = audit_temp_dirs(rnd, tmp, temp_before, audit)
    log_root = kept if rnd.temp_logs else log_dir
    audit_logs(rnd, log_root, seen, set(pids), audit)
    audit_files(rnd, log_root, audit)
    if kept is not None:
        shutil.rmtree(kept)
    audit_fds(fds_before, audit)


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
                if not exited(fd):
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
    left = await all_exit(known, 10.0)
    deadline = time.monotonic() + 10.0
    marked = processes_with_mark(rnd.mark)
    while marked and time.monotonic() < deadline:
        marked = await all_exit(marked, deadline - time.monotonic())
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
            cwd=REPO,
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


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``exc`` itself."""
    inner = getattr(exc, "exceptions", None)
    if inner is None:
        return [exc]
    return [leaf for e in inner for leaf in leaves(e)]


async def rescue(rnd: Round, contexts: list[aioelastic.PContext], audit: Audit) -> None:
    """Unstick a hung round: its shielded teardown waits for exits that never come.

    ``fail_after`` cannot interrupt a shielded wait, so after the round's time is up
    this kills what the round started, letting those waits end and the round fail.
    """
    await anyio.sleep(ROUND_TIMEOUT + 5)
    pids = [p for ctx in contexts for p in ctx.pids().values()]
    pids += processes_with_mark(rnd.mark)
    audit.fail("processes", f"round hung; killed its processes {pids}", len(pids))
    kill_all(pids)
