"""A minimal HTTP/1.1 GET server on anyio sockets, for liveness and metrics.

Served by the supervisor's own event loop on purpose: an answer proves the loop turns, so
a wedged supervisor fails its probes instead of being vouched for by a helper thread.
Each connection gets one request and one response (``Connection: close``); a client that
sends nothing, or more than :data:`MAX_REQUEST` bytes of headers, is dropped after
:data:`REQUEST_TIMEOUT` seconds or at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
import anyio.abc

logger = logging.getLogger("aioelastic")

MAX_REQUEST = 8192
REQUEST_TIMEOUT = 5.0


@dataclass(frozen=True)
class Response:
    """What a route answers."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}

Route = Callable[[], Response]


async def serve_http(listener: anyio.abc.SocketListener, routes: Mapping[str, Route]) -> None:
    """Answer GET requests on ``listener`` from ``routes`` (path -> handler) until cancelled.

    Takes ownership of ``listener``: it is closed when this returns.
    """

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(REQUEST_TIMEOUT):
                    head = await _read_head(stream)
                    if head is None:
                        return
                    response = _dispatch(head, routes)
                    await stream.send(_encode(response, head.startswith(b"HEAD ")))
            except (TimeoutError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
                return  # the client went away or never spoke: nothing to answer

    async with listener:  # closed however serving ends (cancellation included)
        await listener.serve(handle)


async def _read_head(stream: anyio.abc.SocketStream) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_REQUEST:
            return None
        try:
            data += await stream.receive(4096)
        except anyio.EndOfStream:
            return data or None
    return data


def _dispatch(head: bytes, routes: Mapping[str, Route]) -> Response:
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) < 2:
        return Response(404, b"bad request\n")
    method, target = parts[0], parts[1].decode("latin-1").split("?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        return Response(405, b"only GET\n")
    route = routes.get(target)
    if route is None:
        return Response(404, f"no such path; try {', '.join(sorted(routes))}\n".encode())
    try:
        return route()
    except Exception:
        logger.exception("aioelastic: the HTTP route %s failed", target)
        return Response(503, b"error\n")


def _encode(response: Response, head_only: bool) -> bytes:
    reason = _REASONS.get(response.status, "")
    headers = (
        f"HTTP/1.1 {response.status} {reason}\r\n"
        f"Content-Type: {response.content_type}\r\n"
        f"Content-Length: {len(response.body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return headers if head_only else headers + response.body
