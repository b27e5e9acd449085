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

from tests.support.paths import REPO

pytestmark = pytest.mark.timeout(60)

PACKAGE = REPO / "aioelastic"
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


#: The rooms of ``_core``, lowest first, each a sub-package (``aioelastic/_core/<room>/``,
#: its ``__init__`` saying what it holds): a module imports only from its own room or a
#: lower one, so the order a worker's life is built in (the process and its values, the
#: async utilities, what runs in the child, reports, starting processes and seeing them exit,
#: output, the worker record and its teardown, hangs, the group) shows in the imports and
#: stays that way.
CORE_ROOMS = [
    "process",
    "aio",
    "child",
    "reports",
    "start",
    "output",
    "worker",
    "hangs",
    "group",
]
CORE = "aioelastic._core"


def _core_room(module: str) -> int:
    """The room of ``aioelastic._core.<room>`` or of a module in it, by its order."""
    return CORE_ROOMS.index(module.split(".")[2])


def test_every_core_module_is_in_one_room() -> None:
    # A module directly in _core, in a folder that is not a room, or one folder down too
    # many, fails: put it in the room it belongs to (or add the room, in its place).
    misplaced = sorted(
        m
        for m in MODULES
        if m.startswith(CORE + ".")
        and not (m.split(".")[2] in CORE_ROOMS and len(m.split(".")) in (3, 4))
    )
    assert misplaced == [], "put a new _core module in one of CORE_ROOMS"
    folders = [p.name for p in (PACKAGE / "_core").iterdir() if p.is_dir()]
    assert sorted(f for f in folders if f != "__pycache__") == sorted(CORE_ROOMS)
    for room in CORE_ROOMS:
        init = PACKAGE / "_core" / room / "__init__.py"
        assert init.is_file(), f"{room} is a package of its own (setuptools finds it so)"
        assert ast.get_docstring(ast.parse(init.read_text())), f"say what {room} holds"


def test_imports_only_go_down_the_rooms_of_the_core() -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith(CORE + ".")
        for target in targets
        if target.startswith(CORE + ".") and _core_room(target) > _core_room(module)
    )
    assert upward == []


#: The rooms of ``_elastic``, lowest first, as ``_core``'s: what the agent tells the world
#: (events, narration, metrics), the settings and their parsers, the store as the agent
#: calls it, the job channel the nodes of a round talk through, one node's rendezvous, the
#: agent and its attempts, and the launch API on top.
ELASTIC_ROOMS = ["observe", "settings", "store", "channel", "rendezvous", "agent", "launch"]
ELASTIC = "aioelastic._elastic"


def _elastic_room(module: str) -> int:
    return ELASTIC_ROOMS.index(module.split(".")[2])


def test_every_elastic_module_is_in_one_room() -> None:
    misplaced = sorted(
        m
        for m in MODULES
        if m.startswith(ELASTIC + ".")
        and not (m.split(".")[2] in ELASTIC_ROOMS and len(m.split(".")) in (3, 4))
    )
    assert misplaced == [], "put a new _elastic module in one of ELASTIC_ROOMS"
    folders = [p.name for p in (PACKAGE / "_elastic").iterdir() if p.is_dir()]
    assert sorted(f for f in folders if f != "__pycache__") == sorted(ELASTIC_ROOMS)
    for room in ELASTIC_ROOMS:
        init = PACKAGE / "_elastic" / room / "__init__.py"
        assert init.is_file(), f"{room} is a package of its own (setuptools finds it so)"
        assert ast.get_docstring(ast.parse(init.read_text())), f"say what {room} holds"


def test_imports_only_go_down_the_rooms_of_the_elastic_layer() -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith(ELASTIC + ".")
        for target in targets
        if target.startswith(ELASTIC + ".") and _elastic_room(target) > _elastic_room(module)
    )
    assert upward == []


def test_every_import_of_the_package_names_one_of_its_modules() -> None:
    # An old module path still imports (see _compat/_old_paths.py), for what earlier
    # versions wrote down; the package's own code uses the paths its modules have.
    stale = []
    for module, path in MODULES.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                sources = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                sources = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                continue
            stale += [
                f"{module} imports {source}"
                for source in sources
                if source.split(".")[0] == "aioelastic" and source not in MODULES
            ]
    assert stale == []


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
    # A worker imports aioelastic._core.child._bootstrap, and with it every package on the
    # way (a room's package too, and a module imports from other rooms): those __init__
    # files must stay empty of imports so that a worker pays for nothing else.
    packages = [
        *LAYERS,
        *(f"_core/{room}" for room in CORE_ROOMS),
        *(f"_elastic/{room}" for room in ELASTIC_ROOMS),
    ]
    for package in packages:
        tree = ast.parse((PACKAGE / package / "__init__.py").read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)], (
            package
        )


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
        b"aioelastic._core.aio._signals", b"aioelastic._signals"
    )
    assert b"aioelastic._signals" in old
    assert isinstance(pickle.loads(old), aioelastic.SignalReceived)
    for old_path, new_path in OLD_PATHS.items():
        assert importlib.import_module(old_path) is importlib.import_module(new_path)


