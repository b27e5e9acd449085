"""``start_processes`` and ``run_processes``: a group of local workers from one call.

Both take the same arguments, listed once (``run_processes`` is made from
``start_processes``); the group's options are a :class:`~._options.GroupOptions`, given
whole as ``options=`` or field by field as the keyword arguments they always were.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, ParamSpec

from ..hangs._guard import HangConfig
from ..output._std import Std
from ..reports._results import RunProcsResult
from ._options import GroupOptions, keyword_signature
from ._pcontext import PContext
from ._validate import validate

__all__ = ["run_processes", "start_processes"]

_P = ParamSpec("_P")


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str | int]],
    log_dir: str | os.PathLike[str] | None = None,
    start_method: str = "spawn",
    redirects: Std | Mapping[int, Std] = Std.NONE,
    tee: Std | Mapping[int, Std] = Std.NONE,
    *,
    options: GroupOptions | None = None,
    **keywords: Any,
) -> PContext:
    """Validate the arguments and return a :class:`PContext` (workers start on entry).

    Args:
        name: The group's name, used in log prefixes (``[{name}{local_rank}]:``).
        entrypoint: A callable (function workers, called as ``entrypoint(*args[rank])``)
            or a str (a binary, run as ``[entrypoint, *map(str, args[rank])]``).
        args: Arguments per local rank; keys exactly ``0..n-1``.
        envs: Extra environment per local rank; same keys as ``args``.
        log_dir: Where ``{local_rank}/stdout.log|stderr.log|error.json`` go; a fresh
            temporary directory when ``None``. Must not hold earlier output.
        start_method: ``spawn``, ``fork`` or ``forkserver`` (function workers only).
        redirects: Streams written to log files, as a :class:`Std` or per rank.
        tee: Streams also printed to the console with a rank prefix.
        options: The group's options as one :class:`GroupOptions` record.
        **keywords: Any field of :class:`GroupOptions` by its name, as before the record
            existed (the grace period, the console filters and prefix, the stall timeout,
            the stop order, collapsed lines, the fork server's modules). With ``options``
            too, a keyword argument at its default leaves the record's value, any other
            value sets it, and one field set to two different values is a TypeError.

    Raises:
        ValueError, TypeError: On any invalid argument, before anything starts.
    """
    spec = validate(
        name=name,
        entrypoint=entrypoint,
        args=args,
        envs=envs,
        log_dir=log_dir,
        start_method=start_method,
        options=options,
        keywords={"redirects": redirects, "tee": tee, **keywords},
    )
    hangs = HangConfig.from_env(os.environ, stall_timeout=spec.options.stall_timeout)
    return PContext(spec, hangs)


setattr(  # noqa: B010  (a function's __signature__ is not known to type checkers)
    start_processes,
    "__signature__",
    keyword_signature(start_processes, torch=False, skip=("redirects", "tee")),
)


def _run_to_the_end(
    start: Callable[_P, PContext],
) -> Callable[_P, Coroutine[Any, Any, RunProcsResult]]:
    """A coroutine function taking ``start``'s arguments: it starts, waits, stops."""

    async def run_processes(*args: _P.args, **kwargs: _P.kwargs) -> RunProcsResult:
        """Start the workers, wait for the outcome, stop them: `start_processes` in one call."""
        ctx = start(*args, **kwargs)
        async with ctx:
            result = await ctx.wait()
        assert result is not None
        return result

    shown = inspect.signature(start).replace(return_annotation="RunProcsResult")
    setattr(run_processes, "__signature__", shown)  # noqa: B010  (as above)
    run_processes.__module__, run_processes.__qualname__ = start.__module__, "run_processes"
    return run_processes


run_processes = _run_to_the_end(start_processes)
