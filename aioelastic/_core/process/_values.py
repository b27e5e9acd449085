"""One parser per configuration value, shared by the command line and the API.

Each parser takes the value as either entry point gives it (the text of a flag or a
``PET_*`` variable, or the typed argument of `LaunchConfig`, `WorkerSpec`,
`start_processes`) and returns it typed, or raises ValueError/TypeError with a message that
names the offending value and the fix but not the field: the caller adds the field, so the
same bad value reads the same from ``aioelastic-run`` (``argument --master-port: <message>``,
exit 2) and from the API (``ValueError("master_port: <message>")``). See `field` and
the command line's ``cli_type`` (``aioelastic._cli._cli_flags``).

This module holds the values of a group of workers and the helpers every parser shares;
the values only an elastic job has (nodes, rendezvous, the agent's signals and exit codes)
are parsed in the layer that uses them, ``aioelastic._elastic.settings._node_values``.

The semantics follow torch 2.13's ``torchrun`` where it has one; where torch accepts a value
and then ignores it (a signal name it cannot resolve only logs a warning), we refuse it.
No torch in this module, and no I/O but `log_dir`'s look at the path it is given.
"""

from __future__ import annotations

import math
import os
import re
import signal
import string
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ._platform import JOB_SIGNALS

__all__ = [
    "MAX_COLLAPSE_WINDOW",
    "NAME_MAX",
    "PORT_DIGITS",
    "PREFIX_FIELDS",
    "START_METHODS",
    "boolean",
    "collapse_window",
    "duration",
    "field",
    "forwarded_signals",
    "integer",
    "split_items",
    "log_dir",
    "module_names",
    "name",
    "non_negative_int",
    "port",
    "positive_duration",
    "positive_int",
    "prefix_template",
    "rank_filter",
    "start_method",
]

_T = TypeVar("_T")

START_METHODS = ("spawn", "fork", "forkserver")
PREFIX_FIELDS = ("role_name", "rank", "local_rank", "hostname")
"""torch's fallback for the shutdown timeout when none is given."""
NAME_MAX = 255
"""Longest file name (bytes) most filesystems allow: a name appears in log file names."""

MAX_COLLAPSE_WINDOW = 10.0
"""The longest window for identical lines: a line may wait this long before it is shown."""

PORT_DIGITS = re.compile(r"[0-9]{1,5}")


def field(name_: str, parse: Callable[[Any], _T], value: Any) -> _T:
    """``parse(value)``, its error prefixed with the API field ``name_`` (same type).

    Args:
        name_: the argument's name as the API spells it (``"master_port"``).
        parse: one of this module's parsers.
        value: the value given.
    """
    try:
        return parse(value)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{name_}: {e}") from None


# -- switches ------------------------------------------------------------------------


def boolean(value: object) -> bool:
    """``True`` or ``False`` (an on/off option of the API; the command line's is a switch).

    Nothing else is taken for one: ``"no"`` and ``"false"`` are true in Python, and a
    ``1`` or ``None`` is more likely a value meant for another argument.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{value!r} ({type(value).__name__}) is not True or False")
    return value


# -- numbers -------------------------------------------------------------------------


def integer(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool, not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"{value!r} is not an integer") from None
    raise TypeError(f"{value!r} is a {type(value).__name__}, not an integer")


def positive_int(value: object) -> int:
    """An integer >= 1 (counts: nodes, workers per node)."""
    number = integer(value)
    if number < 1:
        raise ValueError(f"{number} is not >= 1")
    return number


def non_negative_int(value: object) -> int:
    """An integer >= 0 (restarts, a node rank)."""
    number = integer(value)
    if number < 0:
        raise ValueError(f"{number} is not >= 0")
    return number


def _seconds(value: object) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool, not a number of seconds")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise ValueError(f"{value!r} is not a number of seconds (e.g. 30 or 0.5)") from None
    else:
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a number of seconds")
    # Numbers are shown parsed (not as given) so that "0" and 0 read the same.
    if not math.isfinite(number):
        raise ValueError(f"{number:g} is not a finite number of seconds")
    return number


def duration(value: object) -> float:
    """Seconds, finite and >= 0 (timeouts, backoffs; 0 means at once)."""
    number = _seconds(value)
    if number < 0:
        raise ValueError(f"{number:g} is not >= 0 seconds")
    return number


def positive_duration(value: object) -> float:
    """Seconds, finite and > 0 (intervals)."""
    number = _seconds(value)
    if number <= 0:
        raise ValueError(f"{number:g} is not > 0 seconds")
    return number


# -- nodes and addresses --------------------------------------------------------------


def collapse_window(value: object) -> float | None:
    """Seconds a console line waits for the same line from other ranks; ``None``: off.

    ``""`` (an empty ``PET_*`` variable) is off too. A window is > 0 and at most
    :data:`MAX_COLLAPSE_WINDOW`: every line may be shown that much later than it was written.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    number = _seconds(value)
    if number <= 0:
        raise ValueError(
            f"{number:g} is not > 0 seconds; give the window identical lines are collapsed "
            "in (e.g. 0.25), or leave it unset to show every line"
        )
    if number > MAX_COLLAPSE_WINDOW:
        raise ValueError(
            f"{number:g} seconds is longer than {MAX_COLLAPSE_WINDOW:g}: every line would "
            "wait that long before it is shown; 0.25 catches lines written together"
        )
    return number


