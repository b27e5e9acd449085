"""The start methods: how a group's workers come to exist, one implementation per method.

The group (:class:`~._pcontext.PContext`) knows only the small :class:`StartMethod`
protocol, as it knows only :class:`~..start._exit_watch.ExitWatch` of how an exit is learnt:

- :class:`BinaryMethod`: a binary, started by the watchdog with ``posix_spawn``, in
  batches (:class:`~..start._binary_start.BinaryLauncher`);
- :class:`SpawnMethod`: a fresh interpreter that reads its pickled call from a pipe;
- :class:`ForkMethod`: a fork of this process, which inherits the call;
- :class:`ForkServerMethod`: a fork of a warm server (:mod:`..start._forkserver`), which gets the
  pickled call.

Each one prepares a rank's environment and call (:meth:`StartMethod.prepare`), starts
the workers (:meth:`StartMethod.start`, through a :class:`~._starting.GroupStarter`), and
says what to keep once the group started (:meth:`StartMethod.after_group`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import os
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.lowlevel

from ..aio._pace import pace
from ..child import _stack_hook as stack_hook
from ..child._bootstrap import FunctionCall
from ..process._subreaper import lineage_env
from ..start import _launchers
from ..start._binary_start import BinaryLauncher, BinaryStart
from ._preparing import Prepared, RankPreparer
from ._starting import GroupStarter, Opening
from ._validate import GroupSpec

if TYPE_CHECKING:
    from ..start._forkserver import ForkServer


class StartMethod(RankPreparer, Protocol):
    """How the workers of one group are made (with :class:`~._preparing.RankPreparer`)."""

    #: The method's name: ``binary``, or the ``start_method`` of function workers.
    name: str
    #: Whether workers send a return value back through a result pipe.
    returns_value: bool

    async def start(self, starter: GroupStarter) -> None:
        """Start every worker of the group; failures go to ``starter.errors``."""
        ...

    def after_group(self) -> None:
        """Called once every worker started: keep what the next start of the group needs."""
        ...


def start_method(spec: GroupSpec) -> StartMethod:
    """The start method of ``spec``."""
    if spec.is_binary:
        return BinaryMethod(spec)
    methods: dict[str, Callable[[GroupSpec], StartMethod]] = {
        "spawn": SpawnMethod,
        "fork": ForkMethod,
        "forkserver": ForkServerMethod,
    }
    return methods[spec.start_method](spec)


def runs_stack_hook(args: tuple[Any, ...]) -> bool:
    """Whether a binary's arguments run a script through the stack hook (docs/hangs.md)."""
    return any(a == "-m" and b in stack_hook.MODULES for a, b in itertools.pairwise(args))


class BinaryMethod:
    """Binary workers, started by the watchdog in batches from the event loop itself."""

    name = "binary"
    returns_value = False

    def __init__(self, spec: GroupSpec) -> None:
        self._spec = spec

    def __repr__(self) -> str:
        return f"<BinaryMethod {self._spec.entrypoint!r}>"

    def runs_python(self, rank: int) -> bool:
        # A binary without the stack hook never answers a stack request.
        return runs_stack_hook(self._spec.args[rank])

    def prepare(
        self, rank: int, error_file: str, overlay: dict[str, str]
    ) -> tuple[dict[str, str], None]:
        # Only what this rank adds to the supervisor's environment: the watchdog lays it
        # over the one copy of ``os.environ`` sent per batch (see BinaryLauncher).
        env = dict(overlay)
        env.update(lineage_env(collections.ChainMap(env, os.environ)))
        return env, None

    def after_group(self) -> None:
        pass

    async def start(self, starter: GroupStarter) -> None:
        """Start every binary worker from this one task, in batches of the watchdog.

        No task per worker: a worker's set-up is a few syscalls, and a task with its
        cancel scopes cost as much again. Each worker's set-up and record waits for the
        loop's budget (:func:`~._pace.pace`), shared with every other group. The first
        failure to set up stops the rest from starting; the ones handed over are recorded
        (or killed) before the error counts.
        """
        spec = self._spec
        launcher = BinaryLauncher(os.environ)
        handed: collections.deque[tuple[int, Opening, asyncio.Future[_launchers.Launched]]]
        handed = collections.deque()

        async def record(rank: int, opening: Opening, future: asyncio.Future[Any]) -> None:
            try:
                try:
                    launched = await future
                finally:
                    opening.close_child_ends()
            except Exception as exc:
                opening.abort()
                starter.errors.append((rank, exc))
                return
            try:
                await starter.record(rank, opening, launched)
            except Exception as exc:
                # Killed and closed by record(); the others handed over still get recorded.
                starter.errors.append((rank, exc))

        try:
            for rank in range(spec.nprocs):
                await pace()
                try:
                    opening = starter.open(rank)
                except Exception as exc:
                    starter.errors.append((rank, exc))
                    break
                argv = [str(spec.entrypoint), *spec.args[rank]]
                start = BinaryStart(
                    argv, opening.prepared.env, opening.out_w, opening.err_w, opening.stdin
                )
                handed.append((rank, opening, launcher.submit(start)))
                # The ones the watchdog has started already are put to use at once
                # (their pipes read, their exits watched) while it spawns on.
                while handed and handed[0][2].done():
                    await record(*handed.popleft())
                    await pace()
            launcher.send_pending()
        finally:
            # However this ends (cancelled between slices, too): what was handed over may
            # exist, so it is recorded (it is torn down with the group) before this goes on.
            with anyio.CancelScope(shield=True):
                while handed:
                    await record(*handed.popleft())
                    await pace()


