"""aioelastic: an asyncio-native process supervisor for training workers.

What ``torch.distributed.elastic`` and ``torchrun`` would be if designed for async code.
Importing this package never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._compat import _old_paths

if TYPE_CHECKING:
    from ._compat._launch import MainProcessError, WorkerError, free_port, launch
    from ._compat._spawn import (
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
        spawn,
    )
    from ._core._failures import ChildFailedError, ProcessFailure
    from ._core._output import OutputItem, OutputStream
    from ._core._pcontext import PContext, run_processes, start_processes
    from ._core._record import record
    from ._core._results import RunProcsResult
    from ._core._signals import SignalReceived
    from ._core._std import Std, to_map
    from ._core._subreaper import enable_subreaper, subreaper_enabled
    from ._elastic._agent import LocalElasticAgent
    from ._elastic._agent_types import (
        RestartBackoff,
        RunResult,
        Worker,
        WorkerGroup,
        WorkerSpec,
        WorkerState,
    )
    from ._elastic._elastic_launch import LaunchConfig, elastic_launch, launch_agent
    from ._elastic._events import (
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
    from ._elastic._rdzv_handlers import create_rdzv_handler

# Public name -> the private module that defines it. Attributes are imported on first
# use: a spawned worker imports aioelastic._core._bootstrap, and must not pay for the agent,
# the CLI and anyio (over 100 ms of CPU per worker) to run one function.
_EXPORTS = {
    "LocalElasticAgent": "._elastic._agent",
    "RestartBackoff": "._elastic._agent_types",
    "RunResult": "._elastic._agent_types",
    "Worker": "._elastic._agent_types",
    "WorkerGroup": "._elastic._agent_types",
    "WorkerSpec": "._elastic._agent_types",
    "WorkerState": "._elastic._agent_types",
    "LaunchConfig": "._elastic._elastic_launch",
    "elastic_launch": "._elastic._elastic_launch",
    "launch_agent": "._elastic._elastic_launch",
    "ChildFailedError": "._core._failures",
    "ProcessFailure": "._core._failures",
    "record": "._core._record",
    "AgentEvent": "._elastic._events",
    "EventStream": "._elastic._events",
    "FailureReason": "._elastic._events",
    "GroupRestarting": "._elastic._events",
    "GroupStopping": "._elastic._events",
    "RendezvousCompleted": "._elastic._events",
    "RunFailed": "._elastic._events",
    "RunSucceeded": "._elastic._events",
    "StopReason": "._elastic._events",
    "WorkerFailed": "._elastic._events",
    "WorkersStarted": "._elastic._events",
    "MainProcessError": "._compat._launch",
    "WorkerError": "._compat._launch",
    "free_port": "._compat._launch",
    "launch": "._compat._launch",
    "OutputItem": "._core._output",
    "OutputStream": "._core._output",
    "PContext": "._core._pcontext",
    "run_processes": "._core._pcontext",
    "start_processes": "._core._pcontext",
    "create_rdzv_handler": "._elastic._rdzv_handlers",
    "RunProcsResult": "._core._results",
    "SignalReceived": "._core._signals",
    "ProcessException": "._compat._spawn",
    "ProcessExitedException": "._compat._spawn",
    "ProcessRaisedException": "._compat._spawn",
    "spawn": "._compat._spawn",
    "Std": "._core._std",
    "to_map": "._core._std",
    "enable_subreaper": "._core._subreaper",
    "subreaper_enabled": "._core._subreaper",
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
