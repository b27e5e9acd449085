"""The public surface is one list, and it is what the docs present.

``aioelastic._EXPORTS`` is that list (public name -> the private module defining it);
``__all__`` and the lazy attributes come from it, and the imports written for type
checkers must name the same. Every name the README and docs/ present as
``aioelastic.<name>`` or ``from aioelastic import <name>``, and every error type they name,
must be exported, so that what the docs show works.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest

import aioelastic
from tests.support.paths import REPO

pytestmark = pytest.mark.timeout(60)

INIT = REPO / "aioelastic" / "__init__.py"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: ``aioelastic.<name>`` in the docs that is not an attribute: the public submodules, and
#: the logger named ``aioelastic.errors``.
NOT_ATTRIBUTES = {"run", "timer", "stack_hook", "errors"}
#: Error types the docs name that are torch's, not ours.
TORCH_ERRORS = {"RendezvousConnectionError"}


def test_all_is_the_export_table() -> None:
    assert aioelastic.__all__ == list(aioelastic._EXPORTS)
    assert len(set(aioelastic.__all__)) == len(aioelastic.__all__)


@pytest.mark.parametrize("name", aioelastic.__all__)
def test_every_exported_name_resolves_to_its_module(name: str) -> None:
    module = importlib.import_module(aioelastic._EXPORTS[name], "aioelastic")
    value = getattr(aioelastic, name)
    assert value is getattr(module, name)
    if hasattr(value, "__module__"):
        assert value.__module__ == module.__name__, "the table names the defining module"


def test_the_imports_for_type_checkers_are_the_export_table() -> None:
    tree = ast.parse(INIT.read_text())
    checking = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    imported = {}
    for node in checking.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            # ``name as name``: an explicit re-export, which mypy --strict requires.
            assert alias.asname == alias.name, alias.name
            imported[alias.name] = "." * node.level + (node.module or "")
    assert imported == aioelastic._EXPORTS


def _presented() -> dict[str, list[str]]:
    """Each name the docs present as part of the package -> the files that do."""
    found: dict[str, list[str]] = {}
    for path in DOCS:
        text = path.read_text()
        names = set(re.findall(r"\baioelastic\.([A-Za-z]\w*)", text))
        for group in re.findall(r"from aioelastic import (\([^)]*\)|[^\n]+)", text):
            names.update(re.findall(r"\w+", group.split("#")[0]))
        names.update(re.findall(r"`([A-Z]\w*(?:Error|Exception))\b", text))
        for name in names - NOT_ATTRIBUTES - TORCH_ERRORS:
            if not hasattr(builtins, name):
                found.setdefault(name, []).append(path.name)
    return found


def test_every_name_the_docs_present_is_exported() -> None:
    missing = {n: files for n, files in _presented().items() if n not in aioelastic.__all__}
    assert missing == {}


def test_the_docs_check_fails_on_a_name_that_is_not_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Catch `NoSuchError`, or call `aioelastic.no_such_entry()`.\n"
        "```python\nfrom aioelastic import Std, not_there  # a comment\nconfig = 1\n```\n"
    )
    monkeypatch.setitem(globals(), "DOCS", [page])
    assert set(_presented()) == {"NoSuchError", "no_such_entry", "Std", "not_there"}
