"""The worker side of stacks on demand: a faulthandler answering one signal.

A worker whose environment names a stacks FIFO (:data:`STACKS_FIFO_ENV`) registers
:func:`faulthandler.register` for :data:`STACK_SIGNAL` on that FIFO, with every thread.
faulthandler's handler is C code that runs inside the signal handler itself, so it
answers even when the main thread is stuck in C (a collective, a blocking ``read``), where a
Python-level handler would never run.

Why ``SIGURG``: its default action is to be ignored, so a worker that never registered the
handler (a shell script, a C++ binary, a script that replaced it) is not harmed by the
signal; terminals do not send it (unlike ``SIGWINCH``, sent on every resize and handled by
curses/rich); torch installs nothing for it; and job schedulers and checkpointing code
forward ``SIGUSR1``/``SIGUSR2``/``SIGTERM``, never it.

Function workers call :func:`install_from_env` in their bootstrap. Scripts we did not
write are started as ``python -m aioelastic.stack_hook script.py args...`` (see
:func:`script_argv`): :func:`main` installs the handler, then runs the script through
:func:`._script.run_as_main`, the way ``python script.py`` would (``sys.argv``,
``sys.path[0]``, ``__main__``, tracebacks, exit status). Both import nothing beyond the
stdlib: they run before user code.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

#: The signal that asks a worker for its stacks.
STACK_SIGNAL = signal.SIGURG
#: The environment variable naming the worker's stacks FIFO.
STACKS_FIFO_ENV = "AIOELASTIC_STACKS_FIFO"
#: The public module that runs a script through the hook (``python -m aioelastic.stack_hook``).
MODULE = "aioelastic.stack_hook"
#: Every module name that runs a script through the hook: the public one, this one, and
#: this one's path before ``_core`` had rooms, which earlier docs told users to run (it
#: still runs: ``aioelastic._compat._old_paths``).
MODULES = (MODULE, "aioelastic._core.child._stack_hook", "aioelastic._core._stack_hook")


def install_from_env() -> bool:
    """Register the stack dump handler if the environment names a FIFO.

    The variable is removed from ``os.environ`` so that the worker's own subprocesses do
    not see it. Returns whether the handler is installed; any failure (no reader, a path
    that is not a FIFO) leaves the worker untouched.
    """
    path = os.environ.pop(STACKS_FIFO_ENV, None)
    if not path:
        return False
    try:
        # Non-blocking: a supervisor that stopped reading must never block the worker
        # inside its signal handler (faulthandler then drops the rest of the dump).
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    import stat

    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        return False
    # The fd stays open for the life of the process: faulthandler keeps only its number.
    faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    return True


def script_argv(python: str, script: str, args: list[str], *, module: bool = False) -> list[str]:
    """The command that runs ``script`` (or ``-m module``) with the handler installed."""
    target = ["-m", script] if module else [script]
    return [python, "-u", "-m", MODULE, *target, *args]


def main(argv: list[str] | None = None) -> None:
    """Install the handler, then run a script or module as ``python`` would."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(f"usage: python -m {MODULE} (SCRIPT | -m MODULE) [ARGS]")
    install_from_env()
    # The one way a script is run as __main__ (also under --preload): the same
    # sys.argv, sys.path[0], __main__, traceback and exit status as python's own.
    from ._script import run_as_main

    if args[0] == "-m":
        run_as_main(args[1], True, tuple(args[2:]))
    else:
        run_as_main(args[0], False, tuple(args[1:]))


if __name__ == "__main__":
    main()
