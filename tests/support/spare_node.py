"""A rendezvous handler that answers as torch's c10d handler does for a spare node.

Needs torch: import it only from tests that skip themselves without it.
"""

from __future__ import annotations

from torch.distributed.elastic import rendezvous as torch_rendezvous


class SpareNodeHandler(torch_rendezvous.RendezvousHandler):  # type: ignore[misc]
    """Raises ``RendezvousGracefulExitError``, as torch's c10d handler does for a spare node.

    A spare node is one beyond ``max_nodes``; torch tells it to leave once the job closes
    the rendezvous.

    The real sequence needs torch's private redundancy list to be observed before closing,
    which no public call exposes; the translation under test is the same either way.
    """

    def get_backend(self) -> str:
        return "c10d"

    def next_rendezvous(self) -> None:
        raise torch_rendezvous.RendezvousGracefulExitError("the rendezvous is closed")

    def is_closed(self) -> bool:
        return True

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "spare"

    def shutdown(self) -> bool:
        return True
