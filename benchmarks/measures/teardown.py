"""d. Teardown of SIGTERM-ignoring workers with a grace period g.

after failure: rank 0 fails (see :mod:`benchmarks.measures._failjob`), its siblings ignore
SIGTERM; from rank 0's exit to the caller holding the failure. aioelastic runs with
``grace_period=g`` and should take g plus a few ms; torch.multiprocessing's ``join`` has a
``grace_period`` too (it waits g, sends SIGTERM, waits g again: 2g);
torch.distributed.elastic's failure path has no such knob and always allows 30 s, so its
runs are stopped after a short limit and shown as ``> limit``.

close(g): N running SIGTERM-ignoring binaries, from the call to ``close`` with grace g
(torch: ``close(timeout=g)``) until it returns. Both honour g here.
"""

from __future__ import annotations

from benchmarks.harness._spec import SECONDS, Group, Measure, Metric
from benchmarks.measures._systems import binary_pair, binary_row, forkserver_rows, forkserver_trio

_M = "benchmarks.measures._failjob"
_PARAMS = {"ignore_term": True, "grace": 0.5, "limit": 5.0, "jitter": 0.0}
_QUICK = {"grace": 0.2, "limit": 1.5}
BEYOND = Metric("beyond_grace", "ms beyond g", scale=1000.0)

MEASURE = Measure(
    name="teardown",
    letter="d",
    title="stopping SIGTERM-ignoring workers with grace g = 0.5 s",
    metrics=(SECONDS, BEYOND),
    notes=(
        "after failure: rank 0 exits 1, siblings ignore SIGTERM; exit to failure in hand. "
        "torch.elastic's failure path always waits 30 s (no knob): stopped after 5 s, "
        "shown as `> 5000`. "
        "torch.mp: `join(grace_period=g)` (waits g, SIGTERM, waits g, SIGKILL). "
        "close(g): `close` of N running SIGTERM-ignoring binaries (torch: `close(timeout=g)`)."
    ),
    groups=(
        Group(
            name="fn-after-failure",
            systems=forkserver_trio(_M),
            rows=forkserver_rows("fn after failure"),
            ns=(2, 8),
            quick_ns=(2,),
            default_reps=3,
            params=_PARAMS,
            rep_timeout=60.0,
            quick_params=_QUICK,
        ),
        Group(
            name="bin-after-failure",
            systems=binary_pair(_M),
            rows=(binary_row("bin after failure", headline_n=8),),
            ns=(2, 8),
            quick_ns=(2,),
            default_reps=3,
            params=_PARAMS,
            rep_timeout=60.0,
            quick_params=_QUICK,
            warmup=False,
        ),
        Group(
            name="bin-close",
            systems=binary_pair(_M, "aio_close_bin", "torch_elastic_close_bin"),
            rows=(binary_row("bin close(g)"),),
            ns=(2, 8),
            quick_ns=(2,),
            default_reps=3,
            params=_PARAMS,
            rep_timeout=60.0,
            quick_params=_QUICK,
            warmup=False,
        ),
    ),
)
