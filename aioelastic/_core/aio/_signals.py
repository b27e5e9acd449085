"""Scoped signal handling for supervisors: `launch`, the elastic agent and the CLI.

torch's launchers install process-wide handlers with ``signal.signal`` and never restore
them, cannot install them off the main thread, and treat a repeated SIGTERM like the
first one. Here a supervisor handles signals only inside an ``async with
handle_signals(...)`` block:

* the handlers go through the running asyncio loop (``loop.add_signal_handler``), so a
  signal becomes an ordinary event in the loop instead of an exception raised at an
  arbitrary bytecode;
* on leaving the block the handlers that were there before are put back exactly, the
  Python-level handler object (``signal.getsignal``) and a handler the host had registered
  on the same loop alike;
* each signal is recorded in order, so the caller races its work against the first
  (`SignalScope.run_until_signal`) and escalates on the second
  (`SignalScope.escalate`), e.g. SIGKILL at once instead of the rest of the grace period.

Blocks may nest or run concurrently (the CLI around the agent, two `launch` calls in one
program): the loop handler is installed once and every active block receives the signal.

When nothing can be installed (the loop runs off the main thread, or it has no
``add_signal_handler``), the block installs nothing, warns once, and `SignalScope.installed`
is False. Signals are then the host's business. Nothing is orphaned either way: workers
die with the supervising process (``PR_SET_PDEATHSIG``), and a supervisor cancelled because
the host reacted to the signal still stops its workers, since teardown runs on
cancellation.

A signal that is ignored (``SIG_IGN``) when the block is entered is handled all the same,
as torch's launchers install their handlers regardless: a shell without job control starts
``cmd &`` with SIGINT and SIGQUIT ignored, and ``kill -INT`` must still stop that
supervisor and its workers — which, being started while our handler is in place, no
longer inherit the ignored disposition either. The one exception is SIGHUP: ignored, it
is what ``nohup`` asked for, so it stays ignored. On leaving the block ``SIG_IGN`` is put
back like any other previous handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from ..process._exit_status import signal_text
from ._backend import require_asyncio
from ._to_the_end import wait_out

__all__ = [
    "DEFAULT_SIGNALS",
    "SignalReceived",
    "SignalScope",
    "handle_signals",
]

logger = logging.getLogger("aioelastic.signals")

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
"""What a supervisor handles unless told otherwise: Ctrl-C and a polite ``kill``."""

_T = TypeVar("_T")


class SignalReceived(Exception):
    """The work given to `SignalScope.run_until_signal` was cut short by a signal.

    Args:
        signum: the signal number.

    Attributes:
        signum: the signal, as a `signal.Signals` member where the number has a name.
    """

    def __init__(self, signum: int) -> None:
        self.signum: int = _as_signal(signum)
        super().__init__(f"{signal_text(signum)} received")

    @property
    def exit_code(self) -> int:
        """The shell's exit status for a program stopped by this signal: ``128 + signum``."""
        return 128 + int(self.signum)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (int(self.signum),))


