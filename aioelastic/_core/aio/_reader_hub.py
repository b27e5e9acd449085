"""One epoll of our own for the many descriptors of workers, read from the event loop.

Every worker brings two pipes (and, started by a fork, a pidfd), each registered for
reading while the worker lives. Through ``loop.add_reader`` a registration costs
asyncio's selector bookkeeping (a key object, a handle, several lookups) on the way in,
on every wake-up and on the way out: at hundreds of workers that was a fifth of the
supervisor's time per worker. A :class:`ReaderHub` keeps them in an epoll of its own,
registered once on the loop: adding or removing a descriptor is one ``epoll_ctl``, and
one wake-up of the loop serves every descriptor that became readable.

Semantics are ``add_reader``'s: level-triggered, a callback per descriptor, called on
the loop's thread; an end-of-file or hang-up counts as readable. As with ``add_reader``,
a descriptor must be removed while its number still names it (before ``os.close``):
an epoll registration follows the open file, which a forked child may keep open.

A hub exists only while it has descriptors or is held: a group holds its loop's hub
from its first start to the end of its output (:func:`hold_reader_hub`), and the last
:meth:`ReaderHub.remove` or release closes its epoll, so an idle supervisor (or a test's
closed loop) holds no descriptor for it. The hold is for workers that exit as fast as
they start (``/bin/true``, a failing import): without it the hub of a starting group
emptied between most starts, and each new worker made the epoll and its loop
registration again.
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Callable

from ..process._runtime import forget_in_child
from ._backend import callback_context

__all__ = ["ReaderHub", "hold_reader_hub", "reader_hub"]

#: The most descriptors one wake-up serves; the rest wait for the loop's next turn
#: (level-triggered: nothing is lost), so a flood of output cannot hold the loop.
_MAX_EVENTS = 256


class ReaderHub:
    """The readers of one event loop's worker descriptors (see the module documentation)."""

    __slots__ = ("_callbacks", "_epoll", "_holds", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._epoll = select.epoll()  # close-on-exec, as every fd Python creates
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._holds = 0
        # A callback outside any task finds no async library through sniffio: the
        # callbacks run in a context that names asyncio (they may start tasks).
        loop.add_reader(self._epoll.fileno(), callback_context().run, self._dispatch)

    def add(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the loop whenever ``fd`` is readable, until :meth:`remove`.

        Raises:
            RuntimeError: ``fd`` has a reader already.
        """
        if fd in self._callbacks:
            raise RuntimeError(f"fd {fd} has a reader already; remove it first")
        self._epoll.register(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def remove(self, fd: int) -> bool:
        """Stop reading ``fd``; whether it had a reader. The last one closes an unheld hub."""
        if self._callbacks.pop(fd, None) is None:
            return False
        self._epoll.unregister(fd)
        self._close_if_idle()
        return True

    def hold(self) -> Callable[[], None]:
        """Keep the hub open, without descriptors too, until the returned release is called.

        The release may be called more than once; only the first counts.
        """
        self._holds += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._holds -= 1
                self._close_if_idle()

        return release

    def _close_if_idle(self) -> None:
        if not self._callbacks and not self._holds:
            self.close()

    def _dispatch(self) -> None:
        try:
            ready = self._epoll.poll(0, _MAX_EVENTS)
        except InterruptedError:
            return
        callbacks = self._callbacks
        for fd, _ in ready:
            # Removed (or replaced, the number reused) by an earlier callback of this
            # turn: a spurious call at worst, which a non-blocking read shrugs off.
            callback = callbacks.get(fd)
            if callback is None:
                continue
            try:
                callback()
            except Exception as exc:
                self._loop.call_exception_handler(
                    {
                        "message": f"aioelastic: the reader of fd {fd} failed",
                        "exception": exc,
                    }
                )

    @property
    def closed(self) -> bool:
        """Whether the hub was closed (it takes no more descriptors)."""
        return self._epoll.closed

    def close(self) -> None:
        """Unregister from the loop and close the epoll (its readers are dropped)."""
        if self._epoll.closed:
            return
        if _hubs.get(self._loop) is self:
            del _hubs[self._loop]
        if not self._loop.is_closed():
            self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        self._callbacks.clear()


#: The open hub of each loop that has one (a hub holds its loop only while it has
#: descriptors or holds, see the module documentation).
_hubs: dict[asyncio.AbstractEventLoop, ReaderHub] = {}


def reader_hub(loop: asyncio.AbstractEventLoop) -> ReaderHub:
    """The hub of ``loop``, made when it has none open."""
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = ReaderHub(loop)
    return hub


def hold_reader_hub(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Open the hub of ``loop`` if needed and hold it open (see :meth:`ReaderHub.hold`)."""
    return reader_hub(loop).hold()


# A forked child runs loops of its own: its parent's hubs are not its to use.
forget_in_child(_hubs.clear)
