"""One parser per configuration value, shared by the command line and the API.

Each parser takes the value as either entry point gives it (the text of a flag or a
``PET_*`` variable, or the typed argument of `LaunchConfig`, `WorkerSpec`,
`start_processes`) and returns it typed, or raises ValueError/TypeError with a message that
names the offending value and the fix but not the field: the caller adds the field, so the
same bad value reads the same from ``aioelastic-run`` (``argument --master-port: <message>``,
exit 2) and from the API (``ValueError("master_port: <message>")``). See `field` and
`cli_type`.

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

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DEFAULT_SIGNALS_TO_HANDLE",
    "NAME_MAX",
    "PREFIX_FIELDS",
    "RDZV_OPTIONS",
    "SHUTDOWN_TIMEOUT_ENV",
    "START_METHODS",
    "cli_type",
    "duration",
    "endpoint",
    "exit_codes",
    "field",
    "host",
    "log_dir",
    "module_names",
    "name",
    "nnodes",
    "node_range",
    "non_negative_int",
    "port",
    "positive_duration",
    "positive_int",
    "prefix_template",
    "rank_filter",
    "rdzv_backend",
    "rdzv_conf",
    "rdzv_options",
    "shutdown_timeout",
    "signals",
    "start_method",
]

_T = TypeVar("_T")

START_METHODS = ("spawn", "fork", "forkserver")
PREFIX_FIELDS = ("role_name", "rank", "local_rank", "hostname")
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""torch's fallback for the shutdown timeout when none is given."""
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
NAME_MAX = 255
"""Longest file name (bytes) most filesystems allow: a name appears in log file names."""

_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
_HOST = re.compile(r"[\w.:-]+")
_PORT = re.compile(r"[0-9]{1,5}")
_INTEGER = re.compile(r"[+-]?[0-9]+")


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


def cli_type(parse: Callable[[str], _T], metavar: str) -> Callable[[str], _T]:
    """``parse`` as an argparse ``type``: its message shown as is, after the flag's name.

    argparse turns a ValueError from ``type`` into a bare "invalid value"; an
    ArgumentTypeError keeps our message, and argparse adds the usage line and exits 2.
    """
    import argparse  # only the command line needs it; the API path stays lighter

    def convert(text: str) -> _T:
        try:
            return parse(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = metavar
    return convert


# -- numbers -------------------------------------------------------------------------


def _integer(value: object) -> int:
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
    number = _integer(value)
    if number < 1:
        raise ValueError(f"{number} is not >= 1")
    return number


def non_negative_int(value: object) -> int:
    """An integer >= 0 (restarts, a node rank)."""
    number = _integer(value)
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


def shutdown_timeout(value: object, environ: Mapping[str, str] | None = None) -> float:
    """The grace before SIGKILL: ``value``, else ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30.

    Raises:
        ValueError: ``value`` (or the variable) is not a number of seconds >= 0; the
            variable is named when it is at fault.
    """
    if value is not None:
        return duration(value)
    raw = (os.environ if environ is None else environ).get(SHUTDOWN_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_SHUTDOWN_TIMEOUT
    try:
        return duration(raw)
    except ValueError as e:
        raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV}={raw!r}: {e}; fix or unset it") from None


# -- nodes and addresses --------------------------------------------------------------


def nnodes(value: object) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``"N"`` or ``"MIN:MAX"`` (or ints) to ``(min, max)``."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str):
        raise TypeError(f"{value!r} is not N or MIN:MAX")
    parts = text.split(":")
    if len(parts) > 2:
        raise ValueError(f"{text!r} is not N or MIN:MAX with integers (e.g. 2 or 1:4)")
    try:
        low, high = positive_int(parts[0]), positive_int(parts[-1])
    except ValueError:
        raise ValueError(
            f"{text!r} is not N or MIN:MAX with integers >= 1 (e.g. 2 or 1:4)"
        ) from None
    return node_range(low, high)


def node_range(min_nodes: int, max_nodes: int) -> tuple[int, int]:
    """``(min_nodes, max_nodes)`` once each is a count: the fewest must not exceed the most."""
    if min_nodes > max_nodes:
        raise ValueError(
            f"the fewest nodes ({min_nodes}) exceed the most ({max_nodes}); e.g. 1:4 "
            "for 1 to 4 nodes"
        )
    return min_nodes, max_nodes


def port(value: object) -> int:
    """A TCP port 0..65535; 0 asks for any free port (where this node listens)."""
    if isinstance(value, str) and not _PORT.fullmatch(value.strip()):
        raise ValueError(f"{value!r} is not a port number 0..65535")
    number = _integer(value)
    if not 0 <= number <= 65535:
        raise ValueError(f"{number} is not a port number 0..65535")
    return number


def endpoint(value: object, default_port: int | None = None) -> tuple[str, int | None]:
    """``HOST[:PORT]`` (IPv6 as ``[::1]:PORT``) to ``(host, port)``, torch's rules without torch.

    torch's ``parse_rendezvous_endpoint``: an empty endpoint is ``localhost``, a missing
    port is ``default_port``, the port is 1 to 5 digits below 65536, the host is made of
    letters, digits, ``.``, ``:``, ``-`` and ``_`` (brackets only around a whole IPv6
    address).
    """
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a str 'HOST:PORT'")
    text = value.strip()
    if not text:
        return "localhost", default_port
    if text[0] == "[" and text[-1] == "]":
        host, rest = text, None
    else:
        host, _, rest = text.rpartition(":") if ":" in text else (text, "", None)
    if len(host) > 1 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    result_port = default_port
    if rest is not None:
        if not _PORT.fullmatch(rest) or int(rest) > 65535:
            raise ValueError(
                f"{value!r} has no valid port: give HOST:PORT with a port 0..65535 "
                "(an IPv6 address as [ADDR]:PORT)"
            )
        result_port = int(rest)
    if not _HOST.fullmatch(host):
        raise ValueError(
            f"{value!r} has no valid host: give HOST:PORT with a host name, an IPv4 "
            "address, or an IPv6 address in brackets ([::1]:29400)"
        )
    return host, result_port


def host(value: object) -> str:
    """A host name, an IPv4 or an IPv6 address (no brackets, no port): where to bind or be seen."""
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a host name or address")
    if not _HOST.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a host name or address; give e.g. 127.0.0.1, node0 or ::1"
        )
    return value


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


