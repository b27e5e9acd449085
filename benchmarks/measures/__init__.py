"""The measures of the suite, in the order they run and print (issue #7's a..h, then i..m)."""

from __future__ import annotations

from benchmarks.harness._spec import Measure
from benchmarks.measures import (
    binary,
    burst,
    completion,
    failure,
    floor,
    idle,
    launcher,
    multinode,
    restart,
    scale,
    slurm,
    startup,
    teardown,
    tee,
)


def all_measures() -> list[Measure]:
    """Every measure, floor first."""
    return [
        floor.MEASURE,
        startup.MEASURE,
        binary.MEASURE,
        completion.MEASURE,
        failure.MEASURE,
        teardown.MEASURE,
        restart.MEASURE,
        idle.MEASURE,
        tee.MEASURE,
        launcher.MEASURE,
        scale.MEASURE,
        multinode.MEASURE,
        burst.MEASURE,
        slurm.MEASURE,
    ]
