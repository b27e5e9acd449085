"""Where things are: the repository root and the child programs of the tests."""

from __future__ import annotations

from pathlib import Path

#: The repository root: child programs run there, so ``-m tests.children...`` resolves.
REPO = Path(__file__).resolve().parents[2]
#: ``tests/children``: the child programs, for those run as scripts (``python <path>``).
CHILDREN = REPO / "tests" / "children"
