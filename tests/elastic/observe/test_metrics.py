"""Liveness and Prometheus metrics over real HTTP on 127.0.0.1, fed by a real agent."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import anyio.abc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioelastic import LocalElasticAgent, WorkerSpec, WorkerState, free_port
from aioelastic._elastic.observe._http import serve_http
from aioelastic._elastic.observe._metrics import (
    Liveness,
    Metrics,
    health_port_from_env,
    observed,
    open_listener,
)
from tests.children import hangs
from tests.support.waits import ReadyFifo

pytestmark = pytest.mark.timeout(120)


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    """A blocking GET (run it in a thread): status, content type, body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


async def aget(port: int, path: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    return await anyio.to_thread.run_sync(get, port, path, timeout)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, parsed by prometheus-client's own parser."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.mark.asyncio
async def test_agent_restarts_after_a_timer_expiry_and_the_metrics_tell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    ready = ReadyFifo(tmp_path)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=hangs.hang_on_first_attempt,
        args=(str(ready.path),),
        max_restarts=1,
    )
    agent = LocalElasticAgent(spec, log_dir=tmp_path / "logs", shutdown_timeout=5)
    during: dict[int, float] = {}
    try:
        async with observed(
            agent.events(),
            metrics_port=0,
            health_port=0,
            last_output=lambda: agent._ctx.last_output_times() if agent._ctx else {},
        ) as ports:
            async with anyio.create_task_group() as tg:

                async def scrape_while_hung() -> None:
                    await ready.lines(2, timeout=60)
                    assert agent._ctx is not None
                    # The lines were written before "ready"; the pumps read them at once.
                    with anyio.fail_after(30):
                        while len(agent._ctx.last_output_times()) < 2:
                            await anyio.sleep(0.05)
                    _, _, body = await aget(ports["metrics"], "/metrics")
                    during.update(
                        {
                            int(dict(labels)["local_rank"]): value
                            for (name, labels), value in samples(body.decode()).items()
                            if name == "aioelastic_worker_last_output_timestamp_seconds"
                        }
                    )

                tg.start_soon(scrape_while_hung)
                with anyio.fail_after(90):
                    result = await agent.run()
            status, ctype, body = await aget(ports["metrics"], "/metrics")
            health = await aget(ports["health"], "/")
    finally:
        ready.close()
    assert result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: "recovered", 1: "recovered"}
    assert status == 200
    assert ctype.startswith("text/plain; version=")
    got = samples(body.decode())
    assert got[("aioelastic_restarts_total", ())] == 1
    assert got[("aioelastic_timer_expiries_total", ())] == 1
    assert got[("aioelastic_stalls_total", ())] == 0
    assert (
        got[("aioelastic_worker_failures_total", (("exitcode", "-9"), ("signal", "SIGKILL")))] == 1
    )
    assert got[("aioelastic_worker_start_latency_seconds_count", ())] == 2
    assert got[("aioelastic_workers_running", ())] == 0
    assert ("aioelastic_event_loop_lag_seconds", ()) in got
    # While rank 1 hung, both ranks had printed their "attempt 0" line.
    assert sorted(during) == [0, 1]
    assert all(abs(t - time.time()) < 120 for t in during.values())
    assert health[0] == 200
    assert json.loads(health[2])["status"] == "ok"


@pytest.mark.asyncio
async def test_health_port_answers_and_is_bound_to_loopback() -> None:
    async with observed(None, health_port=0) as ports:
        assert "metrics" not in ports
        status, ctype, body = await aget(ports["health"], "/health")
        assert (status, ctype) == (200, "application/json")
        answer = json.loads(body)
        assert answer["status"] == "ok"
        assert abs(answer["last_progress_time"] - time.time()) < 60
        assert (await aget(ports["health"], "/nope"))[0] == 404
        # Only loopback: the port is not reachable on another local address.
        other = socket.gethostbyname(socket.gethostname())
        if other.startswith("127."):
            return
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, ports["health"]), timeout=2).close()


class TickedLiveness(Liveness):
    """A :class:`Liveness` whose ticks a test can await (:meth:`next_tick`)."""

    _tick = 0.0
    _ticked: anyio.Event | None = None

    @property
    def last_tick(self) -> float:
        return self._tick

    @last_tick.setter
    def last_tick(self, value: float) -> None:
        self._tick = value
        if self._ticked is not None:
            self._ticked.set()

    async def next_tick(self) -> None:
        """Wait for the next tick; its ``lag`` is measured by the time this returns."""
        self._ticked = anyio.Event()
        await self._ticked.wait()


