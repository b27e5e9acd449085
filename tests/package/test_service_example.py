"""examples/service.py end to end: a real server on 127.0.0.1, a real HTTP client, real jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support.paths import REPO
from tests.support.waits import is_running

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SERVICE = REPO / "examples" / "service.py"


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.url = url


@pytest.fixture
def server(tmp_path: Path) -> Any:
    proc = subprocess.Popen(
        [sys.executable, str(SERVICE), "--port", "0", "--log-root", str(tmp_path / "jobs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # the server prints its address when bound
        assert line.startswith("serving on http://127.0.0.1:"), line + proc.stderr.read().decode()
        yield Server(proc, line.split()[2])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


async def _events(response: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    event = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            assert event is not None
            yield event, json.loads(line[len("data: ") :])


async def _wait_status(client: Any, job_id: int, wanted: str) -> dict[str, Any]:
    """Follow the job's event stream until it reports ``wanted`` (or its final status)."""
    with anyio.fail_after(60):
        async with client.stream("GET", f"/jobs/{job_id}/stream") as response:
            async for event, data in _events(response):
                if event == "status" and data["status"] in (wanted, "failed", "succeeded"):
                    return data
    raise AssertionError(f"the stream of job {job_id} ended without status {wanted!r}")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_job_streams_every_line_and_ends_with_its_status(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        job = (await client.post("/jobs", json={"nprocs": 2, "steps": 20, "step_time": 0})).json()
        lines: dict[int, list[str]] = {0: [], 1: []}
        frames = 0
        statuses = []
        with anyio.fail_after(60):
            async with client.stream("GET", f"/jobs/{job['id']}/stream") as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                async for event, data in _events(response):
                    if event == "status":
                        statuses.append(data["status"])
                    elif data["frame"]:
                        frames += 1
                    elif data["stream"] == "stdout":
                        assert data["missed"] == 0
                        lines[data["local_rank"]].append(data["text"])
        assert statuses[-1] == "succeeded"
        for rank in (0, 1):
            log = Path(job["log_dir"], str(rank), "stdout.log").read_text().splitlines()
            assert lines[rank] == log
            assert lines[rank][-1] == f"rank {rank}: done"
        assert frames > 0  # the progress bar arrived as frames, not as lines


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_client_leaving_mid_stream_does_not_stop_the_job_and_delete_does(
    server: Server,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        job = (
            await client.post("/jobs", json={"nprocs": 2, "steps": 100000, "step_time": 0.01})
        ).json()
        url = f"/jobs/{job['id']}"
        with anyio.fail_after(60):
            async with client.stream("GET", f"{url}/stream") as response:
                async for event, _ in _events(response):
                    if event == "output":
                        break  # the client goes away mid-stream
        running = await _wait_status(client, job["id"], "running")
        assert running["status"] == "running"
        pids = list(running["pids"].values())
        assert all(is_running(pid) for pid in pids)
        with anyio.fail_after(30):
            cancelled = (await client.delete(url)).json()
        assert cancelled["status"] == "cancelled"
        assert not any(is_running(pid) for pid in pids)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_job_cancelled_while_it_starts_leaves_nothing(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        job = (await client.post("/jobs", json={"nprocs": 8, "steps": 100000})).json()
        with anyio.fail_after(30):
            cancelled = (await client.delete(f"/jobs/{job['id']}")).json()
        assert cancelled["status"] == "cancelled"
        assert not any(is_running(pid) for pid in cancelled["pids"].values())


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_failing_job_reports_the_failed_rank(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        job = (
            await client.post(
                "/jobs", json={"nprocs": 3, "steps": 50, "step_time": 0.01, "fail_at": 3}
            )
        ).json()
        failed = await _wait_status(client, job["id"], "failed")
        assert [f["local_rank"] for f in failed["failures"]] == [2]
        assert failed["failures"][0]["exitcode"] == 3
        assert "loss is NaN at step 3" in failed["failures"][0]["message"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_server_shutdown_stops_every_job(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        ids = [
            (await client.post("/jobs", json={"nprocs": 2, "steps": 100000})).json()["id"]
            for _ in range(3)
        ]
        pids = []
        for job_id in ids:
            job = await _wait_status(client, job_id, "running")
            # The whole summary on failure: its `failures` say why a job did not start.
            assert job["status"] == "running", job
            pids += list(job["pids"].values())
    server.proc.send_signal(signal.SIGINT)
    returncode = await anyio.to_thread.run_sync(lambda: server.proc.wait(timeout=30))
    # Uvicorn shuts down cleanly, then re-raises the signal it caught so that the exit
    # status says what ended it.
    assert returncode == -signal.SIGINT
    assert not any(is_running(pid) for pid in pids)
