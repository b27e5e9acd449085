"""Function workers whose module imports torch, as a training script's does.

Each function has this module as its ``__module__``, so a spawned worker unpickling it
imports this module and with it torch (about 1.6 s of CPU on this machine): that import
is what a fork server with torch preloaded saves. The bodies are those of
:mod:`benchmarks.programs._fn_light`.
"""

from __future__ import annotations

import torch

from benchmarks.programs import _fn_light

#: Touch the import so that no tool mistakes it for an unused one: it is the workload.
TORCH_VERSION = torch.__version__


def stamp(rank: int, directory: str) -> None:
    """See :func:`benchmarks.programs._fn_light.stamp`."""
    _fn_light.stamp(rank, directory)


def fail_or_sleep(rank: int, directory: str, n: int, ignore_term: bool, delay: float) -> None:
    """See :func:`benchmarks.programs._fn_light.fail_or_sleep`."""
    _fn_light.fail_or_sleep(rank, directory, n, ignore_term, delay)


def restart(directory: str) -> None:
    """See :func:`benchmarks.programs._fn_light.restart`."""
    _fn_light.restart(directory)
