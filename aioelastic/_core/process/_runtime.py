"""What one process holds for every supervisor in it, and what a forked child forgets.

Most state belongs to one run (a process context, an agent). A few things belong to the
*process*: every run in it shares them, and each is created on first use (creating the
:class:`Runtime` does no I/O and starts nothing). They all live on :data:`runtime`:

* the launcher threads that create workers (:mod:`aioelastic._core.start._launchers`);
* the warm fork servers, one per preload list (:mod:`aioelastic._core.start._forkserver`);
* the console writers and their per-file locks (:mod:`aioelastic._core.output._console`);
* the limiter of the ``waitid`` threads of the exit-watch fallback
  (:mod:`aioelastic._core.start._exit_watch`);
* the subreaper flag, the children aioelastic started itself, and the token that marks
  the environment of this process's workers (:mod:`aioelastic._core.process._subreaper`);
* whether a group's stdin router reads our terminal (:mod:`aioelastic._core.output._stdin_router`);
* whether stale temporary log roots were swept (:mod:`aioelastic._core.output._log_root`).

The watchdog (:mod:`aioelastic._core.start._watchdog`) is one object for the process's
lifetime, imported by name where it is used, so it keeps its state itself and registers
what its copy in a forked child must forget with :func:`forget_in_child`. What
:mod:`aioelastic._core.process._platform` caches (pidfd support, the resolved ``prctl``)
describes the kernel and the C library, which a forked child shares, so it is not state of
this kind.

Fork: a process forked from a supervisor (a "fork" worker that supervises workers of its
own) inherits all of this memory but none of the threads, and none of the ownership. The
launcher threads and console writers do not exist there, so work queued for them would
wait forever; a lock another thread held at the fork is never released there; the
watchdog, the fork servers and the children are the parent's. This module's single
``os.register_at_fork`` hook therefore runs the registered hooks (they close the child's
copies of the parent's sockets), then gives the child a fresh :class:`Runtime` state, as
if it had just started.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess
    from concurrent.futures import ThreadPoolExecutor


class Runtime:
    """The process-wide state of aioelastic (see the module documentation).

    Attributes are read and replaced by the module that owns each concept; lazy creation
    happens under :attr:`lock`. After ``os.fork()`` the child's instance is reset in place,
    so a reference to :data:`runtime` stays valid, but a reference to one of its
    attributes taken before the fork does not: read them through :data:`runtime`.
    """

    def __init__(self) -> None:
        self._forget_hooks: list[Callable[[], None]] = []
        self._fresh()

    def _fresh(self) -> None:
        #: Guards the creation of the lazily made objects below.
        self.lock = threading.Lock()
        #: Launcher threads: they never retire, see :mod:`aioelastic._core.start._launchers`.
        self.launcher_pool: ThreadPoolExecutor | None = None
        # The values of the next two are typed by their owners' accessors
        # (`_forkserver.servers`, `_console.consoles`): the owners import this module, so
        # it names none of their types, not even for type checking (no import cycle).
        #: Warm fork servers (``ForkServer``) by preload list.
        self.fork_servers: dict[tuple[str, ...], Any] = {}
        #: Fork servers told to stop but not reaped yet; reaped at interpreter exit.
        self.closed_fork_servers: list[subprocess.Popen[bytes]] = []
        #: The writers (``ConsoleStream``) of our ``stdout`` and ``stderr``, by stream name.
        self.consoles: dict[str, Any] = {}
        #: One lock per file or pipe the consoles write to (by device and inode).
        self.console_locks: dict[object, threading.Lock] = {}
        #: Whether ``PR_SET_CHILD_SUBREAPER`` is set (it is not inherited by a fork).
        self.subreaper_enabled = False
        #: The random token in :data:`~aioelastic._core.process._subreaper.LINEAGE_ENV` of this
        #: process's workers, made on first use (a forked child that supervises workers
        #: makes its own: its state is reset).
        self.lineage_token: str | None = None
        #: Pids of the processes aioelastic started itself and reaps itself.
        self.own_children: set[int] = set()
        #: Every recorded worker not reaped yet, of every group (each leads its own
        #: process group, so none is a member of another's): teardown's scan skips them.
        self.worker_leaders: set[int] = set()
        #: Held while a child is created and registered, and while strays are listed.
        self.own_children_lock = threading.Lock()
        #: Whether a group's stdin router reads our terminal (one at a time).
        self.stdin_forwarded = False
        #: Whether this process removed the stale temporary log roots already.
        self.stale_log_roots_swept = False

    def forget_in_child(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` in a child made by ``os.fork()``, before the state is reset.

        For an object that lives as long as the process and holds something of its
        parent's (a socket, a lock): the hook drops it. Hooks run in the order they were
        registered, in the child only, before any other code; they must not take a
        lock (another thread of the parent may have held it at the fork).
        """
        self._forget_hooks.append(hook)

    def _after_fork_in_child(self) -> None:
        for hook in self._forget_hooks:
            hook()
        self._fresh()


#: The runtime of this process.
runtime = Runtime()


def forget_in_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Register ``hook`` with :meth:`Runtime.forget_in_child`; usable as a decorator."""
    runtime.forget_in_child(hook)
    return hook


os.register_at_fork(after_in_child=runtime._after_fork_in_child)
