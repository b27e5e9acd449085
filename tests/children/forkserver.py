"""Workers and a child supervisor for tests/core/start/test_forkserver_lifecycle.py.

Run as ``python -m tests.children.forkserver inherited-signals``: a supervisor that
starts fork-server workers with whatever signal state it inherited, and prints one JSON
line with what its workers saw and how they exited.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _disposition(sig: signal.Signals) -> str:
    handler = signal.getsignal(sig)
    if handler is signal.SIG_IGN:
        return "ignored"
    if handler is signal.SIG_DFL:
        return "default"
    if handler is signal.default_int_handler:
        return "python"
    return "handler"


def signal_state() -> dict[str, object]:
    """The signal dispositions and mask this worker started with."""
    return {
        "SIGCHLD": _disposition(signal.SIGCHLD),
        "SIGHUP": _disposition(signal.SIGHUP),
        "SIGTERM": _disposition(signal.SIGTERM),
        "SIGUSR1": _disposition(signal.SIGUSR1),
        "SIGINT": _disposition(signal.SIGINT),
        "blocked": sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, set())),
    }


def kill_server_then_block() -> int:
    """On the first attempt, local rank 1 SIGKILLs its parent (the fork server) and waits
    for its own parent-death signal; on later attempts every rank returns its rank."""
    rank = int(os.environ["LOCAL_RANK"])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and rank == 1:
        os.kill(os.getppid(), signal.SIGKILL)
        signal.pause()
    return rank


def _inherited_signals() -> None:
    import anyio

    import aioelastic
    from tests.children import core

    async def run() -> dict[str, object]:
        state = await aioelastic.run_processes(
            "sig", signal_state, {0: ()}, {0: {}}, start_method="forkserver"
        )
        codes = await aioelastic.run_processes(
            "codes",
            core.exit_with,
            {0: (0,), 1: (3,), 2: (0,)},
            {0: {}, 1: {}, 2: {}},
            start_method="forkserver",
        )
        return {
            "worker": state.return_values[0],
            "failures": {rank: f.exitcode for rank, f in codes.failures.items()},
            "supervisor_sigchld": _disposition(signal.SIGCHLD),
        }

    print(json.dumps(anyio.run(run)), flush=True)


if __name__ == "__main__":
    {"inherited-signals": _inherited_signals}[sys.argv[1]]()
