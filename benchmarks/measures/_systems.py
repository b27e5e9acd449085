"""The systems under comparison that several measures share, declared once.

Each is declared here with its label (what the table and the recorded JSON call it), its
kind and its parameters; a measure gives only the module whose functions run each side on
its own workload. The label is also the driver process's name (``System.driver``): every
measure that uses one of these systems runs it in the same process, so it must be the
same system there, with the same parameters, and is declared nowhere else.

- The binary pair: aioelastic and torch.distributed.elastic's ``start_processes``
  supervising binaries (by default the functions ``aio_bin`` and ``torch_elastic_bin``).
- The fork-server trio: aioelastic's fork server against torch.distributed.elastic's and
  torch.multiprocessing's ``forkserver`` start method, whose stdlib fork server preloads
  torch (see :func:`~benchmarks.measures._common.preload_torch_if_asked`); the functions
  ``aio_fn``, ``torch_elastic_fn`` and ``torch_mp_fn``.

Systems that one measure runs in driver processes of its own are declared in that measure
(the startup measure's, with its own ``aioelastic/forkserver``, the agent's, the
launchers', the binary and scale measures' torch-loaded ones).
"""

from __future__ import annotations

from benchmarks.harness._spec import Row, System
from benchmarks.measures._common import TORCH_PRELOAD

OURS_BINARY = "aioelastic/binary"
TORCH_BINARY = "torch.elastic/binary"
OURS_FORKSERVER = "aioelastic/forkserver"
TORCH_FORKSERVER = "torch.elastic/forkserver"
TORCH_MP_FORKSERVER = "torch.mp/forkserver"


def binary_pair(
    module: str, ours: str = "aio_bin", theirs: str = "torch_elastic_bin"
) -> tuple[System, System]:
    """The binary pair, running ``module:ours`` and ``module:theirs``."""
    return (
        System(OURS_BINARY, "aioelastic", f"{module}:{ours}"),
        System(TORCH_BINARY, "torch", f"{module}:{theirs}"),
    )


def binary_row(case: str, headline_n: int | None = None) -> Row:
    """The binary pair's row."""
    return Row(case, OURS_BINARY, TORCH_BINARY, headline_n=headline_n)


def forkserver_trio(module: str) -> tuple[System, System, System]:
    """The fork-server trio, running ``module``'s three functions named above."""
    return (
        System(OURS_FORKSERVER, "aioelastic", f"{module}:aio_fn"),
        System(TORCH_FORKSERVER, "torch", f"{module}:torch_elastic_fn", TORCH_PRELOAD),
        System(TORCH_MP_FORKSERVER, "torch", f"{module}:torch_mp_fn", TORCH_PRELOAD),
    )


def forkserver_rows(case: str, headline_n: int | None = None) -> tuple[Row, Row]:
    """The trio's rows: ours against torch.elastic (the headline, if any), against torch.mp."""
    return (
        Row(case, OURS_FORKSERVER, TORCH_FORKSERVER, headline_n=headline_n),
        Row(case, OURS_FORKSERVER, TORCH_MP_FORKSERVER),
    )