def rdzv_backend(value: object) -> str:
    """A rendezvous backend's name as torch registers it (``static``, ``c10d``, ``etcd``...)."""
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a rendezvous backend name")
    # Any name a plugin may register; only what can name no backend at all is refused.
    if not value.isprintable() or not value or any(ch.isspace() for ch in value):
        raise ValueError(f"{value!r} is not a rendezvous backend name; give e.g. c10d or static")
    return value


def rdzv_conf(value: object, backend: str | None = None) -> dict[str, Any]:
    """torchrun's ``--rdzv-conf``: ``KEY=VALUE,KEY=VALUE`` (or a mapping) to a dict.

    Args:
        value: the text, or a mapping of option names to values.
        backend: the rendezvous backend the options are for; for one of torch's own
            (`RDZV_OPTIONS`) each option is checked by `rdzv_options`. None, or a backend
            registered under another name, checks only the form.

    Returns:
        The options, their values as given (torch converts them itself).
    """
    if isinstance(value, Mapping):
        bad = [key for key in value if not isinstance(key, str) or not key]
        if bad:
            raise TypeError(f"option names must be non-empty str, got {bad[0]!r}")
        config: dict[str, Any] = dict(value)
    elif not isinstance(value, str):
        raise TypeError(f"{value!r} is not KEY=VALUE,... or a dict")
    else:
        config = {}
        for item in value.split(",") if value.strip() else ():
            key, sep, text = item.partition("=")
            key, text = key.strip(), text.strip()
            if not key or not sep or not text:
                raise ValueError(
                    f"{value!r}: item {item!r} is not KEY=VALUE "
                    "(e.g. join_timeout=60,last_call_timeout=5)"
                )
            config[key] = text
    if backend is not None:
        rdzv_options(backend, config)
    return config


