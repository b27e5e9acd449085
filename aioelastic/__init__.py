"""aioelastic: an asyncio-native process supervisor for training workers.

What ``torch.distributed.elastic`` and ``torchrun`` would be if designed for async code.
Importing this package never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._agent import LocalElasticAgent
    from ._agent_types import (
        RestartBackoff,
        RunResult,
        Worker,
        WorkerGroup,
        WorkerSpec,
        WorkerState,
    )
    from ._elastic_launch import LaunchConfig, elastic_launch, launch_agent
    from ._errors import ChildFailedError, ProcessFailure, record
    from ._events import (
        AgentEvent,
        EventStream,
        FailureReason,
        GroupRestarting,
        GroupStopping,
        RendezvousCompleted,
        RunFailed,
        RunSucceeded,
        StopReason,
        WorkerFailed,
        WorkersStarted,
    )
    from ._launch import MainProcessError, WorkerError, free_port, launch
    from ._output import OutputItem, OutputStream
    from ._pcontext import PContext, run_processes, start_processes
    from ._rdzv_handlers import create_rdzv_handler
    from ._results import RunProcsResult
    from ._signals import SignalReceived
    from ._spawn import (
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
        spawn,
    )
    from ._std import Std, to_map
    from ._subreaper import enable_subreaper, subreaper_enabled

# Public name -> the private module that defines it. Attributes are imported on first
# use: a spawned worker imports aioelastic._bootstrap, and must not pay for the agent,
# the CLI and anyio (over 100 ms of CPU per worker) to run one function.
_EXPORTS = {
    "LocalElasticAgent": "._agent",
    "RestartBackoff": "._agent_types",
    "RunResult": "._agent_types",
    "Worker": "._agent_types",
    "WorkerGroup": "._agent_types",
    "WorkerSpec": "._agent_types",
    "WorkerState": "._agent_types",
    "LaunchConfig": "._elastic_launch",
    "elastic_launch": "._elastic_launch",
    "launch_agent": "._elastic_launch",
    "ChildFailedError": "._errors",
    "ProcessFailure": "._errors",
    "record": "._errors",
    "AgentEvent": "._events",
    "EventStream": "._events",
    "FailureReason": "._events",
    "GroupRestarting": "._events",
    "GroupStopping": "._events",
    "RendezvousCompleted": "._events",
    "RunFailed": "._events",
    "RunSucceeded": "._events",
    "StopReason": "._events",
    "WorkerFailed": "._events",
    "WorkersStarted": "._events",
    "MainProcessError": "._launch",
    "WorkerError": "._launch",
    "free_port": "._launch",
    "launch": "._launch",
    "OutputItem": "._output",
    "OutputStream": "._output",
    "PContext": "._pcontext",
    "run_processes": "._pcontext",
    "start_processes": "._pcontext",
    "create_rdzv_handler": "._rdzv_handlers",
    "RunProcsResult": "._results",
    "SignalReceived": "._signals",
    "ProcessException": "._spawn",
    "ProcessExitedException": "._spawn",
    "ProcessRaisedException": "._spawn",
    "spawn": "._spawn",
    "Std": "._std",
    "to_map": "._std",
    "enable_subreaper": "._subreaper",
    "subreaper_enabled": "._subreaper",
}

__all__ = [
    # Running a group of workers
    "PContext",
    "run_processes",
    "start_processes",
    # Results and errors
    "ChildFailedError",
    "ProcessFailure",
    "RunProcsResult",
    "record",
    # torch.multiprocessing.spawn and launch-helper compatibility
    "MainProcessError",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "WorkerError",
    "free_port",
    "launch",
    "spawn",
    # The elastic agent
    "LaunchConfig",
    "LocalElasticAgent",
    "RestartBackoff",
    "RunResult",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "create_rdzv_handler",
    "elastic_launch",
    "launch_agent",
    "SignalReceived",
    # Lifecycle events of the agent
    "AgentEvent",
    "EventStream",
    "FailureReason",
    "GroupRestarting",
    "GroupStopping",
    "RendezvousCompleted",
    "RunFailed",
    "RunSucceeded",
    "StopReason",
    "WorkerFailed",
    "WorkersStarted",
    # Logs and output
    "OutputItem",
    "OutputStream",
    "Std",
    "to_map",
    # Process ownership
    "enable_subreaper",
    "subreaper_enabled",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aioelastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
