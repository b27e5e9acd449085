"""The tests' face of the SLURM cluster in ``workloads/slurm_cluster.py`` (see its doc).

:func:`unavailable` skips a test where SLURM cannot run here, and fails it under
``CI=true``, where ``.ci/run`` installed it. The session fixture :func:`slurm` starts the
cluster for the first test that asks for it; its daemons do not get the leak check's
mark, and :func:`daemon_pids` names them to the leak check as long-lived.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import NoReturn

import pytest

from tests.support.audit import MARK_VAR
from workloads.slurm_cluster import (
    CRED_EXPIRE,
    KILL_WAIT,
    NODES,
    SLURMD_TIMEOUT,
    SlurmCluster,
    SlurmUnavailable,
)

__all__ = ["CRED_EXPIRE", "KILL_WAIT", "NODES", "SLURMD_TIMEOUT", "SlurmCluster", "slurm"]


def unavailable(reason: str) -> NoReturn:
    """Skip the test for ``reason``; under ``CI=true``, fail it (``.ci/run`` installs SLURM)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the SLURM tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


#: The clusters running now (one per session at most), for :func:`daemon_pids`.
_RUNNING: list[SlurmCluster] = []


def daemon_pids() -> set[int]:
    """The daemons of the running clusters: the leak check counts them as long-lived."""
    return {pid for cluster in _RUNNING for pid in cluster.pids()}


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The session's SLURM cluster, started by the first test that asks for it."""
    cluster = SlurmCluster(
        tmp_path_factory.mktemp("slurm"),
        private_env=(MARK_VAR,),
        # aioelastic-run's store port comes from the job id: apart from other sessions'.
        first_job_id=random.randrange(1_000, 1_000_000),
    )
    _RUNNING.append(cluster)
    try:
        try:
            cluster.start()
        except SlurmUnavailable as exc:
            unavailable(str(exc))
        yield cluster
    finally:
        cluster.close()
        _RUNNING.remove(cluster)
