"""Fixtures of the elastic layer's tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """A directory workers write what they saw to (``seen-<restart>-<rank>.json``, ...)."""
    path = tmp_path / "out"
    path.mkdir()
    return path
