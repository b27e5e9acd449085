"""The module paths the error types had before the package was laid out in layers.

A pickle names a class by its module path: an error pickled by an earlier aioelastic
(kept in a result store, sent by a service that was not upgraded yet) names
``aioelastic._errors.ChildFailedError``, not ``aioelastic._core._errors.ChildFailedError``.
`install` puts a finder on ``sys.meta_path`` that answers those old paths with the
module that now defines the same classes, imported only when such a path is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__all__ = ["OLD_PATHS", "install"]

OLD_PATHS = {
    "aioelastic._errors": "aioelastic._core._errors",
    "aioelastic._signals": "aioelastic._core._signals",
    "aioelastic._forkserver": "aioelastic._core._forkserver",
    "aioelastic._preload": "aioelastic._core._preload",
    "aioelastic._launch": "aioelastic._compat._launch",
    "aioelastic._spawn": "aioelastic._compat._spawn",
}
"""Old module path -> the module that defines its error types now."""


class _Alias:
    """Finder and loader in one: an old path resolves to the module at its new path."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name not in OLD_PATHS:
            return None
        # Duck-typed rather than an importlib.abc.Loader: that module costs every worker
        # ~10 ms to import, and the import system needs only these two methods.
        return importlib.util.spec_from_loader(name, cast("Loader", self))

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(OLD_PATHS[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at the new path is already executed


_ALIAS = _Alias()


def install() -> None:
    """Make the old paths importable (idempotent)."""
    if _ALIAS not in sys.meta_path:
        sys.meta_path.append(_ALIAS)
