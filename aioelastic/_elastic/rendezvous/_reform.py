"""After a node was lost: the next round forgets it at once and closes when every survivor is in.

torch's dynamic rendezvous (``c10d``, ``etcd-v2``) learns that a node is gone only when the node's
keep-alive expires (``keep_alive_interval`` x ``keep_alive_max_attempt``, 15 s by default):
until then the round it took part in stays complete, and the survivors wait on its wait
list. The new round then waits out its last call (``last_call_timeout``, 30 s), which is
there so that newcomers can join a round being formed, not for nodes the job already knows.
So a lost node costs the survivors about 45 s with torch's defaults.

The agents already know better (`JobChannel` saw the node vanish), so before a survivor joins
the next round it:

1. marks the lost node's last heartbeat as long past in the shared rendezvous state, so that
   torch's own sanitizer removes it at the next sync of any node, exactly as an expired
   keep-alive would;
2. while its join runs, watches the state through a copy of torch's state holder (its own
   compare-and-set token, torch's protocol untouched) and, once every surviving member of the
   previous round is a participant again, moves the round's last-call deadline to now: the
   join loops, torch's own, then close it. A newcomer that joins first is simply one more
   participant; one that comes later waits for the next round, as with torch.

Both steps use torch's private state holder; where it is not there (``etcd``, a custom
handler, another torch version) they do nothing and torch's timeouts apply.
"""

from __future__ import annotations

import copy
import datetime
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["NodeLostError", "end_if_short", "forget_node", "members", "survivors_closing_round"]

logger = logging.getLogger("aioelastic.rendezvous")

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
# How often the copy of the state is read while survivors rejoin (torch's join loops sync
# once a second; a few seconds at most, and only after a node was lost).
_POLL = 0.2


def _holder(handler: Any) -> Any | None:
    holder = getattr(handler, "_state_holder", None)
    if holder is None or not callable(getattr(holder, "sync", None)):
        return None
    return holder


def members(handler: Any) -> tuple[int, dict[Any, int]] | None:
    """The round just completed and its participants with their ranks (``None``: unknown)."""
    holder = _holder(handler)
    if holder is None:
        return None
    try:
        return int(holder.state.round), dict(holder.state.participants)
    except Exception:
        return None


class NodeLostError(RuntimeError):
    """A node was lost, nothing replaces it, and fewer than the job's fewest nodes remain."""


def end_if_short(handler: Any, members: dict[Any, int], gone: set[Any]) -> None:
    """Refuse the next round when ``gone`` leaves fewer than ``min_nodes`` and none can come.

    Called only where lost nodes are not replaced (``replace_lost_nodes=False``: a SLURM
    step, whose nodes never come back): waiting for a replacement would only wait out
    the rendezvous' join timeout while the scheduler could requeue the job.

    Raises:
        NodeLostError: naming each lost node by its group rank and address.
    """
    settings = getattr(handler, "_settings", None)
    min_nodes = getattr(settings, "min_nodes", None)
    remaining = len(members) - len(gone)
    if not gone or not isinstance(min_nodes, int) or remaining >= min_nodes:
        return
    lost = ", ".join(
        f"node {members[node]} ({getattr(node, 'addr', node)})"
        for node in sorted(gone, key=members.__getitem__)
    )
    raise NodeLostError(
        f"{lost} {'was' if len(gone) == 1 else 'were'} lost and no node replaces a lost one "
        f"here (replace_lost_nodes is off, as in a SLURM step, whose nodes never come "
        f"back): {remaining} of the {min_nodes} nodes the job needs remain, so the job "
        "ends now, for the scheduler to requeue it"
    )


def forget_node(handler: Any, node: Any) -> None:
    """Mark ``node``'s last heartbeat long past: every node's next sync removes it."""
    holder = _holder(handler)
    lock = getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return
    try:
        with lock:  # torch's keep-alive timer uses the same holder
            for _ in range(10):  # another node's write in between: read again, retry
                holder.sync()
                state = holder.state
                if node not in state.last_heartbeats:
                    return
                state.last_heartbeats[node] = _EPOCH
                holder.mark_dirty()
                if holder.sync():
                    logger.info("rendezvous: forgot lost node %s", node)
                    return
    except Exception as e:
        logger.debug("could not forget lost node %s: %s", node, e)


@contextmanager
def survivors_closing_round(handler: Any, survivors: set[Any], after_round: int) -> Iterator[None]:
    """While the body joins the next round: close it once every survivor is in.

    A member of the previous round that never comes back — its keep-alive in torch's state
    older than one keep-alive interval and a second while the others rejoin — is taken
    for lost too and forgotten (a node SIGKILLed while this one's own workers failed first:
    gloo ranks notice a dead peer before the job channel calls it vanished).

    Args:
        handler: torch's handler the body joins with.
        survivors: the node descriptors of the previous round thought alive (this one's
            among them).
        after_round: the previous round's number (its own state is never touched).
    """
    holder = _holder(handler)
    if holder is None or not survivors:
        yield
        return
    settings = getattr(handler, "_settings", None)
    interval = getattr(settings, "keep_alive_interval", None)
    stale = (
        interval + datetime.timedelta(seconds=1)
        if isinstance(interval, datetime.timedelta)
        else None
    )
    this_node = getattr(handler, "_this_node", None)
    done = threading.Event()
    watcher = threading.Thread(
        target=_close_when_all_in,
        args=(copy.copy(holder), set(survivors), this_node, stale, after_round, done),
        name="aioelastic-rdzv-reform",
        daemon=True,
    )
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(5)


def _close_when_all_in(
    holder: Any,
    survivors: set[Any],
    this_node: Any,
    stale: datetime.timedelta | None,
    after_round: int,
    done: threading.Event,
) -> None:
    # A copy of torch's holder: its own state and token, the same backend. Reads and
    # compare-and-sets like any node would; never touches the handler's own holder.
    holder._dirty = False
    holder._cache_duration = 0
    try:
        while not done.wait(_POLL):
            holder.sync()
            state = holder.state
            if state.closed or (state.round > after_round and state.complete):
                return  # formed (or closed) without needing us
            now = datetime.datetime.now(datetime.timezone.utc)
            if stale is not None and _forget_silent(
                holder, survivors, this_node, now - stale, after_round
            ):
                continue  # written: read the state again
            if state.round <= after_round:
                continue  # the old round, not yet left by every survivor
            if state.deadline is None or not survivors <= set(state.participants):
                continue
            if state.deadline <= now:
                return
            state.deadline = now
            holder.mark_dirty()
            if holder.sync():
                logger.info("rendezvous: every surviving node joined; closing the round now")
                return
    except Exception as e:
        logger.debug("could not close the round early: %s", e)


def _forget_silent(
    holder: Any,
    survivors: set[Any],
    this_node: Any,
    before: datetime.datetime,
    after_round: int,
) -> bool:
    """Forget the survivors not back for the next round whose keep-alive is from before
    ``before``; whether the state was written."""
    state = holder.state
    # Back: waiting for the next round (the old one still complete) or in the new one.
    back = set(state.wait_list)
    if state.round > after_round:
        back |= set(state.participants)
    silent = [
        node
        for node in survivors
        if node != this_node
        and node not in back
        and (node not in state.last_heartbeats or state.last_heartbeats[node] < before)
    ]
    if not silent:
        return False
    for node in silent:
        survivors.discard(node)
        if node in state.last_heartbeats:
            state.last_heartbeats[node] = _EPOCH
            logger.info("rendezvous: forgot node %s, silent since its round ended", node)
    holder.mark_dirty()
    holder.sync()
    return True
