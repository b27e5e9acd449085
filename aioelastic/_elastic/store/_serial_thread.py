"""Blocking rendezvous calls, awaited from the event loop on a daemon thread of their own.

Every call into a torch rendezvous handler blocks: store round trips, one-second sync
sleeps, joins that wait for peers for minutes. So each runs on a thread, one at a time per
handler (torch's handlers are not safe to call concurrently), and a caller can always stop
waiting at once: the call itself cannot be interrupted, it finishes on its thread and its
result is dropped. Later calls queue behind an abandoned one.

Why not ``anyio.to_thread.run_sync(fn, limiter=CapacityLimiter(1), abandon_on_cancel=True)``,
checked with anyio 4.16:

* anyio's worker threads are not daemons. A join abandoned by a cancelled agent would keep
  the interpreter from exiting until torch's join timeout (600 s by default) runs out:
  ``anyio.run`` returns, then the process waits for the thread.
* an abandoned call gives its limiter token back at once, so the next call would run on
  a second thread while the first is still inside torch's handler.

What is left by hand is the smallest part: a queue, a daemon thread, and handing each
result back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["SerialThread", "calls_in_flight", "on_daemon_thread"]

logger = logging.getLogger("aioelastic.rendezvous")

_T = TypeVar("_T")

# Every SerialThread of the process, for calls_in_flight().
_ALL: weakref.WeakSet[SerialThread] = weakref.WeakSet()


def calls_in_flight() -> int:
    """How many blocking calls are still running on a SerialThread (abandoned ones too).

    A program about to exit checks this: a store call still blocked in torch's C++ code
    when the interpreter shuts down can end the process with an abort (SIGABRT) instead of
    its exit status, so such a program ends with ``os._exit`` instead (see `run`).
    """
    return sum(thread.running for thread in list(_ALL))


class SerialThread:
    """One daemon thread running blocking calls in submission order.

    Results travel back with ``loop.call_soon_threadsafe``; a caller that was cancelled has
    already cancelled its future, and a loop that has since closed is simply not told.

    Args:
        name: the thread's name, and the name in errors.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Whether a call is running on the thread right now.
        self.running = False
        _ALL.add(self)

    async def call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn()`` on the thread after the calls before it; its result or its error.

        Raises:
            RuntimeError: the thread was closed.
        """
        if self._closed:
            raise RuntimeError(f"{self._name}: already closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._calls.put((fn, loop, future))
        return await future

    def close(self) -> None:
        """Let the thread exit once the calls already queued have run."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, loop, future = item
            if future.cancelled():
                # Abandoned before it started: nobody wants it, and not running it lets
                # the calls queued behind it go sooner.
                continue
            self.running = True
            try:
                result, error = fn(), None
            except BaseException as e:
                # Whatever the call raised (a SystemExit or KeyboardInterrupt from the
                # handler's code too) goes back to its caller: an escaping error would end
                # this thread and leave the caller and every call queued behind it waiting
                # forever.
                result, error = None, e
            finally:
                self.running = False
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                if error is not None:
                    logger.debug("abandoned rendezvous call failed", exc_info=error)
            # Drop this call before blocking on the next: its closure holds the handler,
            # whose TCPStores keep sockets open for as long as anything refers to them.
            del item, fn, loop, future, result, error


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        if error is not None:
            logger.debug("abandoned rendezvous call failed", exc_info=error)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def on_daemon_thread(fn: Callable[[], _T], name: str) -> _T:
    """Run one blocking call on a daemon thread of its own (see the module's notes).

    Args:
        fn: the call.
        name: the thread's name.
    """
    thread = SerialThread(name)
    try:
        return await thread.call(fn)
    finally:
        thread.close()
