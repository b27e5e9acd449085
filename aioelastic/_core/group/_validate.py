"""Checking ``start_processes`` arguments before anything starts.

Every problem is reported here, with the offending value and the fix, so that a bad call
never leaves half a group running. The result is a :class:`GroupSpec` whose fields the
rest of the package can trust.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..child._bootstrap import check_not_importing_main
from ..output._std import Std, to_map
from ..process import _values as values
from ..process._values import PREFIX_FIELDS, START_METHODS
from ._options import GroupOptions

__all__ = ["LOG_FILES", "PREFIX_FIELDS", "START_METHODS", "GroupSpec", "check_preload", "validate"]
LOG_FILES = ("stdout.log", "stderr.log", "error.json")


@dataclass(frozen=True)
class GroupSpec:
    """Validated, normalised arguments of one group of workers."""

    name: str
    #: The callable, or the binary's absolute path.
    entrypoint: Callable[..., Any] | str
    args: dict[int, tuple[Any, ...]]
    envs: dict[int, dict[str, str]]
    log_dir: Path | None
    start_method: str
    #: The group's options, checked against its local ranks.
    options: GroupOptions
    #: ``options.redirects`` and ``options.tee``, one `Std` per local rank.
    redirects: dict[int, Std]
    tee: dict[int, Std]

    @property
    def nprocs(self) -> int:
        """Number of local workers."""
        return len(self.args)

    @property
    def is_binary(self) -> bool:
        """Whether the workers run a binary rather than a Python callable."""
        return isinstance(self.entrypoint, str)


def validate(
    *,
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, Any],
    envs: Mapping[int, Mapping[str, Any]],
    log_dir: str | os.PathLike[str] | None,
    start_method: str,
    options: GroupOptions | None,
    keywords: Mapping[str, Any],
) -> GroupSpec:
    """Check every argument of ``start_processes``; raise ValueError/TypeError on misuse.

    ``keywords`` are the group's options given as keyword arguments, merged into
    ``options`` (see `GroupOptions.of`).
    """
    check_not_importing_main("start_processes()")
    values.field("name", values.name, name)
    nprocs = _check_ranks(args, envs)
    clean_envs = {rank: _check_env(rank, envs[rank]) for rank in range(nprocs)}
    clean_args = {rank: _check_args(rank, args[rank]) for rank in range(nprocs)}
    values.field("start_method", values.start_method, start_method)
    if isinstance(entrypoint, str):
        resolved: Callable[..., Any] | str = _resolve_binary(entrypoint, clean_envs[0])
        clean_args = {r: tuple(map(str, a)) for r, a in clean_args.items()}
    elif callable(entrypoint):
        resolved = entrypoint
    else:
        raise TypeError(
            f"entrypoint must be a callable (function workers) or a str (a binary to run), "
            f"got {type(entrypoint).__name__}: {entrypoint!r}"
        )
    options = GroupOptions.of(
        keywords, options=options, caller="start_processes", nprocs=nprocs
    ).for_ranks(nprocs)
    check_preload(options.forkserver_preload)
    return GroupSpec(
        name=name,
        entrypoint=resolved,
        args=clean_args,
        envs=clean_envs,
        log_dir=_check_log_dir(log_dir, nprocs),
        start_method=start_method,
        options=options,
        redirects=to_map(options.redirects, nprocs),
        tee=to_map(options.tee, nprocs),
    )


def _check_ranks(args: object, envs: object) -> int:
    if not isinstance(args, Mapping) or not isinstance(envs, Mapping):
        raise TypeError(
            "args and envs must be dicts keyed by local rank, e.g. "
            "args={0: (...), 1: (...)}, envs={0: {...}, 1: {...}}"
        )
    if not args:
        raise ValueError("no workers: args is empty; give one entry per local rank 0..n-1")
    expected = set(range(len(args)))
    if set(args) != expected:
        raise ValueError(
            f"args keys must be exactly the local ranks 0..{len(args) - 1}, "
            f"got {sorted(args, key=repr)}"
        )
    if set(envs) != set(args):
        raise ValueError(
            f"envs keys {sorted(envs, key=repr)} must be the same as args keys "
            f"{sorted(args)}: give every local rank an entry in both (an empty dict is fine)"
        )
    return len(args)


def _check_env(rank: int, env: object) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise TypeError(f"envs[{rank}] must be a dict of str to str, got {type(env).__name__}")
    clean = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ValueError(f"envs[{rank}] has an invalid variable name {key!r}")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TypeError(
                f"envs[{rank}][{key!r}] = {value!r} is a {type(value).__name__}; environment "
                "values must be str (int is converted): pass str(value)"
            )
        text = str(value)
        if "\0" in text:
            raise ValueError(f"envs[{rank}][{key!r}] contains a NUL byte")
        clean[key] = text
    return clean


def _check_args(rank: int, value: object) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"args[{rank}] must be a tuple of arguments, got {type(value).__name__}: "
            f"{value!r} (for one argument write ({value!r},))"
        )
    return tuple(value)


def _resolve_binary(entrypoint: str, env: Mapping[str, str]) -> str:
    if not entrypoint:
        raise ValueError("entrypoint is an empty string; give a binary's path or name")
    search_path = env.get("PATH", os.environ.get("PATH", os.defpath))
    found = shutil.which(entrypoint, path=search_path)
    if found is None:
        where = "does not exist or is not executable" if os.sep in entrypoint else "not on PATH"
        raise ValueError(
            f"binary entrypoint {entrypoint!r} {where} (PATH={search_path}); "
            "give an absolute path or install it"
        )
    return os.path.abspath(found)


def _entries(directory: Path) -> list[str]:
    """The names in ``directory``; none if it does not exist or is not a directory."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _check_log_dir(log_dir: str | os.PathLike[str] | None, nprocs: int) -> Path | None:
    if log_dir is None:
        return None
    path = values.field("log_dir", values.log_dir, log_dir)
    # One listing per existing directory, not a stat per rank and file: a fresh log_dir
    # (the usual case) costs one lookup, whatever the number of ranks.
    taken = []
    ranks = set(_entries(path)) & {str(rank) for rank in range(nprocs)}
    for rank in sorted(ranks, key=int):
        if not (path / rank).is_dir():
            raise ValueError(
                f"log_dir={str(path)!r} holds a file named {rank!r} where worker {rank}'s "
                "log directory goes; remove it or choose a new log_dir"
            )
        names = set(_entries(path / rank))
        taken += [str(path / rank / f) for f in LOG_FILES if f in names]
    if taken:
        raise ValueError(
            f"log_dir={str(path)!r} already holds output of an earlier run ({taken[0]}"
            f"{' and more' if len(taken) > 1 else ''}); a run never overwrites logs: "
            "choose a new log_dir (e.g. one per run or attempt)"
        )
    return path


def check_preload(preload: Collection[str]) -> None:
    """Raise ValueError unless each module of ``forkserver_preload`` is installed."""
    for module in preload:
        top = module.partition(".")[0]
        if importlib.util.find_spec(top) is None:
            raise ValueError(f"forkserver_preload module {module!r} is not installed")
