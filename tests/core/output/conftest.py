"""Fixtures of the output room's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.log_supervisor import Supervisor


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
