"""The house's measures: sizes and counts that keep the package readable, checked.

Each bound is one a reader meets: a class one can hold in mind, a function that fits a
screen, a room one can list at a glance, a setting written in few places, cleanup that
catches everything only where a comment says why. `tests/package/test_layers.py` keeps the
order of the layers and rooms; this file keeps their size.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "aioelastic"
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"


def _sources(root: Path) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _lines(node: ast.AST) -> int:
    assert isinstance(node, ast.stmt)
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def _defined(root: Path, kinds: tuple[type[ast.AST], ...]) -> Iterator[tuple[str, int]]:
    """``(where, lines)`` of every definition of ``kinds`` under ``root``, nested ones too."""
    for path, tree in _sources(root):
        for node in ast.walk(tree):
            if isinstance(node, kinds):
                assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                yield f"{path.relative_to(REPO)}:{node.lineno} {node.name}", _lines(node)


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def test_the_agent_class_fits_in_mind() -> None:
    sizes = dict(_defined(PACKAGE / "_elastic" / "agent", (ast.ClassDef,)))
    (agent,) = [lines for where, lines in sizes.items() if where.endswith(" LocalElasticAgent")]
    assert agent < 400


def test_no_elastic_class_over_300_lines_and_no_function_over_60() -> None:
    elastic = PACKAGE / "_elastic"
    classes = sorted(w for w, n in _defined(elastic, (ast.ClassDef,)) if n > 300)
    functions = sorted(w for w, n in _defined(elastic, FUNCTIONS) if n > 60)
    assert classes == []
    assert functions == []


def test_no_command_line_function_over_60_lines() -> None:
    assert sorted(w for w, n in _defined(PACKAGE / "_cli", FUNCTIONS) if n > 60) == []


def test_the_group_context_module_holds_its_lifecycle_and_little_else() -> None:
    assert len((PACKAGE / "_core" / "group" / "_pcontext.py").read_text().splitlines()) < 450


def test_no_room_over_12_files() -> None:
    # A room one can list at a glance; a thirteenth module means a new room.
    rooms = {
        str(folder.relative_to(REPO)): len(list(folder.glob("*.py")))
        for folder in [PACKAGE, *PACKAGE.rglob("*")]
        if folder.is_dir() and folder.name != "__pycache__"
    }
    assert {room: n for room, n in rooms.items() if n > 12} == {}


@pytest.mark.parametrize("setting", ["stop_leader_first", "ranks_filter", "grace_period"])
def test_a_setting_is_written_in_few_places(setting: str) -> None:
    # Defined, parsed, used and documented once each; a setting on many lines is one that
    # every layer re-lists, and the next option would be added in six files.
    lines = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if setting in line
    ]
    assert len(lines) <= 10, lines


def test_everything_is_caught_only_where_a_comment_says_why() -> None:
    # `except BaseException` catches cancellation and KeyboardInterrupt too: cleanup belongs
    # in exit stacks and `finally`, and the few places that must record or hand on any
    # exception say why next to the clause (on it, or in the comment lines just before).
    found, silent = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            if re.match(r"\s*except BaseException\b", line):
                where = f"{path.relative_to(REPO)}:{index + 1}"
                found.append(where)
                before = lines[max(0, index - 3) : index]
                inside = lines[index + 1 : index + 3]
                if "#" not in line and not any(
                    s.strip().startswith("#") for s in [*before, *inside]
                ):
                    silent.append(where)
    assert len(found) <= 10, found
    assert silent == []


def test_no_test_file_over_600_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in sorted(TESTS.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert long == {}


def test_the_tests_mirror_the_package() -> None:
    # A test file lives in the folder of the layer and room it tests (tests/core/start for
    # aioelastic/_core/start), or in one of the folders that are not a part of the package.
    places = {
        tuple(part.lstrip("_") for part in folder.relative_to(PACKAGE).parts)
        for folder in PACKAGE.rglob("*")
        if folder.is_dir() and folder.name != "__pycache__"
    }
    other = {"package", "benchmarks", "support", "children"}
    misplaced = [
        str(path.relative_to(REPO))
        for path in sorted(TESTS.rglob("test_*.py"))
        if (folder := path.parent.relative_to(TESTS).parts) not in places
        and not (folder and folder[0] in other)
    ]
    assert misplaced == []


def _helpers() -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module-level functions of tests and benchmarks that are not tests themselves."""
    for root in (TESTS, BENCHMARKS):
        for path, tree in _sources(root):
            if "children" in path.parts:
                continue  # programs run as workers: each is its own main
            for node in tree.body:
                if isinstance(node, FUNCTIONS) and not node.name.startswith("test_"):
                    yield f"{path.relative_to(REPO)}:{node.lineno} {node.name}", node


def _shape(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's body without its name, docstring and the names it binds."""
    body = node.body[1:] if ast.get_docstring(node) else node.body
    return "\n".join(ast.dump(statement) for statement in body)


def test_every_helper_is_defined_once_across_tests_and_benchmarks() -> None:
    by_shape: dict[str, list[str]] = {}
    by_name: dict[str, list[str]] = {}
    for where, node in _helpers():
        if len(node.body) >= 3:
            by_shape.setdefault(_shape(node), []).append(where)
        by_name.setdefault(node.name, []).append(where)
    copies = [" = ".join(places) for places in by_shape.values() if len(places) > 1]
    assert copies == [], "\n".join(copies)
    for helper in ("free_port", "wait_gone", "ready_barrier"):
        assert len(by_name.get(helper, [])) <= 1, by_name[helper]


#: Where a FIFO may be made directly: each side's one helper (benchmarks never import
#: tests, and their barrier counts one byte per worker with nothing but the standard
#: library, where the tests' reads ``ready`` lines with a timeout), and a test whose FIFO is
#: the hostile file under test rather than a way to wait.
FIFO_MAKERS = {
    "tests/support/waits.py",
    "benchmarks/programs/_ready.py",
    "tests/children/errors.py",
    "tests/package/test_house.py",
}


def test_fifos_are_made_by_one_helper() -> None:
    raw = [
        f"{path.relative_to(REPO)}:{number}"
        for root in (TESTS, BENCHMARKS)
        for path in sorted(root.rglob("*.py"))
        if str(path.relative_to(REPO)) not in FIFO_MAKERS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "os.mkfifo(" in line
    ]
    assert raw == [], raw
