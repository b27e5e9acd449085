"""The one teardown: signal every worker's process group, grace period, SIGKILL, reap.

Every way a group of workers ends goes through :func:`stop_workers`: ``close()``, the
failure path of ``wait()``, leaving the ``async with`` block, cancellation, and the
signal handlers of ``launch``, the agent and the CLI. It signals process groups, not
pids, so a worker's children (data-loader processes, shell pipelines) stop with it; and
it signals the groups of workers that already exited too, because their children may
still run (only when every worker exited and a look at ``/proc`` finds their groups empty
is there nothing to signal). Leaders are reaped only at the very end: until then their
pid, and so the process-group id, cannot be recycled, so no signal can reach an
unrelated process.

With ``leader_first`` the death signal goes to each worker (its group's leader) alone, so
that a trainer that checkpoints on SIGTERM keeps the helpers it needs for that (data-loader
processes) while it saves. Once a leader has exited, the rest of its group gets the death
signal (nothing of it is needed any more), and whatever is left when the grace period ends
is SIGKILLed, as always.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from ..aio._lazy_event import wait_all
from ..process import _platform
from ..process._runtime import runtime
from ..process._subreaper import sweep_strays
from ..start._watchdog import watchdog
from ._process import WorkerProcess

logger = logging.getLogger("aioelastic")

#: How long to wait, after SIGKILL, for a worker's *children* to be gone. They are not
#: ours to reap; SIGKILL cannot be caught, so this bound is only met by a process stuck
#: in uninterruptible sleep (the kernel finishes it later).
CHILDREN_KILL_TIMEOUT = 5.0
#: Workers signalled or reaped per turn of the event loop: hundreds of them in one go
#: (a few syscalls each) would hold up every other task of the loop for tens of ms.
_BATCH = 32


async def stop_workers(
    workers: Iterable[WorkerProcess],
    death_sig: int,
    grace: float,
    escalate: anyio.Event,
    *,
    leader_first: bool = False,
) -> None:
    """Stop ``workers`` and everything in their process groups, then reap them.

    Args:
        workers: The workers (running or exited, not yet reaped).
        death_sig: The first signal (SIGTERM by default).
        grace: Seconds to wait for the groups to empty before SIGKILL.
        escalate: Set by a second stop request: skip the rest of the grace period.
        leader_first: Send ``death_sig`` to each worker alone, and to the rest of its
            group once it exited (see the module documentation). Without a grace period
            to give (SIGKILL, ``grace`` 0, ``escalate`` set) every group is
            signalled at once, as without it.
    """
    pending = [w for w in workers if not w.reaped]
    if not pending:
        return
    pgids = {w.pid for w in pending}
    graceful = death_sig != signal.SIGKILL and grace > 0 and not escalate.is_set()
    leader_first = leader_first and graceful
    # The usual end of a run: every worker exited by itself. If nothing else is left in
    # their groups either, there is nobody to signal and no grace period to wait out.
    emptied = await _all_gone(pending, pgids)
    if not emptied:
        for count, worker in enumerate(pending, 1):
            if worker.returncode is None:
                worker.signalled = True
            if not leader_first:
                _platform.signal_group(worker.pid, death_sig)
            elif worker.returncode is None:
                _platform.signal_process(worker.pid, death_sig)
            if count % _BATCH == 0:
                await anyio.lowlevel.cancel_shielded_checkpoint()

    if not emptied and graceful:
        with anyio.move_on_after(grace):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on, escalate, tg.cancel_scope)
                if leader_first:
                    # Exited leaders included: their helpers are nobody's to wait for.
                    for worker in pending:
                        tg.start_soon(_signal_group_after, worker, death_sig)
                emptied = await _groups_empty(pending, pgids, children_timeout=None)
                tg.cancel_scope.cancel()

    # Groups seen empty once every leader had exited stay empty: only a live member could
    # fork a new one. Otherwise SIGKILL whatever is left.
    if not emptied:
        for pgid in pgids:
            _platform.signal_group(pgid, signal.SIGKILL)
        await _groups_empty(pending, pgids, children_timeout=CHILDREN_KILL_TIMEOUT)
    for worker in pending:
        if not worker.exited.is_set():
            # Not gone CHILDREN_KILL_TIMEOUT after SIGKILL (uninterruptible sleep, or a
            # fork server that never reports): stop watching, so that teardown ends.
            # Its exit is then recorded with a status marked unknown.
            worker.launched.watch.abandon()
            await worker.exited.wait()
    # Nothing below may stop the loop half-way: a worker left unreaped would hold its
    # pid (and group id) forever. Errors are logged, never raised.
    for count, worker in enumerate(pending, 1):
        # Before the reap: from it on, the pid may name another process.
        runtime.worker_leaders.discard(worker.pid)
        try:
            worker.launched.watch.reap()
        except OSError as exc:
            logger.warning("aioelastic: reaping worker pid %d failed: %s", worker.pid, exc)
        worker.reaped = True
        watchdog.forget(worker.pid)
        if count % _BATCH == 0:
            # Lets other tasks run between batches; never raises (cancel-shielded).
            await anyio.lowlevel.cancel_shielded_checkpoint()
    try:
        await sweep_strays(pgids)
    except OSError as exc:
        logger.warning("aioelastic: sweeping stray children failed: %s", exc)


async def _signal_group_after(worker: WorkerProcess, sig: int) -> None:
    """Send ``sig`` to the rest of ``worker``'s group as soon as the worker has exited.

    Until then its helpers keep running: the worker may need them to finish (a trainer
    saving its checkpoint reads from its data-loader processes). The worker is not reaped
    before the end of teardown, so its pid still names its group, and no other.
    """
    await worker.exited.wait()
    _platform.signal_group(worker.pid, sig)


async def _all_gone(workers: Sequence[WorkerProcess], pgids: set[int]) -> bool:
    """Whether every worker exited and no other member of their groups runs (no waiting)."""
    if not all(worker.exited.is_set() for worker in workers):
        return False
    try:
        return not await _live_group_members(pgids)
    except OSError:
        return False  # /proc cannot be listed (EMFILE): signal every group, as always


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _groups_empty(
    workers: Sequence[WorkerProcess], pgids: set[int], children_timeout: float | None
) -> bool:
    """Wait until every worker exited and no other member of their groups runs.

    Returns ``True`` when the groups had no live member left once the leaders were gone
    (so nothing else needs signalling), ``False`` when members had to be waited for, or
    could not be (no pidfds).
    """
    with anyio.move_on_after(children_timeout if children_timeout is not None else float("inf")):
        await wait_all(worker.exited for worker in workers)
    if not all(worker.exited.is_set() for worker in workers):
        return False
    # Out of file descriptors (EMFILE) neither /proc nor pidfds can be opened: then the
    # members cannot be waited for, and the caller goes on to SIGKILL every group.
    try:
        members = await _live_group_members(pgids)
    except OSError as exc:
        logger.warning("aioelastic: cannot list the workers' process groups: %s", exc)
        return False
    if not members:
        return True
    pidfds = []
    for pids in members.values():
        for pid in pids:
            try:
                fd = _platform.pidfd_open(pid)
            except OSError:
                continue
            if fd is not None:
                pidfds.append(fd)
    if not pidfds:
        return False
    try:
        with anyio.move_on_after(
            children_timeout if children_timeout is not None else float("inf")
        ) as scope:
            for fd in pidfds:
                await anyio.wait_readable(fd)
        if scope.cancelled_caught:
            logger.warning(
                "aioelastic: children of workers in process groups %s did not exit %.0f s "
                "after SIGKILL (uninterruptible sleep?)",
                sorted(members),
                children_timeout,
            )
    finally:
        for fd in pidfds:
            os.close(fd)
    return False


@dataclass(eq=False)
class _Scan:
    """One pass over ``/proc`` for every teardown that asked before it started."""

    pgids: set[int] = field(default_factory=set)
    done: anyio.Event = field(default_factory=anyio.Event)
    members: dict[int, list[int]] = field(default_factory=dict)
    error: OSError | None = None


#: The scan each event loop will run next, while teardowns are joining it.
_next_scans: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Scan] = (
    weakref.WeakKeyDictionary()
)


async def _live_group_members(pgids: set[int]) -> dict[int, list[int]]:
    """:func:`..process._platform.live_group_members`, one scan shared by concurrent teardowns.

    A scan reads every process of the machine; many groups ending together (64 groups
    of 4 in one loop) each asked for one, and the scans took a third of the loop's time.
    A request joins the next scan of this loop, which runs once the tasks already
    runnable have had their turn — so it always starts *after* every request it answers
    (after their leaders exited), which is what makes its answer valid for them.

    On the loop, not on a launcher thread: there it would queue behind other groups'
    starts (64 groups of 4 at once ended 30% later).

    Raises:
        OSError: ``/proc`` cannot be listed (EMFILE).
    """
    loop = asyncio.get_running_loop()
    scan = _next_scans.get(loop)
    if scan is None:
        scan = _next_scans[loop] = _Scan()
        loop.call_soon(_run_scan, loop, scan)
    scan.pgids |= pgids
    await scan.done.wait()
    if scan.error is not None:
        raise scan.error
    return {pgid: scan.members[pgid] for pgid in pgids if pgid in scan.members}


def _run_scan(loop: asyncio.AbstractEventLoop, scan: _Scan) -> None:
    if _next_scans.get(loop) is scan:
        del _next_scans[loop]
    try:
        # Every request joined after its leaders exited (see _groups_empty). The other
        # groups' leaders are skipped too: with 64 groups of 4 ending one after the
        # other, they were most of the processes each of ~50 scans looked at.
        scan.members = _platform.live_group_members(
            scan.pgids, leaders_exited=True, not_members=frozenset(runtime.worker_leaders)
        )
    except OSError as exc:
        scan.error = exc
    scan.done.set()
