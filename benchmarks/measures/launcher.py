"""h. Launcher overhead: ``aioelastic-run`` against ``torchrun`` on a trivial script.

Each repetition runs ``python -m aioelastic.run`` or ``python -m torch.distributed.run``
with ``--nproc-per-node N`` and either ``--standalone`` (the documented single-node form;
a free port, no clash with a neighbour's 29500) or ``--master-port PORT`` (the static
rendezvous, torchrun's default backend), and :mod:`benchmarks.programs._trivial`, which stamps the
clock and exits, or :mod:`benchmarks.programs._gloo` (import torch, gloo process group, barrier).
*seconds*: launch to the launcher's exit; *to user code*: launch to the last worker's stamp
(for the real script: the last rank past the barrier). The floor for comparison is one
``python -S`` start per process (see ``floor``).

The real script also runs under ``aioelastic-run --preload torch`` (a warm fork server
that imported torch forks every rank), and once more with ``fail-once`` and
``--max-restarts 1``: *restart* is then rank 0's failure stamp in attempt 0 to the last
rank past the barrier in attempt 1. torch's side there is torchrun at its fastest
restart, ``--monitor-interval 0.01`` (its default polls every 0.1 s), with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it torchrun's c10d rendezvous hands every
attempt the same store server, whose keys from attempt 0 (gloo's rank addresses among
them) attempt 1 reads back, so its connect is refused or hangs (docs/benchmarks.md, h).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks.harness._spec import (
    SECONDS,
    Group,
    Measure,
    Metric,
    Params,
    RepContext,
    Row,
    System,
)
from benchmarks.measures._common import runnable
from benchmarks.programs._clock import now_ns, read_stamp, read_stamps, seconds

#: The worker programs run as scripts (see :mod:`benchmarks.programs`).
PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
SCRIPTS = {
    "trivial": PROGRAMS / "_trivial.py",
    "gloo": PROGRAMS / "_gloo.py",
}
TO_USER = Metric("to_user", "ms to user code", scale=1000.0)
RESTART = Metric("restart", "ms failure to barrier", scale=1000.0)


def _run(ctx: RepContext, module: str) -> dict[str, float]:
    output = ctx.workdir / "launcher.log"
    if ctx.params.get("standalone"):
        rendezvous = ["--standalone"]
    else:
        from aioelastic import free_port

        rendezvous = ["--master-port", str(free_port())]
    command = [
        sys.executable,
        "-m",
        module,
        "--nproc-per-node",
        str(ctx.n),
        *rendezvous,
        *shlex.split(str(ctx.params.get("flags", ""))),
        str(SCRIPTS[str(ctx.params.get("script", "trivial"))]),
        str(ctx.workdir),
        *(["fail-once"] if ctx.params.get("fail_once") else []),
    ]
    env = dict(os.environ)
    for setting in shlex.split(str(ctx.params.get("env", ""))):
        name, _, value = setting.partition("=")
        env[name] = value
    with open(output, "wb") as out:
        start = now_ns()
        code = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=120, check=False
        ).returncode
        end = now_ns()
    if code != 0:
        tail = "\n".join(output.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{module} exited with {code}:\n{tail}")
    started = max(read_stamps(ctx.workdir, "start", ctx.n))
    if ctx.params.get("fail_once"):
        return {"restart": seconds(started - read_stamp(ctx.workdir / "fail"))}
    return {"seconds": seconds(end - start), "to_user": seconds(started - start)}


def aio_run(ctx: RepContext) -> dict[str, float]:
    """``python -m aioelastic.run``."""
    return _run(ctx, runnable("aioelastic.run"))


def torchrun(ctx: RepContext) -> dict[str, float]:
    """``python -m torch.distributed.run`` (torchrun)."""
    return _run(ctx, "torch.distributed.run")


_M = "benchmarks.measures.launcher"


def _group(name: str, case: str, params: Params) -> Group:
    return Group(
        name=name,
        systems=(
            System("aioelastic-run", "aioelastic", f"{_M}:aio_run"),
            System("torchrun", "torch", f"{_M}:torchrun"),
        ),
        rows=(Row(case, "aioelastic-run", "torchrun", headline_n=1),),
        ns=(1, 4),
        quick_ns=(1,),
        default_reps=5,
        params=params,
        rep_timeout=150.0,
    )


PRELOAD = "aioelastic-run --preload torch"
TORCHRUN_FAST = "torchrun --monitor-interval 0.01"
_REAL_CASE = "real script: import torch, gloo init, barrier, --standalone"

# N ranks that each import torch: ~1 s of wall time per rank on 2 cores for torchrun and
# plain aioelastic-run, so 3 repetitions and not in --quick. torchrun gets its fastest
# poll here (it decides when the job is over, so it counts in *seconds*).
_REAL = Group(
    name="gloo",
    systems=(
        System(PRELOAD, "aioelastic", f"{_M}:aio_run", {"flags": "--preload torch"}, quick=False),
        System("aioelastic-run", "aioelastic", f"{_M}:aio_run", quick=False),
        System(
            TORCHRUN_FAST,
            "torch",
            f"{_M}:torchrun",
            {"flags": "--monitor-interval 0.01"},
            quick=False,
        ),
    ),
    rows=(
        Row(f"{_REAL_CASE}, ours --preload torch", PRELOAD, TORCHRUN_FAST, headline_n=8),
        Row(_REAL_CASE, "aioelastic-run", TORCHRUN_FAST, headline_n=8),
    ),
    ns=(8,),
    quick_ns=(2,),
    default_reps=3,
    params={"standalone": True, "script": "gloo"},
    rep_timeout=150.0,
)

# torchrun restarts this job only with its own store per attempt: by default its c10d
# rendezvous (``--standalone``) keeps one store server for the whole run and its ranks use it
# unprefixed (``TORCHELASTIC_USE_AGENT_STORE``), so attempt 1's gloo reads attempt 0's rank
# addresses. Its opt-out makes every rendezvous round start a fresh store in rank 0.
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
TORCHRUN_RESTART = f"{NO_SHARED_STORE} {TORCHRUN_FAST}"

# The same script failing once: torchrun runs two attempts of N torch-importing ranks
# (~2 s per rank on 2 cores), hence 3 repetitions and not in --quick.
_RESTART = Group(
    name="gloo restart",
    systems=(
        System(
            PRELOAD,
            "aioelastic",
            f"{_M}:aio_run",
            {"flags": "--preload torch --max-restarts 1"},
            quick=False,
        ),
        System(
            TORCHRUN_RESTART,
            "torch",
            f"{_M}:torchrun",
            {"flags": "--monitor-interval 0.01 --max-restarts 1", "env": NO_SHARED_STORE},
            quick=False,
        ),
    ),
    rows=(
        Row(
            "real script, rank 0 fails once past the barrier, ours --preload torch",
            PRELOAD,
            TORCHRUN_RESTART,
            headline_n=8,
            metric="restart",
        ),
    ),
    ns=(8,),
    quick_ns=(2,),
    default_reps=3,
    params={"standalone": True, "script": "gloo", "fail_once": True},
    rep_timeout=200.0,
)


MEASURE = Measure(
    name="launcher",
    letter="h",
    title="launcher overhead on a trivial script",
    metrics=(SECONDS, TO_USER, RESTART),
    notes=(
        "`python -m aioelastic.run` vs `python -m torch.distributed.run` (torchrun), "
        "`--nproc-per-node N --standalone script.py` (the documented single-node form) and "
        "`--nproc-per-node N --master-port P script.py` (static rendezvous); the script stamps "
        "the clock and exits. Real script: every rank imports torch, calls "
        "`init_process_group('gloo')` and passes a barrier; *to user code* is then launch to "
        "the last rank past the barrier. `--preload torch`: a warm fork server that imported "
        "torch forks every rank. Restart: the same script with `--max-restarts 1`, rank 0 exits "
        "1 past the barrier in attempt 0 while the others keep running; *failure to barrier* "
        "is rank 0's stamp just before its exit to the last rank past the barrier in attempt 1. "
        "torchrun there runs at `--monitor-interval 0.01` (default 0.1 s) with "
        "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (a fresh store per attempt; without it "
        "attempt 1 reads attempt 0's gloo keys and fails)."
    ),
    groups=(
        _group("standalone", "trivial script, --standalone", {"standalone": True}),
        _group("static", "trivial script, --master-port P", {"standalone": False}),
        _REAL,
        _RESTART,
    ),
)
