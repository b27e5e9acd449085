"""The options of a group of workers: one frozen record, each option defined once.

An option is one field of :class:`GroupOptions`, declared by :func:`_option` with its
default, its parser (from :mod:`..process._values`, the one the command line uses too),
its doc and, where torch spells it differently, its torch-side name. Everything else is
read from that table: the record parses each field on construction, :meth:`GroupOptions.of`
takes the torch-shaped keyword arguments of ``start_processes``, ``LocalElasticAgent`` and
``LaunchConfig`` by the names each API uses, the command line builds the record from its
flags, and :func:`keyword_signature` shows the keywords in ``help()``. Adding an option
is a field here, its parser, its use, and its doc.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..output._std import Std, to_map
from ..process import _values as values

__all__ = ["GroupOptions", "keyword_signature", "option_names", "spelling"]

_T = TypeVar("_T")


def _option(
    default: _T, parse: Callable[..., Any], doc: str, *, torch: str = "", ranks: bool = False
) -> _T:
    """A field of `GroupOptions`, with all there is to know about it.

    Args:
        default: the value when not given (also: a value equal to it counts as not given).
        parse: the field's parser, ``parse(value) -> typed value``; with ``ranks``,
            ``parse(value, nprocs)`` checks it against the group's local ranks too.
        doc: what the option does (the record's docstring and ``help()`` show it).
        torch: the name ``LaunchConfig``, ``LocalElasticAgent`` and ``aioelastic-run``
            give it, when theirs is not the field's.
        ranks: the value names local ranks, checked once the number of ranks is known.
    """
    meta = {"parse": parse, "doc": doc, "torch": torch, "ranks": ranks}
    return dataclasses.field(default=default, metadata=meta)


def _streams(value: object, nprocs: int | None = None) -> Std | dict[int, Std]:
    """A `Std` for every rank or ``{local_rank: Std}``; with ``nprocs``, one per rank."""
    if nprocs is not None:
        return to_map(value, nprocs)  # type: ignore[arg-type]  # to_map checks the type
    if isinstance(value, Std):
        to_map(value, 0)
        return value
    if isinstance(value, Mapping):
        ints = [k for k in value if isinstance(k, int) and not isinstance(k, bool)]
        to_map(value, max(ints, default=-1) + 1)  # the keys' types and the values
        return dict(value)
    return to_map(value, 0)  # type: ignore[arg-type]  # raises: not a Std or a mapping


def _module_names(value: object) -> tuple[str, ...]:
    """Modules to import, a collection of names (one name alone is refused: wrap it)."""
    if isinstance(value, str):
        raise TypeError(f"{value!r} is a str, not a sequence of module names; write ({value!r},)")
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        value = tuple(value)
    return values.module_names(value)


def _positive_or_none(value: object) -> float | None:
    """Seconds > 0, or ``None`` for never."""
    return None if value is None else values.positive_duration(value)


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """The options of a group of workers, each parsed when the record is made.

    ``start_processes(..., options=GroupOptions(...))``, ``LaunchConfig(options=...)`` and
    ``LocalElasticAgent(spec, options=...)`` take it whole; each field is also still a
    keyword argument of each of them, by the name that API has always used (see
    :meth:`of`). ``aioelastic-run`` builds one from its flags.

    Raises:
        ValueError, TypeError: a bad value, naming the field and the fix.
    """

    redirects: Std | Mapping[int, Std] = _option(
        Std.NONE,
        _streams,
        "Streams written to log files, as a `Std` for every rank or ``{local_rank: Std}``.",
        ranks=True,
    )
    tee: Std | Mapping[int, Std] = _option(
        Std.NONE,
        _streams,
        "Streams also printed to the console with the rank prefix (same forms).",
        ranks=True,
    )
    grace_period: float = _option(
        30.0,
        values.duration,
        "Seconds between the stop signal and SIGKILL when the workers are stopped.",
        torch="shutdown_timeout",
    )
    forkserver_preload: Collection[str] = _option(
        (),
        _module_names,
        "Modules the fork server imports once for all workers (``forkserver``); restarts "
        "reuse the warm server.",
    )
    local_ranks_filter: Collection[int] | None = _option(
        None,
        values.rank_filter,
        "Local ranks whose console output is shown; all when ``None``.",
        ranks=True,
    )
    ranks_filter: Collection[int] | None = _option(
        None,
        values.global_rank_filter,
        "Global ranks whose console output is shown (``{0, 8}``, or the text "
        '``"0,8-15"``); all when ``None``. With the local filter too, a rank is shown when '
        "both allow it; a group started alone has global ranks equal to its local ones. "
        "A filtered rank's failure is still reported in full.",
    )
    log_line_prefix: str | None = _option(
        None,
        values.prefix_template,
        "The console prefix, a template with ``${role_name}``, ``${rank}``, "
        "``${local_rank}``, ``${hostname}``; ``[{name}{local_rank}]:`` when ``None``.",
        torch="log_line_prefix_template",
    )
    stall_timeout: float | None = _option(
        None,
        _positive_or_none,
        "Seconds without output or timer request from any worker after which the group "
        "is reported stalled, with every stack, and stopped; off when ``None``. "
        "``TORCHELASTIC_ENABLE_FILE_TIMER=1`` serves torch's file timer. See docs/hangs.md.",
    )
    stop_leader_first: bool = _option(
        False,
        values.boolean,
        "Stop each worker before its helpers: the stop signal goes to the worker alone, "
        "so that the children it needs to shut down cleanly (the data-loader processes a "
        "trainer reads from while it saves a checkpoint on SIGTERM) keep running; once "
        "the worker exited, the rest of its process group gets the same signal, and "
        "whatever is left when the grace period ends is SIGKILLed. ``False`` (the default, "
        "as torchrun): the whole group gets it at once. See docs/reliability.md.",
    )
    forward_signals: Collection[int] = _option(
        (),
        values.forwarded_signals,
        "Signals passed on to every worker while the group runs, which goes on (e.g. "
        '``"USR1,USR2"``, a scheduler\'s checkpoint request): each is sent to each '
        "running worker's process, not its process group, and a worker that does not "
        "handle it dies of it, an ordinary failure. None by default. See docs/signals.md.",
    )
    collapse_identical_lines: float | None = _option(
        None,
        values.collapse_window,
        "A window in seconds (e.g. ``0.25``): a console line that several ranks write "
        "identically within it is printed once, as ``[ranks 0-7]: text``; each rank's "
        "lines keep their order, and the log files and ``output()`` still get every copy. "
        "Off when ``None``. See docs/logs.md.",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            parsed = values.field(f.name, f.metadata["parse"], getattr(self, f.name))
            object.__setattr__(self, f.name, parsed)

    @classmethod
    def of(
        cls,
        given: Mapping[str, Any],
        *,
        options: GroupOptions | None = None,
        torch: bool = False,
        caller: str = "GroupOptions",
        nprocs: int | None = None,
    ) -> GroupOptions:
        """``options`` with the torch-shaped keyword arguments ``given`` merged in.

        The rule wherever both are accepted: a keyword argument equal to its default
        leaves the record's field as it is, any other value sets it; the same field set
        to two different values, in the record and as a keyword argument, is a TypeError
        naming both.

        Args:
            given: values by option name, each parsed (a bad one named as given).
            options: the record they are merged into; the defaults when None.
            torch: ``given`` uses torch's names (``shutdown_timeout``...) where they differ.
            caller: the API named when ``given`` holds a name that is not an option.
            nprocs: the number of local ranks, when known: a value naming local ranks
                is checked against it as it is parsed (see `for_ranks`).

        Raises:
            ValueError, TypeError: a bad value, an unknown name, or a field set twice.
        """
        if options is None:
            options = _defaults()
        elif not isinstance(options, cls):
            raise TypeError(f"options must be a GroupOptions, got {type(options).__name__}")
        by_name = _fields_by_name(torch)
        changes = {}
        for name, value in given.items():
            f = by_name.get(name)
            if f is None:
                raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
            if value is f.default:
                continue  # left as it is: nothing to parse, nothing to merge
            parse = f.metadata["parse"]
            if nprocs is not None and f.metadata["ranks"]:  # its ranks first, as to_map
                values.field(name, functools.partial(parse, nprocs=nprocs), value)
            parsed = values.field(name, parse, value)
            if parsed == f.default:
                continue
            mine = getattr(options, f.name)
            if mine != f.default and mine != parsed:
                raise TypeError(
                    f"{name}={value!r} and options.{f.name}={mine!r} disagree: give it once, "
                    "as a keyword argument or in options"
                )
            changes[f.name] = parsed
        return options._with(changes) if changes else options

    def given(self, *, torch: bool = False) -> dict[str, Any]:
        """The fields not at their default, by name (torch's names with ``torch``)."""
        return {
            spelling(f, torch): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }

    def for_ranks(self, nprocs: int) -> GroupOptions:
        """The record checked against local ranks ``0..nprocs-1``; rank maps made whole.

        Raises:
            ValueError: a value names a local rank the group does not have.
        """
        changes = {}
        for f in dataclasses.fields(self):
            if f.metadata["ranks"]:
                parse = functools.partial(f.metadata["parse"], nprocs=nprocs)
                changes[f.name] = values.field(f.name, parse, getattr(self, f.name))
        return self._with(changes)

    def _with(self, changes: Mapping[str, Any]) -> GroupOptions:
        """A copy with ``changes``, which are parsed already: no field is parsed again.

        Not ``dataclasses.replace``, which parses every field anew: a service's burst of
        groups makes this record twice per group within one turn of its event loop.
        """
        new = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        return new

    def shows(self, local_rank: int, ranks: Mapping[int, int] | None = None) -> bool:
        """Whether the console shows local rank ``local_rank``: both filters allow it.

        Args:
            local_rank: the worker's local rank.
            ranks: global rank by local rank; None for a group alone (its own ranks).
        """
        local, wanted = self.local_ranks_filter, self.ranks_filter
        global_rank = local_rank if ranks is None else ranks[local_rank]
        return (local is None or local_rank in local) and (wanted is None or global_rank in wanted)


@functools.cache
def _defaults() -> GroupOptions:
    """The record of every default, parsed once (frozen, and its defaults immutable)."""
    return GroupOptions()


@functools.cache
def _fields_by_name(torch: bool) -> dict[str, dataclasses.Field[Any]]:
    """The record's fields by the name one API spells them (see `spelling`)."""
    return {spelling(f, torch): f for f in dataclasses.fields(GroupOptions)}


def spelling(f: dataclasses.Field[Any], torch: bool) -> str:
    """The name of option ``f`` in torch's APIs (``torch``) or in ``start_processes``."""
    return str(f.metadata["torch"] or f.name) if torch else f.name


def option_names(*, torch: bool) -> tuple[str, ...]:
    """Every option's name, as torch's APIs (``torch``) or ``start_processes`` spell it."""
    return tuple(spelling(f, torch) for f in dataclasses.fields(GroupOptions))


def _documented(cls: type[GroupOptions]) -> type[GroupOptions]:
    """The record's docstring with an ``Attributes`` entry per field, from the table."""
    lines = ["", "    Attributes:"]
    for f in dataclasses.fields(cls):
        torch = f" (``{f.metadata['torch']}`` in torch's APIs)" if f.metadata["torch"] else ""
        text = f"{f.name}: {f.metadata['doc']}{torch}"
        lines += textwrap.wrap(text, 88, initial_indent=" " * 8, subsequent_indent=" " * 12)
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
    return cls


_documented(GroupOptions)


def keyword_signature(
    fn: Callable[..., Any], *, torch: bool, skip: Collection[str] = ()
) -> inspect.Signature:
    """``fn``'s signature with its ``**keywords`` shown as the options' keyword arguments.

    Args:
        fn: a function taking the options as ``**keywords`` (read from the table).
        torch: spell them as torch's APIs do.
        skip: options ``fn`` takes as parameters of their own.
    """
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    keywords = [
        inspect.Parameter(
            spelling(f, torch), inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in dataclasses.fields(GroupOptions)
        if spelling(f, torch) not in skip
    ]
    return signature.replace(parameters=[*params, *keywords])
