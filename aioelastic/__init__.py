"""aioelastic: an asyncio-native process supervisor for training workers.

What ``torch.distributed.elastic`` and ``torchrun`` would be if designed for async code.
Importing this package never imports torch.
"""

from ._errors import ChildFailedError, ProcessFailure, record
from ._launch import MainProcessError, WorkerError, free_port, launch
from ._pcontext import PContext, run_processes, start_processes
from ._results import RunProcsResult
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
    # Logs
    "Std",
    "to_map",
    # Process ownership
    "enable_subreaper",
    "subreaper_enabled",
]
