"""``elastic_launch``: torch's launch API over the agent, in the test process and alone.

The agent it builds is tested in tests/elastic/agent/test_agent.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

from aioelastic._core.reports._failures import ChildFailedError
from aioelastic._elastic.launch._elastic_launch import LaunchConfig, elastic_launch
from tests.children import agent as children
from tests.support.agents import FUNCTION_START
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.torch,
    pytest.mark.usefixtures("torch_store_warmed", "agent_env", "collect_stores"),
]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_elastic_launch_returns_by_global_rank_or_raises_child_failed(
    out_dir: Path,
) -> None:
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0, start_method=FUNCTION_START
    )
    launch = elastic_launch(config, children.report)
    stream = launch.events()
    outputs = await launch(str(out_dir))
    assert sorted(outputs) == [0, 1]
    assert outputs[1]["RANK"] == "1"
    assert outputs[0]["ROLE_NAME"] == "default_role"  # torch's LaunchConfig default
    assert outputs[0]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert [e.kind async for e in stream][-1] == "run_succeeded"

    failing = elastic_launch(config, children.fail_until)
    with pytest.raises(ChildFailedError) as caught:
        await failing(str(out_dir), 99, 1, 4)
    assert list(caught.value.failures) == [1]
    assert caught.value.failures[1].exitcode == 4
    assert caught.value.name == "fail_until"


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "static"])
async def test_the_same_config_launches_again_in_the_same_process(
    out_dir: Path, backend: str
) -> None:
    # A fixed endpoint and run id: the second launch must find the port free and a fresh
    # rendezvous, not the first launch's closed one (the same after a failed launch).
    endpoint = f"127.0.0.1:{free_port()}"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        max_restarts=0,
        run_id="again",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        # static reads no join_timeout (refused for it, as every key a backend never reads).
        rdzv_configs={"join_timeout": 30} if backend == "c10d" else {},
        start_method=FUNCTION_START,
    )
    started = time.monotonic()
    with pytest.raises(ChildFailedError):
        await elastic_launch(config, children.fail_until)(str(out_dir), 99, 1, 4)
    for _ in range(2):
        outputs = await elastic_launch(config, children.report)(str(out_dir))
        assert sorted(outputs) == [0, 1]
    assert time.monotonic() - started < 90
    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:  # nothing of the launches listens there any more
        s.bind((host, int(port)))


def test_one_node_without_store_sharing_keeps_torch_out_of_the_launcher(out_dir: Path) -> None:
    code = (
        "import asyncio, json, sys\n"
        "from aioelastic._elastic.launch._elastic_launch import LaunchConfig, elastic_launch\n"
        "from tests.children.agent import report\n"
        "config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0)\n"
        "out = asyncio.run(elastic_launch(config, report)(sys.argv[1]))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'out': out}))\n"
    )
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["torch"] is False
    assert sorted(report["out"]) == ["0", "1"]
    assert report["out"]["1"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
