"""Small messages to a helper process (the watchdog, a fork server), sent without waiting.

Both helpers are told things on a ``SOCK_SEQPACKET`` socket: watch or forget a group,
reap a worker, keep spares. A datagram socket holds a bounded number of messages however
small they are, and while a helper works through a burst of start requests it reads none:
a plain blocking send then froze the event loop until the helper had read its way down
to it (tens of milliseconds for a burst of 64 jobs; for ever at a stopped helper).

:class:`HelperMessages` sends at once when there is room and otherwise queues, and
everything after a queued message queues behind it, so the helper reads them in the
order they were sent (a release before the watch of a later group given the same pid).
One launcher thread drains the queue, blocking on each message in turn.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable

from ._launchers import launcher_pool


class HelperMessages:
    """An ordered, never-waiting sender of small messages to one helper.

    Args:
        current_socket: the helper's socket now (``None`` when it is not running): a
            helper that was replaced gets what was still queued for the one before,
            which only ever repeats what it must know anyway.
    """

    def __init__(self, current_socket: Callable[[], socket.socket | None]) -> None:
        self._current_socket = current_socket
        self._queue: deque[bytes] = deque()
        #: Guards the queue; notified when the drain ends.
        self._changed = threading.Condition()
        self._draining = False

    def __len__(self) -> int:
        """Messages queued, not yet in the helper's socket."""
        return len(self._queue)

    def send(self, message: bytes) -> None:
        """Send ``message`` now if the socket has room, else after those queued before it."""
        sock = self._current_socket()
        if sock is None:
            return
        with self._changed:
            if not self._queue:
                try:
                    sock.sendmsg([message], [], socket.MSG_DONTWAIT)
                    return
                except BlockingIOError:
                    pass
                except OSError:
                    return  # the helper is gone; its replacement starts afresh
            self._queue.append(message)
            if self._draining:
                return
            self._draining = True
        try:
            launcher_pool().submit(self._drain)
        except RuntimeError:  # the interpreter is shutting down: no new threads
            self._drain()

    def flush(self, timeout: float) -> bool:
        """Blocking: wait until every queued message is in the socket (or dropped, the
        helper being gone), at most ``timeout`` seconds; whether that happened.

        Before the socket is closed: a forget dropped there would leave the helper
        thinking a reaped group, whose id may be reused, is still the job's to kill.
        """
        with self._changed:
            return self._changed.wait_for(lambda: not self._draining, timeout)

    def _drain(self) -> None:
        failed = False
        while True:
            with self._changed:
                sock = self._current_socket()
                if failed or sock is None or not self._queue:
                    self._queue.clear()
                    self._draining = False
                    self._changed.notify_all()
                    return
                message = self._queue[0]
            try:
                sock.sendmsg([message])
            except OSError:
                failed = True  # the helper is gone: the rest is for nobody
                continue
            with self._changed:
                self._queue.popleft()
