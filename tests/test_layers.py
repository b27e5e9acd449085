"""The package's folders are its layers, and imports only go down; so do ``_core``'s rooms.

``aioelastic/_core`` (one group of worker processes: platform, launchers, exit watch,
bootstrap, logs, teardown, the group context) is the bottom layer; ``_compat``
(torch.multiprocessing-style ``spawn``/``launch``) builds on it; ``_elastic`` (the agent,
rendezvous, events, the launch API) on both; ``_cli`` (the command line's flags, parser and
plan) on all three; the public modules (``aioelastic``, ``aioelastic.run``,
``aioelastic.timer``) sit on top. Every import counts, including the ones inside
functions and under ``TYPE_CHECKING``: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parent.parent / "aioelastic"
LAYERS = {"_core": 0, "_compat": 1, "_elastic": 2, "_cli": 3}
TOP = len(LAYERS)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def _imports(module: str) -> set[str]:
    """Every aioelastic module that ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" for alias in node.names] + [source]
        else:
            continue
        for name in names:
            # `from pkg import name` names a module or an attribute of pkg: keep the longest
            # prefix that is a module.
            parts = name.split(".")
            while parts and ".".join(parts) not in MODULES:
                parts.pop()
            if parts and ".".join(parts) != module:
                found.add(".".join(parts))
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_module_is_in_a_layer() -> None:
    top = sorted(m for m in MODULES if _layer(m) == TOP)
    assert top == ["aioelastic", "aioelastic.run", "aioelastic.stack_hook", "aioelastic.timer"]


def test_imports_only_go_down_the_layers() -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(target) > _layer(module)
    )
    assert upward == []


def test_no_private_name_is_imported_from_another_layer() -> None:
    # What two layers share gets a public name in the lower one; a private name is the
    # business of its own layer only.
    crossing = []
    for module, path in MODULES.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source not in MODULES or _layer(source) == _layer(module):
                continue
            crossing += [
                f"{module} imports {source}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and f"{source}.{alias.name}" not in MODULES
            ]
    assert sorted(crossing) == []


def test_the_core_needs_no_other_layer() -> None:
    core = [m for m in MODULES if _layer(m) == LAYERS["_core"]]
    outside = sorted(
        f"{m} imports {t}" for m in core for t in GRAPH[m] if _layer(t) != LAYERS["_core"]
    )
    assert outside == []


#: The rooms of ``_core``, lowest first: a module imports only from its own room or a lower
#: one, so the order a worker's life is built in (the process and its values, what runs in
#: the child, reports, processes, output, the worker record, hangs, the group) shows in the
#: imports and stays that way.
CORE_ROOMS: list[tuple[str, set[str]]] = [
    (
        "the process and its values",
        {
            "_backend",
            "_console",
            "_exit_status",
            "_lazy_event",
            "_log_root",
            "_pace",
            "_platform",
            "_runtime",
            "_signals",
            "_status",
            "_std",
            "_subreaper",
            "_to_the_end",
            "_tty_readers",
            "_values",
        },
    ),
    (
        "the child's side",
        {
            "_bootstrap",
            "_error_file",
            "_forkserver_process",
            "_preload",
            "_result_pipe",
            "_script",
            "_stack_hook",
            "_watchdog_process",
        },
    ),
    ("reports", {"_errors", "_failures", "_record", "_results"}),
    (
        "processes: start and exit",
        {"_binary_start", "_exit_watch", "_forkserver", "_launchers", "_watchdog"},
    ),
    ("output", {"_frames", "_logs", "_output", "_stdin_router", "_terminal"}),
    ("the worker record and its teardown", {"_teardown", "_worker"}),
    ("hangs", {"_fifo", "_hangs", "_stacks", "_stall", "_timer_server"}),
    (
        "the group",
        {"_pcontext", "_preparing", "_settle", "_start_methods", "_starting", "_validate"},
    ),
]


def _core_room(module: str) -> int:
    short = module.removeprefix("aioelastic._core.")
    return next(i for i, (_, members) in enumerate(CORE_ROOMS) if short in members)


def test_every_core_module_is_in_one_room() -> None:
    core = {
        m.removeprefix("aioelastic._core.") for m in MODULES if m.startswith("aioelastic._core.")
    }
    placed = [name for _, members in CORE_ROOMS for name in members]
    assert sorted(placed) == sorted(core), "put a new _core module in one of CORE_ROOMS"


def test_imports_only_go_down_the_rooms_of_the_core() -> None:
    upward = sorted(
        f"{module} ({CORE_ROOMS[_core_room(module)][0]}) imports {target} "
        f"({CORE_ROOMS[_core_room(target)][0]})"
        for module, targets in GRAPH.items()
        if module.startswith("aioelastic._core.")
        for target in targets
        if target.startswith("aioelastic._core.") and _core_room(target) > _core_room(module)
    )
    assert upward == []


def test_no_import_cycle() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            # A package's __init__ is imported before any of its modules: that is order,
            # not a dependency loop, so an edge into a parent package is not followed.
            if module.startswith(target + "."):
                continue
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module)
    assert cycles == []


def test_layer_packages_import_nothing_when_imported() -> None:
    # A worker imports aioelastic._core._bootstrap, and with it every package on the way:
    # those __init__ files must stay empty of imports so that a worker pays for nothing else.
    for layer in LAYERS:
        tree = ast.parse((PACKAGE / layer / "__init__.py").read_text())
        assert not [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)], layer


def test_error_types_unpickle_from_their_old_module_paths() -> None:
    # A pickle names a class by module path; these are the paths an earlier version wrote.
    import pickle

    import aioelastic
    from aioelastic._compat._old_paths import OLD_PATHS

    assert pickle.loads(b"caioelastic._errors\nChildFailedError\n.") is aioelastic.ChildFailedError
    assert pickle.loads(b"caioelastic._spawn\nProcessRaisedException\n.") is (
        aioelastic.ProcessRaisedException
    )
    old = pickle.dumps(aioelastic.SignalReceived(15), protocol=0).replace(
        b"aioelastic._core._signals", b"aioelastic._signals"
    )
    assert b"aioelastic._signals" in old
    assert isinstance(pickle.loads(old), aioelastic.SignalReceived)
    for old_path, new_path in OLD_PATHS.items():
        assert importlib.import_module(old_path) is importlib.import_module(new_path)


def test_failures_pickled_when_they_lived_in_core_errors_still_load() -> None:
    # ProcessFailure, ChildFailedError and RunProcsResult pickled before the error types
    # got modules of their own name aioelastic._core._errors (the results' failures too).
    import pickle

    import aioelastic

    failure = aioelastic.ProcessFailure(0, 42, 1, "<N/A>", "boom", 1.5)
    error = aioelastic.ChildFailedError("job", {0: failure})
    result = aioelastic.RunProcsResult(failures={0: failure}, stderrs={0: ""})
    for value in (failure, error, result):
        new = pickle.dumps(value, protocol=0)
        assert b"aioelastic._core._failures" in new
        old = new.replace(b"aioelastic._core._failures", b"aioelastic._core._errors")
        loaded = pickle.loads(old)
        assert type(loaded) is type(value)
        assert repr(loaded) == repr(value) or str(loaded) == str(value)
