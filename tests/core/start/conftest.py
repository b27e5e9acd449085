"""Fixtures of the start room's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aioelastic._core.process import _platform
from aioelastic._core.start._watchdog import watchdog


@pytest.fixture
def fresh_watchdog(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A watchdog started for this test (with or without pidfds), stopped after it."""
    watchdog.stop()
    if getattr(request, "param", "pidfd") == "waitid-thread":
        monkeypatch.setenv(_platform.NO_PIDFD_ENV, "1")
    _platform.pidfd_supported.cache_clear()
    yield
    watchdog.stop()
    monkeypatch.delenv(_platform.NO_PIDFD_ENV, raising=False)
    _platform.pidfd_supported.cache_clear()