class _FunctionMethod:
    """Function workers, started one task each: a Python call in a new process."""

    returns_value = True

    def __init__(self, spec: GroupSpec) -> None:
        self._spec = spec
        self.name = spec.start_method
        #: The supervisor's environment as the group's first worker was prepared: every
        #: worker starts from the same one (and reading ``os.environ`` decodes each of
        #: its variables, per worker, which cost more than the rest of a preparation).
        self._base_env: dict[str, str] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._spec.name!r}>"

    def runs_python(self, rank: int) -> bool:
        return True

    def prepare(
        self, rank: int, error_file: str, overlay: dict[str, str]
    ) -> tuple[dict[str, str], FunctionCall | bytes]:
        spec = self._spec
        if self._base_env is None:
            self._base_env = dict(os.environ)
        env = {**self._base_env, **overlay}
        env.update(lineage_env(env))
        assert callable(spec.entrypoint)
        call = FunctionCall(spec.entrypoint, spec.args[rank], env, error_file)
        return env, self._payload(rank, call)

    def _payload(self, rank: int, call: FunctionCall) -> FunctionCall | bytes:
        try:
            return pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ValueError(
                f"the entrypoint or args of {self._spec.name!r} cannot be pickled for "
                f"start_method={self._spec.start_method!r} ({exc}); define the function at "
                "module level and pass picklable args, or use start_method='fork'"
            ) from exc

    async def start(self, starter: GroupStarter) -> None:
        async with anyio.create_task_group() as tg:
            for rank in range(self._spec.nprocs):
                # Each task waits for the loop's budget before its set-up (pipes, pumps,
                # the hand-off to a launcher thread) and its record (see start_one).
                tg.start_soon(starter.start_one, rank, functools.partial(self.launch, starter))

    async def launch(
        self, starter: GroupStarter, prepared: Prepared, opening: Opening
    ) -> _launchers.Launched:
        """The process of one opened worker."""
        raise NotImplementedError

    def after_group(self) -> None:
        pass


class SpawnMethod(_FunctionMethod):
    """A fresh interpreter per worker, which reads its pickled call from a pipe."""

    def _payload(self, rank: int, call: FunctionCall) -> bytes:
        prep = _launchers.preparation_data(f"{self._spec.name}-{rank}")
        payload = super()._payload(rank, call)
        assert isinstance(payload, bytes)
        return pickle.dumps(prep) + payload

    async def launch(
        self, starter: GroupStarter, prepared: Prepared, opening: Opening
    ) -> _launchers.Launched:
        return await _launchers.on_launcher_thread(
            _launchers.start_spawn,
            prepared.env,
            opening.out_w,
            opening.err_w,
            opening.res_w,
            opening.stdin,
        )


class ForkMethod(_FunctionMethod):
    """A fork of this process per worker; the call is inherited, never pickled."""

    def _payload(self, rank: int, call: FunctionCall) -> FunctionCall:
        return call

    async def launch(
        self, starter: GroupStarter, prepared: Prepared, opening: Opening
    ) -> _launchers.Launched:
        assert isinstance(prepared.payload, FunctionCall)
        # The forked child inherits every fd; these it must not keep (the watchdog's
        # pipe would otherwise outlive us in a grandchild).
        private = [*opening.parent_ends, *starter.private_fds()]
        return await _launchers.on_launcher_thread(
            _launchers.start_fork,
            prepared.payload,
            opening.out_w,
            opening.err_w,
            opening.res_w,
            private,
            opening.stdin,
        )


def _fork_server(preload: tuple[str, ...]) -> ForkServer:
    """The warm server for ``preload``; its client is imported by the first group using one.

    Not at the top: groups of binaries (or spawned, or forked, workers) never need it, and
    its import (with the server's own module, for the protocol's constants) would cost a
    service's first start of a binary group ~4 ms of its event loop.
    """
    from ..start._forkserver import fork_server

    return fork_server(preload)


class ForkServerMethod(_FunctionMethod):
    """A fork of the warm server of the group's preload list per worker."""

    async def launch(
        self, starter: GroupStarter, prepared: Prepared, opening: Opening
    ) -> _launchers.Launched:
        assert isinstance(prepared.payload, bytes)
        server = _fork_server(tuple(self._spec.options.forkserver_preload))
        return await server.start_worker(
            opening.out_w, opening.err_w, opening.res_w, prepared.payload, opening.stdin
        )

    def after_group(self) -> None:
        # Workers for the next start of this group (a restart) are forked while the
        # server is idle, so that start takes no fork.
        _fork_server(tuple(self._spec.options.forkserver_preload)).keep_spares(self._spec.nprocs)
