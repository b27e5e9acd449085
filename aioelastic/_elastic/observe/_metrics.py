"""Liveness and Prometheus metrics of an elastic agent, over HTTP.

:class:`Metrics` follows the agent's event stream (``agent.events()``) and exposes it
through ``prometheus-client`` (the optional extra ``aioelastic[metrics]``), in a registry
of its own. :class:`Liveness` measures the event loop's lag; the answer itself comes from
the loop (:mod:`._http`), so a wedged supervisor does not answer at all and a lagging one
answers 503. :func:`observed` serves both for the lifetime of an agent's run:

* ``--metrics-port P``: ``/metrics`` and ``/health`` on 127.0.0.1 unless told otherwise;
* ``TORCHELASTIC_HEALTH_CHECK_PORT``: torchrun's variable, a stub in open-source torch
  2.13; here ``/`` and ``/health`` answer for real.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from ._events import (
    AgentEvent,
    EventStream,
    GroupRestarting,
    GroupStopping,
    RendezvousCompleted,
    RunFailed,
    RunSucceeded,
    StopReason,
    WorkerFailed,
    WorkersStarted,
)
from ._http import Response, serve_http

#: torchrun's variable for the health-check port.
HEALTH_CHECK_PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"


class Liveness:
    """How late the event loop runs a timer: the supervisor's own pulse.

    Args:
        interval: seconds between ticks.
        max_lag: a tick later than this (seconds) makes the supervisor unhealthy.
    """

    def __init__(self, interval: float = 0.5, max_lag: float = 5.0) -> None:
        self.interval = interval
        self.max_lag = max_lag
        self.lag = 0.0
        self.last_tick = time.monotonic()
        self.last_progress = time.time()

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            before = time.monotonic()
            await anyio.sleep(self.interval)
            self.last_tick = time.monotonic()
            self.lag = max(0.0, self.last_tick - before - self.interval)
            self.last_progress = time.time()

    def healthy(self) -> bool:
        """Whether the loop ticked on time lately."""
        late = time.monotonic() - self.last_tick - self.interval
        return self.lag <= self.max_lag and late <= self.max_lag

    def response(self) -> Response:
        """``200 {"status": "ok", ...}`` or ``503 {"status": "unhealthy", ...}``."""
        ok = self.healthy()
        body = {
            "status": "ok" if ok else "unhealthy",
            "loop_lag_seconds": round(self.lag, 6),
            "last_progress_time": int(self.last_progress),
        }
        return Response(200 if ok else 503, (json.dumps(body) + "\n").encode(), "application/json")


class Metrics:
    """The agent's metrics in a ``prometheus-client`` registry of their own.

    Args:
        last_output: returns ``{local_rank: wall-clock time of its last output}`` of the
            running workers (sampled at every scrape).
        liveness: the loop's pulse, exported as ``aioelastic_event_loop_lag_seconds``.

    Raises:
        ImportError: ``prometheus-client`` is not installed (``pip install
            'aioelastic[metrics]'``).
    """

    def __init__(
        self,
        last_output: Callable[[], Mapping[int, float]] = dict,
        liveness: Liveness | None = None,
    ) -> None:
        try:
            import prometheus_client as prom
            from prometheus_client.core import GaugeMetricFamily
        except ImportError as exc:
            raise ImportError(
                "metrics need prometheus-client: pip install 'aioelastic[metrics]'"
            ) from exc
        self._prom = prom
        registry = self.registry = prom.CollectorRegistry()
        self.workers_running = prom.Gauge(
            "aioelastic_workers_running", "Local workers running now.", registry=registry
        )
        self.restarts = prom.Counter(
            "aioelastic_restarts",
            "Restarts of the worker group after a failure.",
            registry=registry,
        )
        self.failures = prom.Counter(
            "aioelastic_worker_failures",
            "Workers that failed by themselves, by exit code and signal.",
            ["exitcode", "signal"],
            registry=registry,
        )
        self.start_latency = prom.Histogram(
            "aioelastic_worker_start_latency_seconds",
            "From rendezvous completed to every local worker started.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.stalls = prom.Counter(
            "aioelastic_stalls", "Worker groups stopped as stalled.", registry=registry
        )
        self.timer_expiries = prom.Counter(
            "aioelastic_timer_expiries",
            "Workers stopped by an expired timer.",
            registry=registry,
        )
        lag = prom.Gauge(
            "aioelastic_event_loop_lag_seconds",
            "How late the supervisor's event loop last ran a timer.",
            registry=registry,
        )
        if liveness is not None:
            lag.set_function(lambda: liveness.lag)
        registry.register(_LastOutput(last_output, GaugeMetricFamily))
        self._rendezvous_at: dict[int, float] = {}
        self._stalled_attempts: set[int] = set()

    def observe(self, event: AgentEvent) -> None:
        """Account for one agent event."""
        if isinstance(event, RendezvousCompleted):
            self._rendezvous_at[event.attempt] = event.timestamp
        elif isinstance(event, WorkersStarted):
            self.workers_running.set(len(event.pids))
            began = self._rendezvous_at.pop(event.attempt, None)
            if began is not None:
                self.start_latency.observe(max(0.0, event.timestamp - began))
        elif isinstance(event, WorkerFailed):
            self.failures.labels(str(event.exitcode), event.signal or "").inc()
            if event.message.startswith("timer expired after "):
                self.timer_expiries.inc()
            elif event.message.startswith("stalled: ") and (
                event.attempt not in self._stalled_attempts
            ):
                self._stalled_attempts.add(event.attempt)
                self.stalls.inc()
        elif isinstance(event, GroupRestarting):
            if event.reason is StopReason.WORKER_FAILED:
                self.restarts.inc()
        elif isinstance(event, (GroupStopping, RunSucceeded, RunFailed)):
            self.workers_running.set(0)

    async def follow(self, events: EventStream) -> None:
        """Observe every event of ``events`` until it ends."""
        async for event in events:
            self.observe(event)

    def response(self) -> Response:
        """The Prometheus text exposition."""
        return Response(
            200, self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST
        )


class _LastOutput:
    """A collector sampling each rank's last output time at scrape time."""

    def __init__(self, source: Callable[[], Mapping[int, float]], family: Any) -> None:
        self._source = source
        self._family = family

    def collect(self) -> Iterable[Any]:
        family = self._family(
            "aioelastic_worker_last_output_timestamp_seconds",
            "When each running local worker last wrote output (seconds since the epoch).",
            labels=["local_rank"],
        )
        for rank, when in sorted(self._source().items()):
            family.add_metric([str(rank)], when)
        yield family

    def describe(self) -> Iterable[Any]:
        return []