def test_failures_pickled_when_they_lived_in_core_errors_still_load() -> None:
    # ProcessFailure, ChildFailedError and RunProcsResult pickled before the error types
    # got modules of their own name aioelastic._core._errors (the results' failures too);
    # pickled before _core had rooms, aioelastic._core._failures and ._results.
    import pickle

    import aioelastic

    failure = aioelastic.ProcessFailure(0, 42, 1, "<N/A>", "boom", 1.5)
    error = aioelastic.ChildFailedError("job", {0: failure})
    result = aioelastic.RunProcsResult(failures={0: failure}, stderrs={0: ""})
    for value in (failure, error, result):
        new = pickle.dumps(value, protocol=0)
        assert b"aioelastic._core.reports._failures" in new
        for failures in (b"aioelastic._core._errors", b"aioelastic._core._failures"):
            old = new.replace(b"aioelastic._core.reports._failures", failures).replace(
                b"aioelastic._core.reports._results", b"aioelastic._core._results"
            )
            assert b"aioelastic._core.reports" not in old
            loaded = pickle.loads(old)
            assert type(loaded) is type(value)
            assert repr(loaded) == repr(value) or str(loaded) == str(value)


#: Modules made since _core had rooms. GroupOptions is new; start_processes and
#: run_processes moved from _pcontext, so a pickle of either function (by reference, unlike
#: the results and errors this guards) no longer loads from an older path.
NEW = {f"{CORE}.group._options", f"{CORE}.group._processes"}


def _old_core_paths() -> dict[str, str]:
    """Module path -> the path it had before ``_core`` had rooms, where one is kept."""
    from aioelastic._compat._old_paths import OLD_PATHS

    return {new: old for old, new in OLD_PATHS.items() if old.startswith(CORE + "._")}


def test_every_core_module_a_pickle_may_name_kept_its_old_path() -> None:
    # A pickle names a class or a function by its module: the modules that define a public
    # name or an exception type keep the path they had before _core had rooms.
    import inspect

    import aioelastic

    named = {getattr(aioelastic, name).__module__ for name in aioelastic.__all__}
    for module in MODULES:
        if module.startswith(CORE + ".") and len(module.split(".")) == 4:
            public_errors = [
                c
                for name, c in vars(importlib.import_module(module)).items()
                if not name.startswith("_")
                and inspect.isclass(c)
                and issubclass(c, BaseException)
                and c.__module__ == module
            ]
            if public_errors:
                named.add(module)
    old = _old_core_paths()
    assert sorted(m for m in named if m.startswith(CORE + ".") and m not in {*old, *NEW}) == []


def _with_old_core_paths(data: bytes) -> bytes:
    for new, old in _old_core_paths().items():
        data = data.replace(f"{new}\n".encode(), f"{old}\n".encode())
    return data


def test_what_was_pickled_by_an_old_core_path_still_loads() -> None:
    # Written as an earlier version wrote it: every module path the pickle names is the one
    # it had before _core had rooms. The same classes and functions come back.
    import pickle
    import signal

    import aioelastic
    from aioelastic._core.child._bootstrap import FunctionCall
    from aioelastic._core.child._error_file import read_error_file
    from aioelastic._core.child._preload import UnforkablePreloadError
    from aioelastic._core.child._script import ScriptRun, run_script_path
    from aioelastic._core.start._exit_watch import ExitNotSeen

    public = [getattr(aioelastic, name) for name in aioelastic.__all__]
    by_reference = [
        obj for obj in public if obj.__module__.startswith(CORE + ".") and obj.__module__ not in NEW
    ] + [
        read_error_file,
        run_script_path,
        FunctionCall,
        ScriptRun,
    ]
    for obj in by_reference:
        old = _with_old_core_paths(pickle.dumps(obj, protocol=0))
        assert CORE.encode() + b"._" in old, obj
        assert pickle.loads(old) is obj

    failure = aioelastic.ProcessFailure(0, 42, 1, "<N/A>", "boom", 1.5)
    values = [
        failure,
        aioelastic.ChildFailedError("job", {0: failure}),
        aioelastic.RunProcsResult(return_values={0: 7}, failures={1: failure}),
        aioelastic.SignalReceived(signal.SIGTERM),
        aioelastic.ForkServerError("gone"),
        aioelastic.OutputItem(
            local_rank=0, stream=aioelastic.Std.OUT, data=b"hi", frame=False, time=1.0
        ),
        aioelastic.Std.ALL,
        UnforkablePreloadError("threads"),
        ExitNotSeen("abandoned"),
        FunctionCall(print, ("x",), {"A": "1"}, "/tmp/error.json"),
        ScriptRun("train.py", module=False),
    ]
    for value in values:
        old = _with_old_core_paths(pickle.dumps(value, protocol=0))
        assert CORE.encode() + b"._" in old, value
        assert not [room for room in CORE_ROOMS if f"{CORE}.{room}.".encode() in old], old
        loaded = pickle.loads(old)
        assert type(loaded) is type(value)
        assert repr(loaded) == repr(value) or vars(loaded) == vars(value)


def test_the_group_context_keeps_only_its_lifecycle() -> None:
    # PContext reads top to bottom as enter, wait, stop, close: what it does besides
    # (preparing, starting, settling, the group's I/O) lives in modules of its own, and it
    # knows the start method only through its protocol.
    path = PACKAGE / "_core" / "group" / "_pcontext.py"
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PContext"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno < 450
    branches = [
        n.lineno
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute) and n.attr in ("start_method", "is_binary")
    ]
    assert branches == []