class SignalScope:
    """The signals received while one `handle_signals` block is active.

    Made by `handle_signals`; not meant to be constructed directly. Still readable after
    the block has exited (e.g. for the exit status).

    Attributes:
        signals: the signals this scope listens for.
        installed: the subset for which a handler is active; empty when none could be
            installed (off the main thread); an ignored SIGHUP (``nohup``) is left out.
    """

    def __init__(self, signals: frozenset[signal.Signals]) -> None:
        self.signals = signals
        self.installed: frozenset[signal.Signals] = frozenset()
        self._received: list[signal.Signals] = []
        self._changed = asyncio.Event()
        self._cancel_on_signal: set[anyio.CancelScope] = set()

    @property
    def received(self) -> tuple[signal.Signals, ...]:
        """Every signal received so far, in order of arrival."""
        return tuple(self._received)

    @property
    def first(self) -> signal.Signals | None:
        """The first signal received, or None."""
        return self._received[0] if self._received else None

    @property
    def exit_code(self) -> int | None:
        """``128 + N`` for the first signal N received, or None: the status to exit with."""
        return None if self.first is None else 128 + int(self.first)

    async def wait(self, count: int = 1) -> signal.Signals:
        """Wait until ``count`` signals in total have been received.

        Args:
            count: which signal to wait for: 1 for the first, 2 for the second, ...

        Returns:
            The ``count``-th signal (at once if it has already arrived).

        Raises:
            ValueError: ``count`` is less than 1.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an int >= 1 (1 = the first signal), got {count!r}")
        while len(self._received) < count:
            await self._changed.wait()
        return self._received[count - 1]

    async def run_until_signal(self, work: Awaitable[_T]) -> _T:
        """Await ``work`` in the current task, cancelling it when a signal arrives.

        Args:
            work: what to run, typically ``ctx.wait()``.

        Returns:
            What ``work`` returned, if it finished first.

        Raises:
            SignalReceived: a signal arrived first (or had already arrived); ``work`` was
                cancelled and has finished unwinding.
        """
        with anyio.CancelScope() as cancel_scope:
            self._cancel_on_signal.add(cancel_scope)
            try:
                if self._received:
                    cancel_scope.cancel()
                return await work
            finally:
                self._cancel_on_signal.discard(cancel_scope)
        # Only reached when the scope swallowed the cancellation a signal caused.
        assert self.first is not None
        raise SignalReceived(self.first)

    @contextlib.asynccontextmanager
    async def escalate(
        self,
        action: Callable[[signal.Signals], Awaitable[object]],
        *,
        after: int = 2,
    ) -> AsyncIterator[None]:
        """While the block runs, call ``await action(sig)`` once ``after`` signals arrived.

        Meant to wrap a teardown: ``after=2`` means "a second signal while stopping skips
        the rest of the grace period", e.g. ``action=lambda sig:
        ctx.close(death_sig=signal.SIGKILL)``. Counting is by total signals received, so
        two quick Ctrl-C before the block is entered still escalate at once.

        ``action`` runs in its own task, shielded from cancellation once started: leaving
        the block waits for it, so a half-done SIGKILL is never abandoned. If it raises,
        the error propagates from the block unless the block is already raising.

        Args:
            action: coroutine function called with the signal that triggered it.
            after: how many signals in total trigger it.

        Raises:
            ValueError: ``after`` is less than 1.
        """
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise ValueError(f"after must be an int >= 1 (signals in total), got {after!r}")
        started = False

        async def escalator() -> None:
            nonlocal started
            sig = await self.wait(after)
            # Set in the same step that calls action, so the finally below never cancels
            # an action that has begun.
            started = True
            await action(sig)

        task = asyncio.get_running_loop().create_task(escalator())
        # How the block ended (cancelled, too) decides what the action's failure becomes.
        body_failed = True
        try:
            yield
            body_failed = False
        finally:
            # A due action runs even if the block ended before its task got to start it.
            if not started and len(self._received) < after:
                task.cancel()
            await wait_out(task)
            if not task.cancelled() and task.exception() is not None:
                error = task.exception()
                if body_failed:
                    logger.error("signal escalation failed", exc_info=error)
                else:
                    raise RuntimeError("signal escalation failed") from error

    def _deliver(self, sig: signal.Signals) -> None:
        self._received.append(sig)
        # Wake every waiter; waiters re-check the count, so a fresh event per signal is
        # enough and never loses a wake-up.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for cancel_scope in list(self._cancel_on_signal):
            cancel_scope.cancel()


@contextlib.asynccontextmanager
async def handle_signals(
    signals: Iterable[int] = DEFAULT_SIGNALS,
) -> AsyncIterator[SignalScope]:
    """Handle ``signals`` through the running asyncio loop for the duration of the block.

    Example::

        async with handle_signals() as sigs, start_processes(...) as ctx:
            try:
                result = await sigs.run_until_signal(ctx.wait())
            except SignalReceived as e:
                async with sigs.escalate(lambda s: ctx.close(death_sig=signal.SIGKILL)):
                    await ctx.close()
                raise SystemExit(e.exit_code) from e

    On exit the previous handlers are restored exactly; see the module docstring for
    nesting, off-main-thread use and ignored signals.

    Args:
        signals: the signals to handle (numbers or `signal.Signals`).

    Yields:
        The `SignalScope` recording what arrives.

    Raises:
        ValueError: a signal number is invalid, or is SIGKILL/SIGSTOP (which cannot be
            caught), or ``signals`` is empty.
        TypeError: ``signals`` holds something other than ints.
        RuntimeError: no asyncio loop is running in this thread.
    """
    wanted = _validate(signals)
    require_asyncio("handle_signals()")
    loop = asyncio.get_running_loop()
    scope = SignalScope(wanted)
    registry = _registry_for(loop)
    scope.installed = registry.attach(scope)
    try:
        yield scope
    finally:
        registry.detach(scope)


def _validate(signals: Iterable[int]) -> frozenset[signal.Signals]:
    if isinstance(signals, (int, str, bytes)):
        raise TypeError(
            f"signals must be an iterable of signal numbers, got {signals!r}; "
            "wrap a single signal in a tuple: (signal.SIGINT,)"
        )
    result = set()
    for sig in signals:
        if isinstance(sig, bool) or not isinstance(sig, int):
            raise TypeError(f"signals must hold signal numbers, got {sig!r}")
        if sig not in signal.valid_signals():
            raise ValueError(f"{sig!r} is not a valid signal number on this platform")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{signal_text(sig)} cannot be caught; leave it out of signals")
        result.add(signal.Signals(sig))
    if not result:
        raise ValueError("signals is empty; pass e.g. (signal.SIGINT, signal.SIGTERM)")
    return frozenset(result)


@dataclass
class _Installed:
    """One signal we took over on one loop, and what to put back when the last scope leaves."""

    previous_handler: Any
    """``signal.getsignal`` before we installed: a callable, SIG_DFL, or None (set from C)."""
    previous_loop_handle: asyncio.Handle | None
    """A handler the host had registered with ``loop.add_signal_handler`` itself."""
    scopes: list[SignalScope] = field(default_factory=list)


class _LoopSignals:
    """The handlers one loop has installed for our scopes (one per signal, shared)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._installed: dict[signal.Signals, _Installed] = {}

    def attach(self, scope: SignalScope) -> frozenset[signal.Signals]:
        """Start delivering ``scope.signals`` to ``scope``; return those that are handled."""
        try:
            for sig in sorted(scope.signals):
                if sig not in self._installed:
                    previous = signal.getsignal(sig)
                    if previous is signal.SIG_IGN and sig == signal.SIGHUP:
                        continue  # nohup's request, unlike a background job's SIGINT
                    loop_handle = _loop_handle(self._loop, sig)
                    self._loop.add_signal_handler(sig, self._dispatch, sig)
                    self._installed[sig] = _Installed(previous, loop_handle)
                self._installed[sig].scopes.append(scope)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            # add_signal_handler raises RuntimeError off the main thread and
            # NotImplementedError on loops without signal support; it fails for the first
            # signal already, so in practice nothing was installed. Undo what was.
            self.detach(scope)
            warnings.warn(
                f"aioelastic: cannot handle signals here ({type(e).__name__}: {e}); "
                f"{', '.join(signal_text(s) for s in sorted(scope.signals))} stay with the "
                "host program. Workers are still stopped when this supervisor is cancelled "
                "and still die with this process (PR_SET_PDEATHSIG).",
                RuntimeWarning,
                stacklevel=4,
            )
            return frozenset()
        return frozenset(sig for sig in scope.signals if sig in self._installed)

    def detach(self, scope: SignalScope) -> None:
        """Stop delivering to ``scope``; restore a signal's old handlers once unused."""
        for sig in sorted(scope.signals):
            if sig in self._installed and scope in self._installed[sig].scopes:
                self._release(sig, scope)

    def _release(self, sig: signal.Signals, scope: SignalScope) -> None:
        entry = self._installed[sig]
        entry.scopes.remove(scope)
        if entry.scopes:
            return
        del self._installed[sig]
        if self._loop.is_closed():
            # A closed loop's handlers are gone; only the Python-level one is left to fix.
            signal.signal(sig, _restorable(sig, entry.previous_handler))
            return
        # remove_signal_handler resets the handler to SIG_DFL/default_int_handler, not to
        # what was there: put the real previous one back afterwards.
        self._loop.remove_signal_handler(sig)
        if entry.previous_loop_handle is not None:
            handle = entry.previous_loop_handle
            self._loop.add_signal_handler(sig, handle._callback, *handle._args)  # type: ignore[attr-defined]
        else:
            signal.signal(sig, _restorable(sig, entry.previous_handler))

    def _dispatch(self, sig: signal.Signals) -> None:
        entry = self._installed.get(sig)
        if entry is None:
            return
        if sig != signal.SIGWINCH:  # a window resize is no news (see _terminal)
            logger.info("received %s", signal_text(sig))
        for scope in list(entry.scopes):
            scope._deliver(sig)


