"""A Kubernetes pod's ``MASTER_ADDR`` and ``MASTER_PORT``, for a PyTorchJob without flags.

Kubeflow's training operator (PyTorchJob, v1) gives every pod of a job that is not elastic
``PET_NNODES``, ``PET_NODE_RANK`` and ``PET_NPROC_PER_NODE`` (torchrun's flag variables,
read as every ``PET_*`` is) but names node 0's pod only as ``MASTER_ADDR``/``MASTER_PORT``,
which torchrun never reads: the static rendezvous would look for node 0 on 127.0.0.1. In a
pod (``KUBERNETES_SERVICE_HOST`` is set in every one) a static job of several nodes takes
them for ``--master-addr``/``--master-port`` when neither the flags nor ``PET_MASTER_ADDR``/
``PET_MASTER_PORT`` (what Kubeflow Trainer's TrainJob sets) say. An elastic PyTorchJob and
a TrainJob give ``PET_*`` variables only: nothing more is needed for them. Outside a pod
``MASTER_ADDR`` is left alone: it may be an enclosing job's, inherited by a worker.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from ..._core.process import _values as values
from ..._elastic.settings import _node_values as node_values

__all__ = ["master_of_pod"]

_FROM: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("master_addr", "MASTER_ADDR", node_values.host),
    ("master_port", "MASTER_PORT", values.port),
)


def master_of_pod(
    args: argparse.Namespace, environ: Mapping[str, str], said: set[str]
) -> dict[str, Any]:
    """``--master-addr``/``--master-port`` from a pod's variables, as far as they are unsaid.

    Raises:
        ValueError: a variable that would be used is malformed (the message names it).
    """
    if "KUBERNETES_SERVICE_HOST" not in environ or args.standalone:
        return {}
    if args.rdzv_backend != "static" or args.rdzv_endpoint or args.nnodes[1] < 2:
        return {}
    found: dict[str, Any] = {}
    for dest, name, parse in _FROM:
        if dest in said or name not in environ:
            continue
        try:
            found[dest] = parse(environ[name])
        except (ValueError, TypeError) as e:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{name}={environ[name]!r} (for {flag}): {e}") from None
    return found
