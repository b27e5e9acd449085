"""Builders of a test group's arguments: one place for them, shared by the test modules."""

from __future__ import annotations

from typing import Any


def envs(n: int, **extra: str) -> dict[int, dict[str, str]]:
    """``envs`` for ``n`` ranks, each with ``extra`` (a copy per rank)."""
    return {rank: dict(extra) for rank in range(n)}


def ranks(n: int, *args: Any) -> dict[int, tuple[Any, ...]]:
    """``args`` for ``n`` ranks, each called with ``args``."""
    return {rank: args for rank in range(n)}
