"""aioelastic: an asyncio-native process supervisor for training workers.

What ``torch.distributed.elastic`` and ``torchrun`` would be if designed for async code.
Importing this package never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._compat import _old_paths

if TYPE_CHECKING:
    # For type checkers only (the names are imported lazily, see _EXPORTS): each one
    # re-exported as itself. tests/package/test_public_surface.py checks they match _EXPORTS.
    from ._compat._launch import (
        MainProcessError as MainProcessError,
        WorkerError as WorkerError,
        free_port as free_port,
        launch as launch,
    )
    from ._compat._spawn import (
        ProcessException as ProcessException,
        ProcessExitedException as ProcessExitedException,
        ProcessRaisedException as ProcessRaisedException,
        spawn as spawn,
    )
    from ._core.aio._signals import SignalReceived as SignalReceived
    from ._core.group._options import GroupOptions as GroupOptions
    from ._core.group._pcontext import PContext as PContext
    from ._core.group._processes import (
        run_processes as run_processes,
        start_processes as start_processes,
    )
    from ._core.output._std import Std as Std, to_map as to_map
    from ._core.output._stream import OutputItem as OutputItem, OutputStream as OutputStream
    from ._core.process._subreaper import (
        enable_subreaper as enable_subreaper,
        subreaper_enabled as subreaper_enabled,
    )
    from ._core.reports._failures import (
        ChildFailedError as ChildFailedError,
        ProcessFailure as ProcessFailure,
    )
    from ._core.reports._record import record as record
    from ._core.reports._results import RunProcsResult as RunProcsResult
    from ._core.start._forkserver import ForkServerError as ForkServerError
    from ._elastic.agent._agent import LocalElasticAgent as LocalElasticAgent
    from ._elastic.agent._types import (
        RestartBackoff as RestartBackoff,
        RunResult as RunResult,
        Worker as Worker,
        WorkerGroup as WorkerGroup,
        WorkerSpec as WorkerSpec,
        WorkerState as WorkerState,
    )
    from ._elastic.launch._elastic_launch import (
        LaunchConfig as LaunchConfig,
        elastic_launch as elastic_launch,
        launch_agent as launch_agent,
    )
    from ._elastic.observe._events import (
        AgentEvent as AgentEvent,
        EventStream as EventStream,
        FailureReason as FailureReason,
        GroupRestarting as GroupRestarting,
        GroupStopping as GroupStopping,
        RendezvousCompleted as RendezvousCompleted,
        RunFailed as RunFailed,
        RunSucceeded as RunSucceeded,
        StopReason as StopReason,
        WorkerFailed as WorkerFailed,
        WorkersStarted as WorkersStarted,
    )
    from ._elastic.rendezvous._handlers import create_rdzv_handler as create_rdzv_handler
    from ._elastic.rendezvous._reform import NodeLostError as NodeLostError

# The public surface, the one list of it: public name -> the private module that defines
# it, grouped as the docs present it. ``__all__`` is derived from it, and attributes are
# imported on first use: a spawned worker imports aioelastic._core.child._bootstrap, and must
# not pay for the agent, the CLI and anyio (over 100 ms of CPU per worker) to run one
# function.
_EXPORTS = {
    # Running a group of workers
    "PContext": "._core.group._pcontext",
    "GroupOptions": "._core.group._options",
    "run_processes": "._core.group._processes",
    "start_processes": "._core.group._processes",
    # Results and errors
    "ChildFailedError": "._core.reports._failures",
    "ProcessFailure": "._core.reports._failures",
    "RunProcsResult": "._core.reports._results",
    "record": "._core.reports._record",
    "ForkServerError": "._core.start._forkserver",
    # torch.multiprocessing.spawn and launch-helper compatibility
    "MainProcessError": "._compat._launch",
    "ProcessException": "._compat._spawn",
    "ProcessExitedException": "._compat._spawn",
    "ProcessRaisedException": "._compat._spawn",
    "WorkerError": "._compat._launch",
    "free_port": "._compat._launch",
    "launch": "._compat._launch",
    "spawn": "._compat._spawn",
    # The elastic agent
    "LaunchConfig": "._elastic.launch._elastic_launch",
    "LocalElasticAgent": "._elastic.agent._agent",
    "RestartBackoff": "._elastic.agent._types",
    "RunResult": "._elastic.agent._types",
    "Worker": "._elastic.agent._types",
    "WorkerGroup": "._elastic.agent._types",
    "WorkerSpec": "._elastic.agent._types",
    "WorkerState": "._elastic.agent._types",
    "create_rdzv_handler": "._elastic.rendezvous._handlers",
    "NodeLostError": "._elastic.rendezvous._reform",
    "elastic_launch": "._elastic.launch._elastic_launch",
    "launch_agent": "._elastic.launch._elastic_launch",
    "SignalReceived": "._core.aio._signals",
    # Lifecycle events of the agent
    "AgentEvent": "._elastic.observe._events",
    "EventStream": "._elastic.observe._events",
    "FailureReason": "._elastic.observe._events",
    "GroupRestarting": "._elastic.observe._events",
    "GroupStopping": "._elastic.observe._events",
    "RendezvousCompleted": "._elastic.observe._events",
    "RunFailed": "._elastic.observe._events",
    "RunSucceeded": "._elastic.observe._events",
    "StopReason": "._elastic.observe._events",
    "WorkerFailed": "._elastic.observe._events",
    "WorkersStarted": "._elastic.observe._events",
    # Logs and output
    "OutputItem": "._core.output._stream",
    "OutputStream": "._core.output._stream",
    "Std": "._core.output._std",
    "to_map": "._core.output._std",
    # Process ownership
    "enable_subreaper": "._core.process._subreaper",
    "subreaper_enabled": "._core.process._subreaper",
}

__all__ = list(_EXPORTS)


# Pickles made by an earlier version name the error types by their old module paths.
_old_paths.install()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aioelastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
