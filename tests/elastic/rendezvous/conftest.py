"""Fixtures of the rendezvous tests: an etcd cluster, and the gate its jobs hold at."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.etcd_cluster import EtcdCluster, etcd_cluster, require_client
from tests.support.etcd_runs import Gate


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A running three-member cluster, within `READY_TIMEOUT`.

    Skips where etcd or python-etcd is missing (fails under ``CI=true``).
    """
    require_client()
    with etcd_cluster(tmp_path / "etcd") as started:
        yield started


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Gate]:
    held = Gate(tmp_path)
    try:
        yield held
    finally:
        held.release()
