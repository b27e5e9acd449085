"""Why one node ended the job's attempt (`AttemptEnd`), as every node is told, and its makers.

An end is written to the round's store as JSON by the node that ends the attempt (or, for a
node that vanished, by the node that watched it) and read by every other node, which may
run another version of aioelastic: the field names and the `EndReason` values are the wire
format, and a reader ignores fields it does not know.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from ..._core.child._error_file import NOT_AVAILABLE
from ..._core.process._exit_status import exit_description
from ..._core.reports._failures import ProcessFailure
from ..observe._events import EndReason
from ._store_site import StoreSite

__all__ = [
    "AttemptEnd",
    "end_of_failure",
    "end_of_frozen_node",
    "end_of_lost_store",
    "end_of_vanished",
]

# Quoted in full by every node's report: a whole traceback is in the node's own log.
_MESSAGE_LIMIT = 4096


@dataclass(frozen=True)
class AttemptEnd:
    """Why one node ended the job's attempt, as every node is told.

    Attributes:
        node: the group rank of the node the end is about.
        host: that node's address as its peers know it.
        reason: why (`EndReason`).
        detail: what happened, one line (``"rank 5 exited 7 (ValueError: bad lr)"``).
        final: the job ends: no node joins another round (an exit code that is never
            retried, restarts used up, the store lost).
        counts: the end uses one of the job's restarts.
        rank: the global rank of the worker that failed, if one did.
        local_rank: its local rank on that node (-1 when none failed).
        pid: its process id.
        exitcode: its exit status (negative: killed by that signal).
        timestamp: when it happened, seconds since the epoch.
        message: the failed worker's report (its error or last stderr lines), bounded.
    """

    node: int
    host: str
    reason: EndReason
    detail: str
    final: bool = False
    counts: bool = True
    rank: int | None = None
    local_rank: int = -1
    pid: int = -1
    exitcode: int = 1
    timestamp: float = 0.0
    message: str = ""

    def describe(self) -> str:
        """``"node 2 (host h) failed: rank 5 exited 7 ..."``, for reports and logs."""
        return f"node {self.node} ({self.host}) {self.reason.verb} {self.detail}".rstrip()

    def as_failure(self) -> ProcessFailure:
        """This end as a failure for a report on another node (``"stopped: node 2 ..."``)."""
        return ProcessFailure(
            local_rank=self.local_rank,
            pid=self.pid,
            exitcode=self.exitcode,
            error_file=NOT_AVAILABLE,
            message="\n".join(filter(None, [f"stopped: {self.describe()}", self.message])),
            timestamp=self.timestamp or time.time(),
            host=self.host,
        )

    def to_json(self) -> str:
        """The form stored for the other nodes (``reason`` as its value)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> AttemptEnd:
        """Read what another node stored (unknown keys of a newer version are ignored).

        A reason this version does not know (a newer node's) reads as `EndReason.ERROR`:
        the node still ended the attempt, and ``detail`` still says why.
        """
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "reason" in known:
            try:
                known["reason"] = EndReason(known["reason"])
            except ValueError:
                known["reason"] = EndReason.ERROR
        return cls(**known)


def end_of_failure(
    node: int, host: str, rank: int, local_rank: int, failure: ProcessFailure, *, final: bool
) -> AttemptEnd:
    """The `AttemptEnd` of this node's worker ``rank`` (``local_rank``) failing."""
    signal_name = failure.signal_name() if failure.exitcode < 0 else None
    status = f"was killed by {signal_name}" if signal_name else f"exited {failure.exitcode}"
    message = (failure.message or "").strip()
    if len(message) > _MESSAGE_LIMIT:
        message = "..." + message[-_MESSAGE_LIMIT:]
    # The last line says most (a traceback's exception); a bare exit description only
    # repeats the status.
    last = message.rsplit("\n", 1)[-1].strip()
    summary = "" if last == exit_description(failure.exitcode) else f" ({last})"
    return AttemptEnd(
        node=node,
        host=host,
        reason=EndReason.WORKER_FAILED,
        detail=f"rank {rank} {status}{summary}",
        message=message if summary else "",
        final=final,
        rank=rank,
        local_rank=local_rank,
        pid=failure.pid,
        exitcode=failure.exitcode,
        timestamp=failure.timestamp,
    )


def end_of_vanished(
    node: int, host: str, *, dead_after: float, seen_by: int, seen_by_host: str
) -> AttemptEnd:
    """The `AttemptEnd` of node ``node`` (at ``host``) that stopped beating."""
    return AttemptEnd(
        node=node,
        host=host,
        reason=EndReason.VANISHED,
        detail=(
            f"no heartbeat for {dead_after:g} s (its launcher was killed or "
            "its machine lost); seen by node "
            f"{seen_by} ({seen_by_host})"
        ),
        exitcode=-9,
        timestamp=time.time(),
    )


def end_of_lost_store(node: int, host: str, why: str, lasted: float, site: StoreSite) -> AttemptEnd:
    """The `AttemptEnd` of ``site``'s store that gave ``why`` (``"no answer"``, an error's
    type) for ``lasted`` seconds, as node ``node`` (at ``host``) found it."""
    return _store_lost(node, host, f"{site.name()} gave {why} for {lasted:.1f} s; {site.remedy()}")


def end_of_frozen_node(
    node: int, host: str, *, frozen_for: float, silent: int, silent_host: str, lost_after: float,
    site: StoreSite,
) -> AttemptEnd:  # fmt: skip
    """The `AttemptEnd` of node ``node`` that stood still ``frozen_for`` seconds, after which
    node ``silent`` stopped beating with no end written: the others lost the store.

    Only a store that stopped answering them keeps the other nodes from writing why they
    left (a node still for that long is otherwise ended as vanished by its watcher): the
    store lives in this node's launcher, which stood still with it.
    """
    return _store_lost(
        node,
        host,
        f"this node stood still for {frozen_for:.1f} s (its launcher was stopped or its "
        f"machine froze), and node {silent} ({silent_host}) stopped beating since with no "
        f"end written: the other nodes found {site.name()} silent for {lost_after:g} s "
        f"and left the job; {site.remedy()}",
    )


def _store_lost(node: int, host: str, detail: str) -> AttemptEnd:
    return AttemptEnd(
        node=node,
        host=host,
        reason=EndReason.STORE_LOST,
        detail=detail,
        final=True,
        exitcode=1,
        timestamp=time.time(),
    )
