"""Stacks on demand for a Python script you start yourself.

``python -m aioelastic.stack_hook SCRIPT [ARGS...]`` (or ``... -m MODULE [ARGS...]``)
registers the handler that answers a stack request (``ctx.dump_stacks()``, a timer expiry,
a stall; see docs/hangs.md), then runs the script exactly as ``python SCRIPT ARGS`` would:
a fresh ``__main__``, ``sys.argv`` and ``sys.path[0]`` as python sets them, the same
tracebacks and exit status. Function workers and scripts under ``aioelastic-run`` get the
handler without it; this is for binaries started with ``start_processes`` whose command
runs Python::

    import sys
    from aioelastic.stack_hook import script_argv

    argv = script_argv(sys.executable, "train.py", ["--epochs", "3"])
    aioelastic.start_processes("train", argv[0], {0: tuple(argv[1:])}, {0: {}})

Only the stdlib is imported before the script runs.
"""

from __future__ import annotations

from ._core.child._stack_hook import main, script_argv

__all__ = ["main", "script_argv"]

if __name__ == "__main__":
    main()
