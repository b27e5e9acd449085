"""c. Failure detection: from a worker's exit to the caller holding the failure.

See :mod:`benchmarks.measures._failjob`: rank 0 exits 1 at a random moment (up to 1 s)
after all N workers run; its siblings stop at the first SIGTERM. ``seconds`` includes
stopping those siblings, which both systems do before handing the failure over;
``detected`` (N > 1) ends when the first sibling receives its SIGTERM: the supervisor
has seen the failure and acted on it.
"""

from __future__ import annotations

from benchmarks.harness._spec import SECONDS, Group, Measure, Metric
from benchmarks.measures._systems import binary_pair, binary_row, forkserver_rows, forkserver_trio

_M = "benchmarks.measures._failjob"
DETECTED = Metric("detected", "ms", scale=1000.0)
_PARAMS = {"ignore_term": False, "grace": 30.0, "limit": 60.0, "jitter": 1.0}

MEASURE = Measure(
    name="failure",
    letter="c",
    title="a worker's exit to the caller holding the failure",
    metrics=(SECONDS, DETECTED),
    notes=(
        "Rank 0 exits 1 at a random moment up to 1 s after all N run; siblings stop on SIGTERM. "
        "seconds: to the caller holding the failure, siblings stopped; detected (N > 1): to "
        "the first sibling receiving SIGTERM (the failure seen and acted on). "
        "torch.elastic: default `wait()` (period 1 s). torch.mp: `join()` on the process sentinels."
    ),
    groups=(
        Group(
            name="bin",
            systems=binary_pair(_M),
            rows=(binary_row("bin", headline_n=1),),
            ns=(1, 4, 8, 16),
            quick_ns=(2,),
            default_reps=7,
            params=_PARAMS,
            rep_timeout=60.0,
            quick_params={"jitter": 0.05},
            warmup=False,
        ),
        Group(
            name="fn",
            systems=forkserver_trio(_M),
            rows=forkserver_rows("fn forkserver", headline_n=1),
            ns=(1, 4, 8, 16),
            quick_ns=(2,),
            default_reps=7,
            params=_PARAMS,
            rep_timeout=60.0,
            quick_params={"jitter": 0.05},
        ),
    ),
)
