"""Fixtures of the output room's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.log_supervisor import Supervisor
from tests.support.terminal import Terminal


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Any]:
    """``supervise(config, read_stdout=True)`` -> a started :class:`Supervisor`."""
    started: list[Supervisor] = []

    def start(config: dict[str, Any], **options: bool) -> Supervisor:
        sup = Supervisor(tmp_path, config, **options)
        started.append(sup)
        return sup

    yield start
    for sup in started:
        sup.close()


@pytest.fixture
def terminal() -> Iterator[type[Terminal]]:
    """``terminal(argv, columns=, lines=, launcher=)`` -> a started :class:`Terminal`,
    closed after the test (test_tty_readers.py has a ``terminal`` of its own: a bare pty)."""
    started: list[Terminal] = []

    class Started(Terminal):
        def __init__(self, argv: list[str], **options: Any) -> None:
            super().__init__(argv, **options)
            started.append(self)

    yield Started
    for term in started:
        term.close()
