"""A small HTTP service that runs training jobs side by side and streams their output live.

    pip install -e ".[examples]"
    python examples/service.py --port 8000

    curl -s -X POST localhost:8000/jobs -d '{"nprocs": 2, "steps": 40}'   # -> {"id": 1, ...}
    curl -sN localhost:8000/jobs/1/stream       # output and lifecycle, as Server-Sent Events
    curl -s localhost:8000/jobs/1               # status, pids, failures
    curl -s -X DELETE localhost:8000/jobs/1     # cancel: every worker is stopped

Every job is one :func:`aioelastic.start_processes` group running ``toy_train.py`` (beside
this file) in a task of the service's own task group, with its own log directory under
``--log-root``. The shapes that matter for a service:

* A job is a task with a cancel scope: ``DELETE`` cancels the scope, and leaving the
  ``async with`` block stops the workers (SIGTERM, grace period, SIGKILL, reaped) — also when
  the job is cancelled while its workers are still starting.
* A stream is a subscription to ``ctx.output()``: a client that reads slowly gets gap counts,
  never slows the job; a client that disconnects unsubscribes; the job goes on.
* Shutting the server down cancels the task group, which stops every job before the
  process exits: nothing is left running.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import itertools
import json
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import aioelastic
from aioelastic import Std

TOY_TRAIN = Path(__file__).with_name("toy_train.py")
MAX_NPROCS = 16


class Status(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class Job:
    """One job: what was asked, its workers while they run, and how it ended."""

    id: int
    nprocs: int
    argv: list[str]
    log_dir: Path
    status: Status = Status.STARTING
    pids: dict[int, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    ctx: aioelastic.PContext | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: Set once the workers are running (or the job ended before they could).
    started: anyio.Event = field(default_factory=anyio.Event)
    ended: anyio.Event = field(default_factory=anyio.Event)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status.value,
            "nprocs": self.nprocs,
            "pids": self.pids,
            "failures": self.failures,
            "log_dir": str(self.log_dir),
        }


class Jobs:
    """The jobs of one service, each a task in the service's task group."""

    def __init__(self, task_group: anyio.abc.TaskGroup, log_root: Path) -> None:
        self._tg = task_group
        self._log_root = log_root
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)

    def get(self, job_id: int) -> Job | None:
        return self._jobs.get(job_id)

    def start(self, nprocs: int, argv: list[str]) -> Job:
        job_id = next(self._ids)
        job = Job(job_id, nprocs, argv, self._log_root / f"job{job_id}")
        self._jobs[job_id] = job
        self._tg.start_soon(self._run, job)
        return job

    async def _run(self, job: Job) -> None:
        try:
            with job.scope:
                async with aioelastic.start_processes(
                    name=f"job{job.id}",
                    entrypoint=sys.executable,
                    args={rank: tuple(job.argv) for rank in range(job.nprocs)},
                    envs={
                        rank: {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": job.nprocs}
                        for rank in range(job.nprocs)
                    },
                    log_dir=job.log_dir,
                    redirects=Std.ALL,
                    grace_period=5.0,
                ) as ctx:
                    job.ctx = ctx
                    job.pids = ctx.pids()
                    job.status = Status.RUNNING
                    job.started.set()
                    result = await ctx.wait()
                assert result is not None
                job.failures = [
                    {
                        "local_rank": rank,
                        "exitcode": failure.exitcode,
                        "message": failure.message,
                    }
                    for rank, failure in sorted(result.failures.items())
                ]
                job.status = Status.FAILED if result.is_failed() else Status.SUCCEEDED
            if job.scope.cancelled_caught:
                job.status = Status.CANCELLED
        except Exception as exc:  # a job that cannot start fails alone, not the service
            job.status = Status.FAILED
            job.failures = [{"local_rank": None, "exitcode": None, "message": str(exc)}]
        finally:
            job.started.set()
            job.ended.set()

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-Sent Events: the status, once running the status again, every output line
        and frame, then the final status."""
        yield _sse("status", job.summary())
        await job.started.wait()
        if job.ctx is not None:
            yield _sse("status", job.summary())
            async with job.ctx.output() as items:
                async for item in items:
                    event = {
                        "local_rank": item.local_rank,
                        "stream": "stdout" if item.stream is Std.OUT else "stderr",
                        "text": item.text,
                        "frame": item.frame,
                        "missed": item.missed,
                    }
                    yield _sse("output", event)
        await job.ended.wait()
        yield _sse("status", job.summary())


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def create_app(log_root: Path) -> Starlette:
    """The service: a Starlette app whose lifespan owns the jobs' task group."""
    jobs: Jobs | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal jobs
        async with anyio.create_task_group() as tg:
            jobs = Jobs(tg, log_root)
            yield
            # Shutdown: stop every job (each one's teardown is shielded and bounded).
            tg.cancel_scope.cancel()

    def _job(request: Request) -> Job | None:
        assert jobs is not None
        return jobs.get(int(request.path_params["job_id"]))

    async def create_job(request: Request) -> Response:
        assert jobs is not None
        try:
            body = json.loads(await request.body() or b"{}")
            nprocs = int(body.get("nprocs", 2))
            steps = int(body.get("steps", 20))
            step_time = float(body.get("step_time", 0.05))
            fail_at = int(body.get("fail_at", -1))
        except (ValueError, TypeError, AttributeError) as exc:
            return JSONResponse({"error": f"bad job description: {exc}"}, status_code=400)
        if not 1 <= nprocs <= MAX_NPROCS or steps < 1 or not 0 <= step_time <= 10:
            return JSONResponse(
                {"error": f"nprocs must be 1..{MAX_NPROCS}, steps >= 1, step_time 0..10 s"},
                status_code=400,
            )
        argv = ["-u", str(TOY_TRAIN), "--steps", str(steps), "--step-time", str(step_time)]
        argv += ["--fail-at", str(fail_at), "--fail-rank", str(nprocs - 1)]
        job = jobs.start(nprocs, argv)
        return JSONResponse(job.summary(), status_code=201)

    async def get_job(request: Request) -> Response:
        job = _job(request)
        if job is None:
            return JSONResponse({"error": "no such job"}, status_code=404)
        return JSONResponse(job.summary())

    async def stream_job(request: Request) -> Response:
        job = _job(request)
        if job is None:
            return JSONResponse({"error": "no such job"}, status_code=404)
        assert jobs is not None
        return StreamingResponse(jobs.stream(job), media_type="text/event-stream")

    async def cancel_job(request: Request) -> Response:
        job = _job(request)
        if job is None:
            return JSONResponse({"error": "no such job"}, status_code=404)
        job.scope.cancel()
        with anyio.fail_after(30):
            await job.ended.wait()
        return JSONResponse(job.summary())

    return Starlette(
        routes=[
            Route("/jobs", create_job, methods=["POST"]),
            Route("/jobs/{job_id:int}", get_job, methods=["GET"]),
            Route("/jobs/{job_id:int}", cancel_job, methods=["DELETE"]),
            Route("/jobs/{job_id:int}/stream", stream_job, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Run training jobs over HTTP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--log-root", type=Path, default=None)
    opts = parser.parse_args()
    log_root = opts.log_root or Path(tempfile.mkdtemp(prefix="aioelastic-service-"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((opts.host, opts.port))
    # Listening before the address is printed: a client that connects at once is queued
    # until the server accepts, never refused.
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        create_app(log_root),
        log_level="warning",
        # Open event streams are cut after this long on shutdown; the lifespan then stops
        # every job.
        timeout_graceful_shutdown=2,
    )
    print(f"serving on http://{host}:{port} (job logs in {log_root})", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
