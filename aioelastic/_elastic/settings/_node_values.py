"""The parsers of node, rendezvous and agent values, shared by the command line and the API.

The values only an elastic job has (how many nodes, the rendezvous endpoint and options, the
signals the agent handles, the exit codes it restarts on, its shutdown timeout): one
parser each, in the manner of :mod:`aioelastic._core.process._values` (which holds the group's own
values and the shared helpers), used by `LaunchConfig`, `WorkerSpec`, the agent's config and
``aioelastic-run``'s flags. No torch in this module.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Mapping
from typing import Any

from ..._core.process._values import PORT_DIGITS, duration, integer, positive_int, split_items

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DEFAULT_SIGNALS_TO_HANDLE",
    "RDZV_OPTIONS",
    "SHUTDOWN_TIMEOUT_ENV",
    "endpoint",
    "exit_codes",
    "host",
    "nnodes",
    "node_range",
    "rdzv_backend",
    "rdzv_conf",
    "rdzv_options",
    "shutdown_timeout",
    "signals",
]


DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
_HOST = re.compile(r"[\w.:-]+")
_INTEGER = re.compile(r"[+-]?[0-9]+")


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
        if not PORT_DIGITS.fullmatch(rest) or int(rest) > 65535:
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


#: The backends whose endpoint may name several servers of one cluster (etcd's members).
LIST_ENDPOINT_BACKENDS = frozenset({"etcd", "etcd-v2"})


def endpoints(value: object, backend: str) -> list[str]:
    """The ``--rdzv-endpoint`` of ``backend`` as a list of ``HOST[:PORT]`` texts.

    The etcd backends take several members of one cluster, ``h1:2379,h2:2379``: a node
    connects to the first that answers, and the etcd client learns the others from it
    (so a member lost later is not missed either). Every other backend takes one.

    Raises:
        ValueError: a member is not ``HOST[:PORT]``, or a list is given to a backend with
            one store.
    """
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a str 'HOST:PORT'")
    members = [member.strip() for member in value.split(",")]
    if len(members) > 1 and backend not in LIST_ENDPOINT_BACKENDS:
        raise ValueError(
            f"{value!r} names several servers, and the {backend!r} rendezvous has one: give "
            "one HOST:PORT (a list is for the etcd backends, each a member of one cluster)"
        )
    if len(members) > 1 and not all(members):
        raise ValueError(f"{value!r} has an empty member; give HOST:PORT,HOST:PORT")
    for member in members:
        endpoint(member)
    return members


def host(value: object) -> str:
    """A host name, an IPv4 or an IPv6 address (no brackets, no port): where to bind or be seen."""
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a host name or address")
    if not _HOST.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a host name or address; give e.g. 127.0.0.1, node0 or ::1"
        )
    return value


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
        value: the text (one pair of quotes around it removed), or a mapping of option
            names to values.
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
        text = value.strip()
        if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
            # Quotes a shell would have removed, kept by a command given as a list
            # (torch's own tests pass --rdzv-conf='join_timeout=5,...' so).
            text = text[1:-1]
        for item in text.split(",") if text.strip() else ():
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
# with the default as if nothing was said. tests/elastic/rendezvous/test_rendezvous.py reads
# these names out of torch's own source, so a torch that reads other options fails there.
_Check = Callable[[str, object], None]


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


# -- lists ---------------------------------------------------------------------------


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
    for item in split_items(value, "signal names", DEFAULT_SIGNALS_TO_HANDLE):
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


def exit_codes(value: object) -> frozenset[int]:
    """Exit codes ``"2,3"`` or ``{2, 3}``: 1..255, or ``-N`` for "killed by signal N"."""
    codes: set[int] = set()
    for item in split_items(value, "exit codes", "{2, 3}"):
        try:
            code = integer(item)
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