def port(value: object) -> int:
    """A TCP port 0..65535; 0 asks for any free port (where this node listens)."""
    if isinstance(value, str) and not PORT_DIGITS.fullmatch(value.strip()):
        raise ValueError(f"{value!r} is not a port number 0..65535")
    number = integer(value)
    if not 0 <= number <= 65535:
        raise ValueError(f"{number} is not a port number 0..65535")
    return number


def log_dir(value: object) -> Path:
    """A log directory: a path that is a directory, or where one can be made.

    The one parser here that looks at the file system (a stat per path component, up to
    the first directory): a file where the directory or one of its parents goes would
    otherwise be found only when the first attempt makes its log directory, as a bare
    FileExistsError or NotADirectoryError once the rendezvous is done.
    """
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a directory path")
    text = os.fspath(value)
    if not text:
        raise ValueError("'' is empty; give the path of a directory (made if missing)")
    path = Path(text)
    for place in (path, *path.parents):
        try:
            if place.is_dir():
                break
            if not os.path.lexists(place):
                continue
            what = "a file" if place.exists() else "a symbolic link to nothing"
        except OSError:
            break  # cannot look (EACCES): making the directory will tell why
        where = f"is {what}" if place == path else f"is under {str(place)!r}, {what}"
        raise ValueError(
            f"{text!r} {where}, not a directory; give the path of a directory (made if missing)"
        )
    return path


"""Checks one option's value; raises ValueError/TypeError naming ``key=value`` and the fix."""


"""What torch's ``get_as_bool`` reads as a boolean (in any case)."""


"""The options each of torch 2.13's own rendezvous backends reads, with their checks."""


# -- names ---------------------------------------------------------------------------


def name(value: object) -> str:
    """A role or group name: it prefixes console lines and names log files.

    Refused: empty, a path separator, ``.``/``..``, a NUL or a line break (it would split
    the console prefix), longer than a file name allows (255 bytes).
    """
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a str")
    if not value:
        raise ValueError("'' is empty; use a plain name such as 'trainer'")
    if "/" in value or (os.altsep and os.altsep in value) or value in (".", ".."):
        raise ValueError(
            f"{value!r} must not contain a path separator or be '.' or '..' (it names log "
            "files); use a plain name such as 'trainer'"
        )
    if any(ch in value for ch in "\0\n\r") or not value.isprintable():
        raise ValueError(
            f"{value!r} contains a NUL, a line break or another control character (it "
            "prefixes console lines); use a plain name such as 'trainer'"
        )
    size = len(value.encode("utf-8", "surrogateescape"))
    if size > NAME_MAX:
        raise ValueError(
            f"{value[:20]!r}... is {size} bytes long; a file name allows {NAME_MAX}: use a "
            "shorter name"
        )
    return value


def start_method(value: object) -> str:
    """``spawn``, ``fork`` or ``forkserver``."""
    if value not in START_METHODS:
        raise ValueError(f"{value!r} is not one of {', '.join(map(repr, START_METHODS))}")
    assert isinstance(value, str)
    return value