_registries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopSignals] = (
    weakref.WeakKeyDictionary()
)


def _registry_for(loop: asyncio.AbstractEventLoop) -> _LoopSignals:
    registry = _registries.get(loop)
    if registry is None:
        registry = _registries[loop] = _LoopSignals(loop)
    return registry


def _loop_handle(loop: asyncio.AbstractEventLoop, sig: signal.Signals) -> asyncio.Handle | None:
    """The handler the host registered on ``loop`` for ``sig`` itself, if any.

    asyncio has no public way to read it back; its Unix loops keep them in
    ``_signal_handlers``. Without this, ``remove_signal_handler`` would silently drop the
    host's handler when our scope ends.
    """
    handlers = getattr(loop, "_signal_handlers", None)
    if not isinstance(handlers, dict):
        return None
    handle = handlers.get(sig)
    if handle is None or not hasattr(handle, "_callback") or not hasattr(handle, "_args"):
        return None
    return handle if isinstance(handle, asyncio.Handle) else None


def _restorable(sig: signal.Signals, handler: Any) -> Any:
    # getsignal returns None for a handler installed from C, which Python cannot put back;
    # the nearest thing is the default disposition Python itself would use.
    if handler is None:
        return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    return handler


def _as_signal(signum: int) -> int:
    try:
        return signal.Signals(signum)
    except ValueError:
        return signum
