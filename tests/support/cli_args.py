"""The command line of ``aioelastic-run`` parsed in this process, as the launcher parses it.

A test gives the flags (and the ``PET_*`` environment); the training script and its
arguments follow them. What the launcher refuses comes back as the text the user reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from aioelastic import LaunchConfig
from aioelastic._cli._cli_parser import parse_args
from aioelastic._cli._cli_plan import CommandLine, config_from_args

#: The training script and its own arguments, after the flags of every parsed command line.
SCRIPT_ARGS = ["train.py", "--lr", "0.1"]


def launch(
    argv: list[str], environ: Mapping[str, str] | None = None, **kw: Any
) -> tuple[LaunchConfig, CommandLine]:
    """What the launcher makes of ``argv`` (its flags) and ``environ``: config and command."""
    env = {} if environ is None else dict(environ)
    return config_from_args(parse_args([*argv, *SCRIPT_ARGS], env), env, **kw)


def config(argv: list[str], environ: Mapping[str, str] | None = None, **kw: Any) -> LaunchConfig:
    """The launch config of ``argv`` and ``environ``."""
    return launch(argv, environ, **kw)[0]


def command(argv: list[str], environ: Mapping[str, str] | None = None) -> CommandLine:
    """The command ``argv`` and ``environ`` run in each worker."""
    return launch(argv, environ)[1]


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str], **kw: Any) -> str:
    """Why the command line is refused: argparse's error (exit 2) or the launch's ValueError."""
    capsys.readouterr()
    try:
        launch(argv, **kw)
    except ValueError as e:
        return str(e)
    except SystemExit as e:
        code = e.code
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith("usage: aioelastic-run")
        return err
    raise AssertionError(f"{argv} was accepted")
