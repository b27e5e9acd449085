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
write are started as ``python -m aioelastic._stack_hook script.py args...`` (see
:func:`script_argv`): :func:`main` installs the handler, then runs the script with
:mod:`runpy` the way ``python script.py`` would (``sys.argv``, ``sys.path[0]``,
``__main__``). This module imports nothing beyond the stdlib: it runs before user code.
"""

from __future__ import annotations

import builtins
import faulthandler
import importlib.machinery
import io
import os
import signal
import sys

#: The signal that asks a worker for its stacks.
STACK_SIGNAL = signal.SIGURG
#: The environment variable naming the worker's stacks FIFO.
STACKS_FIFO_ENV = "AIOELASTIC_STACKS_FIFO"


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
    return [python, "-u", "-m", "aioelastic._stack_hook", *target, *args]


def main(argv: list[str] | None = None) -> None:
    """Install the handler, then run a script or module as ``python`` would."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m aioelastic._stack_hook (SCRIPT | -m MODULE) [ARGS]")
    install_from_env()
    import runpy  # here, not at the top: function workers import this module too

    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("usage: python -m aioelastic._stack_hook -m MODULE [ARGS]")
        module = args[1]
        sys.argv = [module, *args[2:]]
        # python -m puts the current directory first on sys.path.
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = args[0]
    sys.argv = [script, *args[1:]]
    # python script.py puts the script's directory first on sys.path (symlinks resolved),
    # where -m put the current directory.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    if os.path.isdir(script):
        import runpy

        runpy.run_path(script, run_name="__main__")  # a directory with __main__.py
        return
    _run_file_as_main(script)


def _run_file_as_main(script: str) -> None:
    # Not runpy.run_path: it rewrites sys.argv[0] to the resolved path while the script
    # runs and puts a temporary module in sys.modules. python itself executes the file in
    # a fresh __main__ whose __file__ is absolute (3.9+) and leaves argv[0] as given.
    path = os.path.abspath(script)
    with io.open_code(path) as f:
        source = f.read()
    if b"\0" in source:
        # Not source text (which cannot hold NUL): a zip application with __main__.py.
        import runpy

        runpy.run_path(script, run_name="__main__")
        return
    main_module = type(sys)("__main__")
    main_module.__file__ = path
    main_module.__cached__ = None  # type: ignore[attr-defined]
    main_module.__builtins__ = builtins  # type: ignore[attr-defined]
    main_module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main_module
    # compile() reads a coding cookie from bytes, as the interpreter does for a script.
    exec(compile(source, path, "exec"), main_module.__dict__)


if __name__ == "__main__":
    main()
