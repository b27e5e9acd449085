"""PyTorch's own launcher tests, run against ``aioelastic-run`` in place of torchrun.

Ported from ``test/distributed/launcher/test_run.py`` (``ElasticLaunchTest``), with the
same arguments, written the way that file writes them: as an argument list that no shell
reads, so ``--rdzv-conf='join_timeout=5,...'`` arrives with its quotes. torchrun's
``main`` raises ``ChildFailedError`` for a failed worker; the command line's equivalent is
the worker's exit status and the failure report on stderr.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support.cli_run import launch, with_env
from tests.support.paths import CHILDREN
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(CHILDREN / "torch_launch_script.py")


def _elastic_args(*extra: str) -> list[str]:
    """``test_launch_elastic``'s flags: one node of 1:2 over c10d on localhost, 4 workers."""
    return [
        "--nnodes=1:2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}",
        "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
        f"--rdzv-id={uuid.uuid4().int}",
        "--monitor-interval=1",
        *extra,
        "--start-method=spawn",
        SCRIPT,
    ]


def test_launch_elastic(tmp_path: Path) -> None:
    run = launch(
        *_elastic_args(),
        f"--touch-file-dir={tmp_path}",
        env=with_env(TEST_SENTINEL_PARENT="FOOBAR"),
    )
    assert run.proc.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3"]


def test_launch_elastic_worker_raise_exception() -> None:
    run = launch(
        *_elastic_args("--max-restarts=0"),
        "--fail",
        env=with_env(TEST_SENTINEL_PARENT="FOOBAR"),
    )
    assert run.proc.returncode == 1, run.stderr
    assert "RuntimeError: raising exception since --fail flag was set" in run.stderr