# -- rendezvous options ---------------------------------------------------------------
# What torch 2.13's own handlers read from their options (RendezvousParameters.config), and
# how: with get_as_int (int(value)), get_as_bool, or as text. torch checks a value only when
# the handler is made, after its store is up (a negative join_timeout fails there, as a
# launcher failure), and never looks at an option it does not read: a misspelt one runs
# with the default as if nothing was said. tests/test_rendezvous.py reads these names out
# of torch's own source, so a torch that reads other options fails there.

_Check = Callable[[str, object], None]
"""Checks one option's value; raises ValueError/TypeError naming ``key=value`` and the fix."""


def _whole(minimum: int | None, example: int, unit: str = "seconds") -> _Check:
    """An option torch reads with ``int()``: a whole number, >= ``minimum`` unless None."""
    what = f"a whole number of {unit}" if unit else "a whole number"
    limit = "" if minimum is None else f" >= {minimum}"

    def check(key: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(
                f"{key}={value!r} is a {type(value).__name__}, not {what} (e.g. {key}={example})"
            )
        number: int | None
        if isinstance(value, str):
            number = int(value) if _INTEGER.fullmatch(value.strip()) else None
        elif isinstance(value, float):
            number = int(value) if value.is_integer() else None
        else:
            number = value
        if number is None or (minimum is not None and number < minimum):
            # Shown parsed when it is a number, so that "-5" and -5 read the same.
            shown = repr(value) if number is None else str(number)
            raise ValueError(f"{key}={shown} is not {what}{limit} (e.g. {key}={example})")

    return check


def _ignored_timeout(backend: str) -> _Check:
    """``timeout`` for a backend that does not read it, but gets it from torch's LaunchConfig.

    torch's ``LaunchConfig`` puts its ``rdzv_timeout`` (default 900) into the options of
    every backend as ``timeout``, and the dynamic handlers (``c10d``, ``etcd-v2``) ignore
    it. So it is accepted as what LaunchConfig puts there, a whole number of seconds, and
    anything else is refused with where the wait for nodes is really set.
    """
    whole = _whole(None, 900)

    def check(key: str, value: object) -> None:
        try:
            whole(key, value)
        except (ValueError, TypeError) as e:
            raise type(e)(
                f"{e}; the {backend} backend ignores {key} anyway (its wait for nodes is "
                "join_timeout): drop it"
            ) from None

    return check


_BOOLEAN_WORDS = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")
"""What torch's ``get_as_bool`` reads as a boolean (in any case)."""


def _boolean(key: str, value: object) -> None:
    """An option torch reads with ``get_as_bool``; None lets torch decide."""
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return
    if isinstance(value, str) and value.lower() in _BOOLEAN_WORDS:
        return
    raise ValueError(f"{key}={value!r} is not a boolean (e.g. {key}=true or {key}=false)")


def _one_of(*choices: str, fold: bool = True) -> _Check:
    """An option torch compares with fixed words (after ``strip().lower()`` when ``fold``)."""

    def check(key: str, value: object) -> None:
        text = value.strip().lower() if fold and isinstance(value, str) else value
        if text not in choices:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")

    return check


def _text(key: str, value: object) -> None:
    """An option torch passes on as it is (a path, a key prefix): nothing to check."""
    del key, value


def _none_or(check: _Check) -> _Check:
    """``check``, where torch takes None as "the default" (its ``_get_timeout``)."""

    def none_or_check(key: str, value: object) -> None:
        if value is not None:
            check(key, value)

    return none_or_check


_DYNAMIC_OPTIONS: dict[str, _Check] = {
    # torch's dynamic_rendezvous.create_handler: RendezvousTimeout refuses <= 0.
    "join_timeout": _none_or(_whole(1, 600)),
    "last_call_timeout": _none_or(_whole(1, 30)),
    "close_timeout": _none_or(_whole(1, 30)),
    "heartbeat_timeout": _none_or(_whole(1, 5)),
    # The keep-alive period and the missed beats after which a node is dead; 0 would make
    # every node dead at once.
    "keep_alive_interval": _whole(1, 5),
    "keep_alive_max_attempt": _whole(1, 3, ""),
    "read_timeout": _whole(1, 60),
}

RDZV_OPTIONS: Mapping[str, Mapping[str, _Check]] = {
    "c10d": {
        **_DYNAMIC_OPTIONS,
        "store_type": _one_of("tcp", "file"),
        "is_host": _boolean,
    },
    "etcd-v2": {
        **_DYNAMIC_OPTIONS,
        "protocol": _one_of("http", "https"),
        "ssl_cert": _text,
        "ssl_cert_key": _text,
        "ca_cert": _text,
    },
    "etcd": {
        "timeout": _whole(1, 600),
        "last_call_timeout": _whole(0, 30),
        "etcd_prefix": _text,
        "protocol": _one_of("http", "https", fold=False),
        "cert": _text,
        "key": _text,
        "cacert": _text,
    },
    "static": {
        "rank": _whole(0, 0, ""),
        "timeout": _whole(1, 900),
    },
}
"""The options each of torch 2.13's own rendezvous backends reads, with their checks."""


def rdzv_options(backend: str, options: Mapping[str, object]) -> None:
    """Check ``options`` for one of torch's own backends; any other backend's are its own.

    A backend registered under another name (torch's handler registry) gets every option
    as given: what it reads is its own business.

    Raises:
        ValueError, TypeError: an option the backend does not read (the message lists
            those it does), or a value it would refuse or misread, named with its option.
    """
    known = RDZV_OPTIONS.get(backend)
    if known is None:
        return
    for key, value in options.items():
        check = known.get(key)
        if check is None and key == "timeout":
            check = _ignored_timeout(backend)
        if check is None:
            raise ValueError(
                f"{key!r} is not an option of torch's {backend} rendezvous backend, which "
                f"reads {', '.join(sorted(known))}: fix the name or drop it"
            )
        check(key, value)


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


def _items(value: object, what: str, example: str) -> list[object]:
    """The items of ``"a,b"`` text or of a collection; a lone int or str item is refused."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        return list(value)
    raise TypeError(f"{value!r} is not a collection of {what}; e.g. {example}")


def signals(value: object) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGINT"`` to signals, torch's names (``SIGTERM``, not ``TERM`` or 15).

    An empty string handles none. torch looks each name up with ``getattr(signal, name)``
    and only logs a warning for one it cannot resolve; we refuse it instead.

    Raises:
        ValueError: not a signal name, or SIGKILL/SIGSTOP (which cannot be handled).
    """
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a str like {DEFAULT_SIGNALS_TO_HANDLE!r}")
    found: list[signal.Signals] = []
    for item in _items(value, "signal names", DEFAULT_SIGNALS_TO_HANDLE):
        assert isinstance(item, str)
        sig = getattr(signal, item, None) if item.startswith("SIG") else None
        if not isinstance(sig, signal.Signals):
            guess = getattr(signal, f"SIG{item.upper()}", None)
            hint = f"write {guess.name!r}" if isinstance(guess, signal.Signals) else None
            raise ValueError(
                f"{value!r}: {item!r} is not a signal name; "
                f"{hint or 'use names such as ' + repr(DEFAULT_SIGNALS_TO_HANDLE)}"
            )
        if sig in _UNCATCHABLE:
            raise ValueError(f"{value!r}: {sig.name} cannot be handled; leave it out")
        if sig not in found:
            found.append(sig)
    return tuple(found)


def rank_filter(value: object, nprocs: int | None = None) -> frozenset[int] | None:
    """Local ranks whose console output is shown: ``"0,2"`` or ``{0, 2}``; empty/None: all."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    ranks: set[int] = set()
    for item in _items(value, "local ranks", "{0, 1}"):
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
    for item in _items(value, "global ranks", "{0, 8}"):
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


def exit_codes(value: object) -> frozenset[int]:
    """Exit codes ``"2,3"`` or ``{2, 3}``: 1..255, or ``-N`` for "killed by signal N"."""
    codes: set[int] = set()
    for item in _items(value, "exit codes", "{2, 3}"):
        try:
            code = _integer(item)
        except ValueError:
            raise ValueError(
                f"{value!r} is not a comma-separated list of exit codes (e.g. 2,3)"
            ) from None
        if code == 0:
            raise ValueError(f"{value!r}: 0 is success, not a failing exit code")
        if not -signal.NSIG < code <= 255:
            raise ValueError(f"{value!r}: {code} is not an exit code (1..255, or -N for signal N)")
        codes.add(code)
    return frozenset(codes)
