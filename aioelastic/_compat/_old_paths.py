"""The module paths our modules had before, for what an earlier version wrote down.

A pickle names a class or a function by its module path: an error pickled by an earlier
aioelastic (kept in a result store, sent by a service that was not upgraded yet) names
``aioelastic._errors.ChildFailedError`` (before the package had layers) or
``aioelastic._core._failures.ProcessFailure`` (before ``_core`` had rooms), not
``aioelastic._core.reports._failures``. A command line names a module too: earlier docs
told users to run ``python -m aioelastic._core._stack_hook script.py``, and a supervisor
started before an upgrade still starts its spawned workers and fork servers with a ``-c``
line that imports ``aioelastic._core._bootstrap`` (``_platform``,
``_forkserver_process``) and sends them calls pickled by those paths.

`install` puts a finder on ``sys.meta_path`` that answers those old paths with the
module that now defines the same objects, imported only when such a path is asked for;
``python -m`` on an old path runs the module at its new path as ``python -m`` would.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import CodeType, ModuleType

__all__ = ["OLD_PATHS", "install"]

OLD_PATHS = {
    # Before the package had layers.
    "aioelastic._errors": "aioelastic._core.reports._errors",
    "aioelastic._signals": "aioelastic._core.aio._signals",
    "aioelastic._forkserver": "aioelastic._core.start._forkserver",
    "aioelastic._preload": "aioelastic._core.child._preload",
    "aioelastic._launch": "aioelastic._compat._launch",
    "aioelastic._spawn": "aioelastic._compat._spawn",
    # Before _core had rooms: the modules that define the public names (a pickle names a
    # class or a function by its module), an exception type, or the error file,
    "aioelastic._core._pcontext": "aioelastic._core.group._pcontext",
    "aioelastic._core._failures": "aioelastic._core.reports._failures",
    "aioelastic._core._errors": "aioelastic._core.reports._errors",
    "aioelastic._core._results": "aioelastic._core.reports._results",
    "aioelastic._core._record": "aioelastic._core.reports._record",
    "aioelastic._core._error_file": "aioelastic._core.child._error_file",
    "aioelastic._core._forkserver": "aioelastic._core.start._forkserver",
    "aioelastic._core._preload": "aioelastic._core.child._preload",
    "aioelastic._core._exit_watch": "aioelastic._core.start._exit_watch",
    "aioelastic._core._signals": "aioelastic._core.aio._signals",
    "aioelastic._core._std": "aioelastic._core.output._std",
    "aioelastic._core._subreaper": "aioelastic._core.process._subreaper",
    "aioelastic._core._output": "aioelastic._core.output._stream",
    # ... the stack hook (``python -m``), and what a worker's or a fork server's command
    # line imports and the calls it is sent (FunctionCall, ScriptRun, run_script_path).
    "aioelastic._core._stack_hook": "aioelastic._core.child._stack_hook",
    "aioelastic._core._bootstrap": "aioelastic._core.child._bootstrap",
    "aioelastic._core._platform": "aioelastic._core.process._platform",
    "aioelastic._core._forkserver_process": "aioelastic._core.child._forkserver_process",
    "aioelastic._core._script": "aioelastic._core.child._script",
    # Before the async utilities and the output plumbing left _core.process: the modules
    # that define a public name (SignalReceived, Std).
    "aioelastic._core.process._signals": "aioelastic._core.aio._signals",
    "aioelastic._core.process._std": "aioelastic._core.output._std",
    # Before _elastic had rooms: the modules that define the public names (a pickled
    # RunResult, WorkerState or event names one of them).
    "aioelastic._elastic._agent": "aioelastic._elastic.agent._agent",
    "aioelastic._elastic._agent_types": "aioelastic._elastic.agent._types",
    "aioelastic._elastic._elastic_launch": "aioelastic._elastic.launch._elastic_launch",
    "aioelastic._elastic._events": "aioelastic._elastic.observe._events",
    "aioelastic._elastic._rdzv_handlers": "aioelastic._elastic.rendezvous._handlers",
}
"""Old module path -> the module that defines the same objects now."""


class _Alias:
    """Finder and loader in one: an old path resolves to the module at its new path."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name not in OLD_PATHS:
            return None
        # Duck-typed rather than an importlib.abc.Loader: that module costs every worker
        # ~10 ms to import, and the import system needs only the two methods below (and
        # runpy the third).
        return importlib.util.spec_from_loader(name, cast("Loader", self))

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(OLD_PATHS[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at the new path is already executed

    def get_code(self, name: str) -> CodeType:
        # What ``python -m OLD`` runs (runpy asks the loader for the code): the module at
        # its new path, run as ``python -m NEW`` runs it. Not that module's own code: run
        # under the old name, its relative imports would resolve against the old package.
        return compile(
            f"import runpy\nrunpy._run_module_as_main({OLD_PATHS[name]!r})\n",
            f"<{name}: {OLD_PATHS[name]}>",
            "exec",
        )


_ALIAS = _Alias()


def install() -> None:
    """Make the old paths importable (idempotent)."""
    if _ALIAS not in sys.meta_path:
        sys.meta_path.append(_ALIAS)