@pytest.mark.asyncio
async def test_a_wedged_loop_does_not_answer_and_recovers() -> None:
    # An interval long enough that the test sees each tick before the next one comes.
    liveness = TickedLiveness(interval=0.25, max_lag=0.5)
    listener = await open_listener(0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(liveness.run)
        tg.start_soon(serve_http, listener, {"/health": liveness.response})
        assert (await aget(port, "/health"))[0] == 200

        outcome: list[BaseException | None] = []
        asked = threading.Event()

        def probe() -> None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
                    asked.set()
                    s.recv(100)
            except BaseException as exc:
                outcome.append(exc)
            else:
                outcome.append(None)

        thread = threading.Thread(target=probe)
        thread.start()
        # The supervisor's loop is wedged from here on (a blocking call in the loop):
        # the kernel accepts the connection, nobody answers.
        assert asked.wait(10)
        wedge = 1.5
        time.sleep(wedge)
        thread.join(10)
        assert isinstance(outcome[0], TimeoutError), outcome
        # The loop has not run since: the wedge's lag is not measured yet, but the tick is
        # overdue by more than max_lag, which alone makes it unhealthy.
        assert liveness.lag <= liveness.max_lag
        assert not liveness.healthy()
        assert liveness.response().status == 503
        # The overdue tick measures the wedge: unhealthy now for the lag itself, though
        # that tick was just taken, and /health says so with the lag.
        await liveness.next_tick()
        assert liveness.lag >= wedge - liveness.interval
        assert not liveness.healthy()
        response = liveness.response()
        assert response.status == 503
        answer = json.loads(response.body)
        assert answer["status"] == "unhealthy"
        assert answer["loop_lag_seconds"] >= wedge - liveness.interval
        # One tick on time and it has passed: healthy again, and the server answers 200.
        await liveness.next_tick()
        assert liveness.lag <= liveness.max_lag
        assert liveness.healthy()
        status, _, body = await aget(port, "/health")
        assert (status, json.loads(body)["status"]) == (200, "ok")
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_misbehaving_clients_do_not_hurt_the_server() -> None:
    async with observed(None, metrics_port=0) as ports:
        port = ports["metrics"]

        def abuse() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"x" * 20000)  # no end of headers, too long
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # connects and says nothing
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"POST /metrics HTTP/1.1\r\n\r\n")
                assert s.recv(100).startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")

        await anyio.to_thread.run_sync(abuse)
        status, _, body = await aget(port, "/metrics")
        assert status == 200
        assert b"aioelastic_workers_running 0.0" in body


def test_health_port_variable_is_parsed_once_with_clear_errors() -> None:
    env = "TORCHELASTIC_HEALTH_CHECK_PORT"
    assert health_port_from_env({}) is None
    assert health_port_from_env({env: ""}) is None
    assert health_port_from_env({env: "8080"}) == 8080
    for bad in ("http", "0", "70000"):
        with pytest.raises(ValueError, match="is not a port") as info:
            health_port_from_env({env: bad})
        assert str(info.value) == (
            f"TORCHELASTIC_HEALTH_CHECK_PORT={bad!r} is not a port; set it to an integer in "
            "1..65535"
        )


def test_metrics_without_prometheus_client_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError) as info:
        Metrics()
    assert str(info.value) == "metrics need prometheus-client: pip install 'aioelastic[metrics]'"


@pytest.mark.asyncio
async def test_agent_serves_its_ports_and_stops_a_stalled_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics_port, health_port = free_port(), free_port()
    monkeypatch.setenv("TORCHELASTIC_HEALTH_CHECK_PORT", str(health_port))
    ready = ReadyFifo(tmp_path)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=hangs.stuck,
        args=(str(ready.path), "event"),
    )
    agent = LocalElasticAgent(
        spec, shutdown_timeout=5, stall_timeout=2.0, metrics_port=metrics_port
    )
    seen: dict[str, object] = {}

    async def scrape() -> None:
        await ready.lines(2, timeout=60)
        seen["health"] = await aget(health_port, "/")
        seen["metrics"] = samples((await aget(metrics_port, "/metrics"))[2].decode())

    async with anyio.create_task_group() as tg:
        tg.start_soon(scrape)
        with anyio.fail_after(60):
            result = await agent.run()
    ready.close()
    assert result.state is WorkerState.FAILED
    assert sorted(result.failures) == [0, 1]
    for failure in result.failures.values():
        assert failure.message.startswith("stalled: no worker wrote output or sent a timer")
        assert "in stuck_in_event_wait" in failure.message
    assert seen["health"][0] == 200  # type: ignore[index]
    assert seen["metrics"][("aioelastic_workers_running", ())] == 2  # type: ignore[index]
    # Both ports are closed with the run.
    for port in (metrics_port, health_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_agent_checks_its_hang_options_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = WorkerSpec(local_world_size=1, entrypoint=hangs.chatty, args=("", 0.0))
    with pytest.raises(ValueError, match=r"stall_timeout: 0 is not > 0 seconds"):
        LocalElasticAgent(spec, stall_timeout=0)
    with pytest.raises(ValueError, match=r"metrics_port: -1 is not a port number 0\.\.65535"):
        LocalElasticAgent(spec, metrics_port=-1)
    monkeypatch.setenv("TORCHELASTIC_HEALTH_CHECK_PORT", "http")
    with pytest.raises(ValueError, match="TORCHELASTIC_HEALTH_CHECK_PORT='http' is not a port"):
        LocalElasticAgent(spec)
