"""Function workers of the workloads.

Kept apart from the measuring code so that a spawned worker, which imports the module of
its function, imports nothing but this small module.
"""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Return ``a + b``: a worker that does nothing measurable but return a value."""
    return a + b
