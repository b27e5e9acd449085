"""The fork server's warm-up: import the preload list, refusing what cannot be forked.

A fork copies one thread and the memory of the others as they were: a lock held by a thread
the preload started stays held forever in every worker, and CUDA cannot be used in a child
forked after it was initialised. Both are found right after the module that caused them is
imported, and the server then refuses to start, naming the module.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["UnforkablePreloadError", "import_preload"]


class UnforkablePreloadError(RuntimeError):
    """A preloaded module left the server in a state that is unsafe to fork."""


def import_preload(modules: tuple[str, ...]) -> None:
    """Import ``modules`` in order; refuse one that started threads or initialised CUDA.

    Raises:
        UnforkablePreloadError: the message names the module and the fix.
        Exception: whatever importing a module raised.
    """
    for module in modules:
        __import__(module)
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if threads:
            raise UnforkablePreloadError(
                f"preloading {module!r} started {len(threads)} thread(s) "
                f"({', '.join(threads)}); forked workers would inherit their locks in "
                f"whatever state they are in: drop {module!r} from --preload "
                "(forkserver_preload) and let each worker import it"
            )
        if _cuda_initialized():
            raise UnforkablePreloadError(
                f"preloading {module!r} initialised CUDA, which a forked worker cannot "
                f"use: drop {module!r} from --preload (forkserver_preload) and let each "
                "worker import it"
            )


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False
