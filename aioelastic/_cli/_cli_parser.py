"""The parser of ``aioelastic-run``'s command line: argparse over the flag table.

`parse_args` turns argv into an `argparse.Namespace` whose values are already typed (each
flag's text goes through its converter in `._cli_flags`), with ``PET_*`` variables as the
defaults, and what a scheduler's environment gives (`.schedulers`) for the flags neither
set; no torch, and no I/O but a look at the ``--log-dir`` path. A bad value, from the
command line or a ``PET_*`` variable, is argparse's usage error: the usage line, the
message naming the flag, exit status 2. `usage_error` ends the same way for what is found
later (combinations of flags, the launch API's own checks).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ._cli_flags import ENV_PREFIX, FLAGS, TORCH_PREFIX_ENV, Flag
from .schedulers._derive import derive

__all__ = ["build_parser", "parse_args", "usage_error"]


def _switch(value: str) -> bool:
    """torch's ``check_env`` reads ``bool(int(value))``; words are accepted too."""
    text = value.strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off", ""):
        return False
    return bool(int(text))


class _Parser(argparse.ArgumentParser):
    """argparse with our prog name; errors exit 2 with usage, like torchrun's."""


def build_parser(
    environ: Mapping[str, str] | None = None, *, defaults: bool = True
) -> argparse.ArgumentParser:
    """The parser, with defaults taken from ``PET_*`` variables in ``environ``.

    Args:
        environ: the environment to read overrides from (default ``os.environ``).
        defaults: False for a parser that leaves a flag not given out of its namespace
            (what the command line itself says).

    Returns:
        An ``argparse.ArgumentParser`` for ``aioelastic-run``.

    Raises:
        ValueError: a ``PET_*`` variable holds a value its flag does not accept (the
            message names the variable).
    """
    if environ is None:
        environ = os.environ
    parser = _Parser(
        prog="aioelastic-run",
        description="Launch a training script on one or more nodes: a drop-in replacement "
        "for torchrun (same flags, same defaults, same worker environment).",
        epilog=f"Every flag can also be set in the environment as {ENV_PREFIX}<FLAG>, e.g. "
        f"{ENV_PREFIX}NPROC_PER_NODE=4 (the command line wins). Flags marked [aioelastic] "
        "are not torchrun's. Exit status: 0 on success; the root cause's exit code when a "
        "worker fails (128+N when signal N killed it); 128+N when the launcher is stopped "
        "by signal N.",
    )
    for flag in FLAGS:
        default = _env_default(flag, environ) if defaults else argparse.SUPPRESS
        help_text = f"[aioelastic] {flag.help}" if flag.ours else flag.help
        help_text = help_text.replace("%", "%%")
        if flag.is_switch:
            parser.add_argument(
                *flag.names, dest=flag.dest, action="store_true", default=default, help=help_text
            )
        else:
            assert flag.convert is not None
            parser.add_argument(
                *flag.names,
                dest=flag.dest,
                type=flag.convert,
                default=default,
                choices=flag.choices,
                metavar=flag.metavar,
                help=help_text,
            )
    parser.add_argument(
        "training_script",
        help="The script (or module with -m, or executable with --no-python) every worker "
        "runs, followed by its own arguments.",
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _env_default(flag: Flag, environ: Mapping[str, str]) -> Any:
    raw = environ.get(flag.env_var)
    if flag.dest == "log_line_prefix_template" and raw is None:
        raw = environ.get(TORCH_PREFIX_ENV)
    if raw is None:
        return flag.default
    try:
        value: Any = _switch(raw) if flag.convert is None else flag.convert(raw)
    except (ValueError, argparse.ArgumentTypeError) as e:
        why = "not 0 or 1" if flag.is_switch else str(e)
        raise ValueError(
            f"{flag.env_var}={raw!r} (for {flag.names[0]}): {why}; fix or unset {flag.env_var}"
        ) from None
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(
            f"{flag.env_var}={raw!r} is not one of {', '.join(flag.choices)} "
            f"(for {flag.names[0]}); fix or unset {flag.env_var}"
        )
    return value


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse a command line (``sys.argv[1:]`` by default); exits 2 on a usage error.

    Args:
        argv: the arguments after the program name.
        environ: where ``PET_*`` overrides are read (default ``os.environ``).

    Returns:
        The namespace, one attribute per flag (see `FLAGS`) plus ``training_script`` and
        ``training_script_args``, and ``derived``: what a scheduler's environment (a SLURM
        step, a Kubernetes pod) gave for the flags neither the command line nor a
        ``PET_*`` variable set (`.schedulers._derive.Derived`), already in the flags'
        attributes.
    """
    if environ is None:
        environ = os.environ
    if argv is None:
        argv = sys.argv[1:]
    try:
        parser = build_parser(environ)
    except ValueError as e:
        # A bad PET_* variable: the usage of the parser without the environment.
        usage_error(str(e))
    args = parser.parse_args(argv)
    said = set(vars(build_parser({}, defaults=False).parse_args(argv)))
    said |= {flag.dest for flag in FLAGS if flag.env_var in environ}
    try:
        args.derived = derive(args, environ, said)
    except ValueError as e:
        usage_error(str(e))
    for dest, value in args.derived.values.items():
        setattr(args, dest, value)
    return args


def usage_error(message: str) -> NoReturn:
    """Exit 2 with the usage line and ``message``, as argparse does for a bad flag.

    For the checks that involve several flags (made after parsing) and a bad ``PET_*``
    variable, so that every command-line mistake ends the same way.
    """
    build_parser({}).error(message)