def prefix_template(value: object) -> str | None:
    """A console prefix ``string.Template`` over ``PREFIX_FIELDS``; ``None`` for the default."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a str template")
    try:
        string.Template(value).substitute(dict.fromkeys(PREFIX_FIELDS, ""))
    except (KeyError, ValueError) as e:
        fields = " ".join(f"${{{f}}}" for f in PREFIX_FIELDS)
        raise ValueError(
            f"{value!r} is not a valid template ({e!r}); it may use {fields}"
        ) from None
    return value


# -- lists ---------------------------------------------------------------------------


def module_names(value: object) -> tuple[str, ...]:
    """Modules to import, ``"torch,numpy"`` or ``("torch", "numpy")``; ``""`` for none.

    Each must be a dotted name of identifiers (``torch.nn``); whether it is installed is
    found when it is imported.
    """
    if isinstance(value, str):
        items: list[object] = [item.strip() for item in value.split(",")] if value.strip() else []
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise TypeError(f"{value!r} is not a comma-separated list of module names")
    names: list[str] = []
    for item in items:
        if not isinstance(item, str) or not all(part.isidentifier() for part in item.split(".")):
            raise ValueError(
                f"{item!r} is not a module name; give importable names separated by commas, "
                "e.g. torch,numpy"
            )
        if item not in names:
            names.append(item)
    return tuple(names)


def forwarded_signals(value: object) -> tuple[signal.Signals, ...]:
    """Signals passed on to the workers: ``"USR1,USR2"`` or ``(signal.SIGUSR1,)``; ``""``: none.

    A name with or without its ``SIG`` (``USR1``, ``SIGUSR1``, as ``kill -s`` takes it).
    Only the signals sent to tell a job something (``_platform.JOB_SIGNALS``): a fault,
    job control or SIGCHLD passed on would be a mistake, not a request.
    """
    example = "USR1,USR2"
    if isinstance(value, str) and not value.strip():
        return ()
    found: list[signal.Signals] = []
    for item in split_items(value, "signals", example):
        if isinstance(item, str):
            text = item.upper()
            sig = getattr(signal, text if text.startswith("SIG") else f"SIG{text}", None)
        elif isinstance(item, int) and not isinstance(item, bool):
            sig = next((s for s in signal.Signals if s == item), None)
        else:
            raise TypeError(f"{item!r} is not a signal name or number; e.g. {example}")
        if sig not in JOB_SIGNALS:
            names = ",".join(s.name.removeprefix("SIG") for s in JOB_SIGNALS)
            raise ValueError(f"{item!r} is not a signal that can be forwarded; one of {names}")
        assert isinstance(sig, signal.Signals)
        if sig not in found:
            found.append(sig)
    return tuple(found)


def split_items(value: object, what: str, example: str) -> list[object]:
    """The items of ``"a,b"`` text or of a collection; a lone int or str item is refused."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        return list(value)
    raise TypeError(f"{value!r} is not a collection of {what}; e.g. {example}")


def rank_filter(value: object, nprocs: int | None = None) -> frozenset[int] | None:
    """Local ranks whose console output is shown: ``"0,2"`` or ``{0, 2}``; empty/None: all."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    ranks: set[int] = set()
    for item in split_items(value, "local ranks", "{0, 1}"):
        try:
            ranks.add(non_negative_int(item))
        except (ValueError, TypeError):
            raise ValueError(
                f"{value!r} is not a comma-separated list of local ranks (e.g. 0,1)"
            ) from None
    if nprocs is not None:
        bad = sorted(rank for rank in ranks if rank >= nprocs)
        if bad:
            raise ValueError(
                f"{_ranks_text(ranks)} names local rank {bad[0]}, but there are local ranks "
                f"0..{nprocs - 1}"
            )
    return frozenset(ranks)


def global_rank_filter(value: object) -> frozenset[int] | None:
    """Global ranks whose console output is shown: ``"0,8-15"`` or ``{0, 8}``; empty: all.

    The world size is known only after the rendezvous, so ranks beyond it are not refused:
    they show nothing.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    ranks: set[int] = set()
    for item in split_items(value, "global ranks", "{0, 8}"):
        try:
            if isinstance(item, str) and "-" in item.strip()[1:]:
                first, _, last = item.strip().partition("-")
                low, high = non_negative_int(first), non_negative_int(last)
                if low > high:
                    raise ValueError(item)
                ranks.update(range(low, high + 1))
            else:
                ranks.add(non_negative_int(item))
        except (ValueError, TypeError):
            raise ValueError(
                f"{value!r} is not a comma-separated list of global ranks and ranges (e.g. 0,8-15)"
            ) from None
    return frozenset(ranks)


def _ranks_text(ranks: Collection[int]) -> str:
    """Ranks as the command line spells them (``0,2``), whichever form they came in."""
    return ",".join(str(rank) for rank in sorted(ranks))
