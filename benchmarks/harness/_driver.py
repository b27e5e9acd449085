"""A driver process: runs one system's repetitions on command from the harness.

Started as ``python -m benchmarks.harness._driver``. It reads one JSON command per line on stdin
(``{"op": "rep", "impl": "MODULE:FUNCTION", "n": ..., "params": ..., "workdir": ...,
"quick": ...}`` or ``{"op": "exit"}``) and answers each repetition with one JSON line on the
file descriptor named by ``BENCH_REPLY_FD``; its own stdout and stderr are free for what
the system under test prints (tee'd worker output, torch's warnings). Coroutine functions
run on one event loop kept for the driver's whole life, as in a long-lived async
application.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness._spec import NotAvailable, RepContext, RepTimeout

REPLY_FD_ENV = "BENCH_REPLY_FD"


def resolve(impl: str) -> Callable[[RepContext], Any]:
    """The function named ``module:function``."""
    module_name, _, attr = impl.partition(":")
    function: Callable[[RepContext], Any] = getattr(importlib.import_module(module_name), attr)
    return function


class _Runner:
    """Runs sync implementations directly and async ones on one persistent loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, function: Callable[[RepContext], Any], ctx: RepContext) -> Any:
        if not inspect.iscoroutinefunction(function):
            return function(ctx)
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
        return self._loop.run_until_complete(function(ctx))

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()


def _answer(
    function: Callable[[RepContext], Any], runner: _Runner, command: dict[str, Any]
) -> dict[str, Any]:
    workdir = Path(command["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = RepContext(
        n=int(command["n"]),
        params=command["params"],
        workdir=workdir,
        quick=bool(command["quick"]),
    )
    try:
        metrics = runner.run(function, ctx)
    except NotAvailable as exc:
        return {"status": "n/a", "reason": str(exc)}
    except RepTimeout as exc:
        return {"status": "timeout", "limit": exc.limit}
    except Exception:
        return {"status": "error", "error": traceback.format_exc()}
    return {"status": "ok", "metrics": {k: float(v) for k, v in metrics.items()}}


def main() -> int:
    """Serve repetitions until told to exit."""
    reply = os.fdopen(int(os.environ[REPLY_FD_ENV]), "w", buffering=1)
    runner = _Runner()
    functions: dict[str, Callable[[RepContext], Any] | str] = {}
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "exit":
                break
            impl = command["impl"]
            if impl not in functions:
                try:
                    functions[impl] = resolve(impl)
                except ImportError as exc:
                    functions[impl] = f"{type(exc).__name__}: {exc}"
            function = functions[impl]
            if isinstance(function, str):
                answer: dict[str, Any] = {"status": "n/a", "reason": function}
            else:
                answer = _answer(function, runner, command)
            # Flush the system's console output first so that a reader of the driver's
            # log sees it before the harness moves on.
            sys.stdout.flush()
            sys.stderr.flush()
            reply.write(json.dumps(answer) + "\n")
    finally:
        runner.close()
        reply.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