async def open_listener(port: int, host: str = "127.0.0.1") -> Any:
    """A TCP listener on ``host:port``; ``port`` 0 picks a free one."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"a port must be an integer in 0..65535, got {port!r}")
    return await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)


def health_port_from_env(environ: Mapping[str, str]) -> int | None:
    """``TORCHELASTIC_HEALTH_CHECK_PORT`` as a port, ``None`` when unset or empty."""
    value = environ.get(HEALTH_CHECK_PORT_ENV, "").strip()
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port <= 65535:
        raise ValueError(
            f"{HEALTH_CHECK_PORT_ENV}={value!r} is not a port; set it to an integer in 1..65535"
        )
    return port


@asynccontextmanager
async def observed(
    events: EventStream | None,
    *,
    metrics_port: int | None = None,
    health_port: int | None = None,
    host: str = "127.0.0.1",
    last_output: Callable[[], Mapping[int, float]] = dict,
) -> AsyncIterator[dict[str, int]]:
    """Serve liveness (and metrics) while the block runs; yields ``{"metrics"|"health": port}``.

    ``events`` is the agent's subscription (``agent.events()``, taken before ``run()``).
    """
    liveness = Liveness()
    metrics = Metrics(last_output, liveness) if metrics_port is not None else None
    ports: dict[str, int] = {}
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(liveness.run)
        if metrics is not None:
            assert metrics_port is not None
            listener = await open_listener(metrics_port, host)
            ports["metrics"] = listener.extra(anyio.abc.SocketAttribute.local_port)
            routes = {"/metrics": metrics.response, "/health": liveness.response}
            tg.start_soon(serve_http, listener, routes)
            if events is not None:
                tg.start_soon(metrics.follow, events)
        if health_port is not None:
            listener = await open_listener(health_port, host)
            ports["health"] = listener.extra(anyio.abc.SocketAttribute.local_port)
            routes = {"/": liveness.response, "/health": liveness.response}
            tg.start_soon(serve_http, listener, routes)
        try:
            yield ports
        except BaseException as exc:
            # Re-raised below, outside the task group: inside, the body's own exception
            # (a SignalReceived, a ChildFailedError) would come out wrapped in a group.
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
