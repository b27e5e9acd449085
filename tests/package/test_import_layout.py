"""Who may import whom among the tests, the benchmarks and the shared workloads.

Code that both sides run lives in ``workloads/``; code that several test modules share lives
in a module of its own under ``tests/support/`` (``waits.py``, ``audit.py``, ...). So:

- ``benchmarks/`` and ``workloads/`` never import ``tests``, and ``workloads/`` never
  imports ``benchmarks``;
- a test module never imports another ``test_*`` module, nor ``conftest`` (pytest loads it
  itself; what it shares belongs in a module of its own);
- only the tests under ``tests/benchmarks/`` import ``benchmarks``: they test that code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO

#: The one test folder whose modules may import benchmark code: the code they test.
BENCHMARK_TESTS = "tests/benchmarks/"


def _module_name(path: Path) -> str:
    """``tests/children/core.py`` -> ``tests.children.core`` (``__init__`` is its package)."""
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str) -> set[str]:
    """Every module ``source`` (the module named ``module``) imports, anywhere in it.

    ``from a.b import c`` counts as importing both ``a.b`` and ``a.b.c`` (``c`` may be a
    module); relative imports are resolved against ``module``'s package.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level]
                base = ".".join([*package, base] if base else package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def problems(rel_path: str, source: str) -> list[str]:
    """What is wrong with the imports of the file at ``rel_path`` (relative to the root)."""
    path = Path(rel_path)
    top = path.parts[0]
    imports = imported_modules(source, _module_name(path))

    def under(package: str) -> list[str]:
        return sorted(m for m in imports if m == package or m.startswith(package + "."))

    found = []
    if top in ("benchmarks", "workloads") and under("tests"):
        found.append(f"{rel_path} imports {under('tests')}: move what it needs to workloads/")
    if top == "workloads" and under("benchmarks"):
        found.append(f"{rel_path} imports {under('benchmarks')}: workloads/ stands alone")
    if top == "tests":
        to_tests = [m for m in imports if m.split(".")[-1].startswith("test_")]
        if to_tests:
            found.append(
                f"{rel_path} imports the test module(s) {sorted(to_tests)}: move what they "
                "share to a module of its own under tests/ (not named test_*)"
            )
        to_conftest = [m for m in imports if "conftest" in m.split(".")]
        if to_conftest:
            found.append(
                f"{rel_path} imports {sorted(to_conftest)}: pytest loads conftest itself; "
                "move what it shares to a module of its own under tests/"
            )
        if not rel_path.startswith(BENCHMARK_TESTS) and under("benchmarks"):
            found.append(
                f"{rel_path} imports {under('benchmarks')}: only {BENCHMARK_TESTS} import "
                "benchmark code; shared workloads live in workloads/"
            )
    return found


def _sources() -> list[Path]:
    return sorted(
        path
        for top in ("tests", "benchmarks", "workloads")
        for path in (REPO / top).rglob("*.py")
        if ".venv" not in path.parts
    )


def test_tests_and_benchmarks_import_only_what_they_may() -> None:
    sources = _sources()
    assert any(p.parent.name == "benchmarks" for p in sources)
    assert any(p.parent.name == "workloads" for p in sources)
    found = [
        problem
        for path in sources
        for problem in problems(str(path.relative_to(REPO)), path.read_text())
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("rel_path", "source", "fragment"),
    [
        ("benchmarks/resources.py", "from tests.test_resources import f", "workloads/"),
        ("benchmarks/measures/x.py", "import tests.children.core", "workloads/"),
        ("workloads/cycles.py", "from benchmarks.harness import _run", "stands alone"),
        ("tests/test_a.py", "from tests.test_b import helper", "test module"),
        ("tests/test_a.py", "from . import test_b", "test module"),
        ("tests/test_a.py", "def f():\n    from tests import test_b", "test module"),
        ("tests/test_a.py", "from tests.conftest import _open_fds", "pytest loads conftest"),
        ("tests/waits.py", "from .conftest import MARK", "pytest loads conftest"),
        ("tests/test_a.py", "from benchmarks.measures._common import NAME", "only tests/"),
    ],
)
def test_each_forbidden_import_is_reported(rel_path: str, source: str, fragment: str) -> None:
    (problem,) = problems(rel_path, source)
    assert fragment in problem


@pytest.mark.parametrize(
    ("rel_path", "source"),
    [
        ("tests/test_a.py", "from tests.waits import wait_gone\nfrom tests.children import core"),
        ("tests/test_a.py", "from workloads.cycles import measure_cycles"),
        ("tests/benchmarks/test_report.py", "from benchmarks.harness._report import summarise"),
        ("benchmarks/resources.py", "from workloads.cycles import measure_cycles"),
        ("tests/children/faults.py", "from tests.children import core"),
    ],
)
def test_allowed_imports_pass(rel_path: str, source: str) -> None:
    assert problems(rel_path, source) == []
