"""``benchmarks/`` is in rooms, and imports only go down: programs, harness, measures, commands.

The worker programs (and the protocol they share with their drivers) are the bottom room:
workers import them. The harness runs whatever measures it is given, so it imports no
measure; the measures declare what runs on it; the commands at the top level put them
together. The training scripts run by ``torchrun`` import nothing from the project.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
ROOMS = {"programs": 0, "harness": 1, "measures": 2}
#: Modules at the top level: the commands (and the package's docstring).
COMMANDS = {"__init__", "__main__", "cpu_split", "resources"}
#: Run as scripts by the launchers under test: they must stand alone.
SCRIPTS = {"_gloo", "_trivial", "_multinode_job", "_slurm_job"}


def _room(module: str) -> int:
    parts = module.split(".")
    return ROOMS.get(parts[1], len(ROOMS)) if len(parts) > 1 else len(ROOMS)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every module of the project that the file imports, anywhere in it (all absolute)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module or "")
    return {m for m in found if m.split(".")[0] in ("benchmarks", "aioelastic", "workloads")}


def test_the_top_level_holds_only_the_commands_and_the_rooms() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == COMMANDS
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ROOMS)


def test_imports_go_only_to_the_same_room_or_a_lower_one() -> None:
    wrong = []
    for module, path in _modules().items():
        for imported in _imports(path):
            if imported.startswith("benchmarks.") and _room(imported) > _room(module):
                wrong.append(f"{module} imports {imported}")
    assert wrong == []


def test_the_scripts_run_by_the_launchers_import_nothing_from_the_project() -> None:
    programs = PACKAGE / "programs"
    for name in SCRIPTS:
        assert _imports(programs / f"{name}.py") == set(), name
