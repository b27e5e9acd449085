"""Free TCP ports on 127.0.0.1, for endpoints the tests write as ``127.0.0.1:<port>``.

``aioelastic.free_port`` (the package's, for ``MASTER_PORT``) binds ``localhost``; the
tests bind 127.0.0.1 itself, the address their endpoints name. A port found here is free
only until someone else takes it: nothing holds it after the call.
"""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (all held until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports
