"""The process-wide runtime: one place for the state, one at-fork hook, a fresh child."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import aioelastic

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(aioelastic.__file__).parent


def test_a_forked_child_inherits_none_of_the_process_wide_state() -> None:
    # A real supervisor with everything in use (threads, watchdog, fork server, locks
    # held by another thread) forks; the child checks itself and reports each check.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.children.runtime"],
        capture_output=True,
        timeout=90,
        check=False,
    )
    lines = proc.stdout.decode().splitlines()
    assert lines, proc.stderr.decode()
    checks = json.loads(lines[-1])
    failed = [name for name, passed in checks.items() if not passed]
    assert not failed, f"in the forked child: {failed}\n{proc.stderr.decode()}"
    assert proc.returncode == 0, proc.stderr.decode()
    # The child's own console wrote (its writer thread was made anew), after the parent's.
    assert lines[:2] == ["parent console line", "child console line"]
    assert len(checks) > 10


def _calls_register_at_fork(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "register_at_fork":
            return True
        if isinstance(node, ast.Name) and node.id == "register_at_fork":
            return True
        if isinstance(node, ast.alias) and node.name == "register_at_fork":
            return True
    return False


def test_only_the_runtime_registers_at_fork_handlers() -> None:
    # Process-wide state has one owner: a module with state a forked child must drop
    # registers a hook with aioelastic._core.process._runtime.forget_in_child instead.
    modules = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "_core" / "process" / "_runtime.py" in modules
    registering = [p.relative_to(PACKAGE).as_posix() for p in modules if _calls_register_at_fork(p)]
    assert registering == ["_core/process/_runtime.py"]
    source = (PACKAGE / "_core" / "process" / "_runtime.py").read_text()
    assert source.count("os.register_at_fork(") == 1
