"""aioelastic: an asyncio-native process supervisor for training workers.

What ``torch.distributed.elastic`` and ``torchrun`` would be if designed for async code.
Importing this package never imports torch.
"""

from ._agent import (
    LocalElasticAgent,
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
from ._pcontext import PContext, run_processes, start_processes
from ._rendezvous import create_rdzv_handler
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
    # Logs
    "Std",
    "to_map",
    # Process ownership
    "enable_subreaper",
    "subreaper_enabled",
]
