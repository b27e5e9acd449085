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
raises SystemExit, a full log disk) and checks its exact outcome (tests/core/group/test_faults.py).

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

    AIOELASTIC_SOAK_SECONDS=1800 python -m pytest tests/core/group/test_soak.py::test_soak
    AIOELASTIC_SOAK_ROUNDS=2000 AIOELASTIC_SOAK_SEED=1234 \
        python -m pytest tests/core/group/test_soak.py::test_soak

Every round draws from its own generator (seed and round number), so one round of a failed
run replays alone: AIOELASTIC_SOAK_SEED=<seed> AIOELASTIC_SOAK_FIRST_ROUND=<n>
AIOELASTIC_SOAK_ROUNDS=1 (its timing, of course, is the machine's).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import traceback
from collections import Counter
from pathlib import Path

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

import aioelastic
from aioelastic import Std
from tests.children import (
    soak,
)
from tests.support.audit import (
    Audit,
    audit_fds,
    kill_all,
    open_fds,
)
from tests.support.soak_rounds import (
    LOST,
    ROUND_TIMEOUT,
    STRICT,
    Round,
    Seen,
    audit_files,
    audit_logs,
    audit_processes,
    audit_temp_dirs,
    draw_round,
    processes_with_mark,
)
from tests.support.soak_runs import leaves, rescue, run_env_fault, run_here, run_in_child

pytestmark = pytest.mark.asyncio

# -- how long ---------------------------------------------------------------------------

_ROUNDS_ENV = os.environ.get("AIOELASTIC_SOAK_ROUNDS")
_SECONDS_ENV = os.environ.get("AIOELASTIC_SOAK_SECONDS")
#: Default bounds: whichever is reached first ends the soak.
DEFAULT_ROUNDS = 150
DEFAULT_SECONDS = 70.0
MAX_ROUNDS = int(_ROUNDS_ENV) if _ROUNDS_ENV else (None if _SECONDS_ENV else DEFAULT_ROUNDS)
MAX_SECONDS = float(_SECONDS_ENV) if _SECONDS_ENV else (None if _ROUNDS_ENV else DEFAULT_SECONDS)
_TEST_TIMEOUT = (
    (MAX_SECONDS or 0) + (MAX_ROUNDS or 0) * (ROUND_TIMEOUT if _ROUNDS_ENV else 0) + 100
    if (_ROUNDS_ENV or _SECONDS_ENV)
    else 170
)


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
                tg.start_soon(rescue, rnd, contexts, audit)
                with anyio.fail_after(ROUND_TIMEOUT):
                    if rnd.where == "here":
                        await run_here(rnd, directory, private_tmp, audit, faults, contexts)
                    elif rnd.where == "env":
                        await run_env_fault(rnd, directory, audit, faults)
                    else:
                        await run_in_child(rnd, directory, audit, faults)
                tg.cancel_scope.cancel()
        except Exception as exc:
            for error in leaves(exc):
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


# -- the audit itself (the races the soak found are tested in their rooms) -----------------


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
    await audit_processes(rnd, {0: alive.pid, 1: zombie.pid}, Seen(), set(), audit)
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
