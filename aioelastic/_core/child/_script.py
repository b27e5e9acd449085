"""Run a script in a worker exactly as ``python -u script.py args`` would.

The worker side of ``aioelastic-run --preload`` (a fork of a warm fork server calls a
`ScriptRun`) and of every script worker started fresh (``python -m aioelastic.stack_hook
script.py``, see :mod:`._stack_hook`). `run_as_main` makes the process look like a fresh
interpreter that was started on the script —
``__name__ == "__main__"``, ``__file__`` absolute, ``__spec__`` None (or the module's spec
with ``-m``), ``sys.argv``, ``sys.path[0]`` the script's directory (the current directory
with ``-m``), unbuffered stdout and stderr as under ``-u`` — and ends as one would:
``sys.exit(n)`` exits n, an uncaught exception prints its traceback through
``sys.excepthook`` and exits 1, an uncaught KeyboardInterrupt kills the process with
SIGINT, non-daemon threads are joined and ``atexit`` handlers run first.

What cannot be the same under ``--preload``: the modules the server preloaded (and the
launcher's own, such as ``aioelastic``) are already imported. stdin is what any worker
gets: a pty fed by the stdin router at a terminal, else ``/dev/null``.
"""

from __future__ import annotations

import atexit
import builtins
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import threading
import types
import zipfile
from typing import IO, Any

__all__ = ["ScriptRun", "run_script_path"]

_RUNNER_FILES = frozenset({__file__})


class ScriptRun:
    """A picklable call that runs a script (``python -u target``) or a module (``-m``).

    The function worker's entrypoint under ``--preload``; its ``__name__`` is the script,
    so the failure report is titled as torchrun titles it.

    Args:
        target: the script's path as given on the command line, or a module name.
        module: run ``target`` as ``python -m target``.
    """

    def __init__(self, target: str, module: bool = False) -> None:
        self.target = target
        self.module = module
        self.__name__ = target

    def __call__(self, *args: str) -> None:
        """Run the script with ``args`` as ``sys.argv[1:]`` (see `run_as_main`)."""
        run_as_main(self.target, self.module, args)


def run_as_main(target: str, module: bool, args: tuple[str, ...]) -> None:
    """Run ``target`` as ``__main__`` in this process, then end as python would.

    Returns normally only when the script succeeded (exit status 0); a failure leaves as
    ``SystemExit`` with the exit status python would have had, or by SIGINT for an
    uncaught KeyboardInterrupt.
    """
    _unbuffered_stdio()
    code = 0
    interrupted = False
    try:
        if module:
            sys.argv = ["-m", *args]
            sys.path[0] = os.getcwd()
            # What ``python -m`` itself calls (so a traceback shows the same runpy
            # frames), in a fresh ``__main__`` module as the interpreter's own.
            sys.modules["__main__"] = _fresh_main()
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            _run_file(target)
    except SystemExit as exc:
        code = _status(exc)
    except KeyboardInterrupt as exc:
        interrupted = True
        _print_uncaught(exc)
    except BaseException as exc:
        # Whatever else the script let out (a BaseException of its own, say) ends it as
        # an uncaught exception ends the interpreter: printed, exit code 1.
        code = 1
        _print_uncaught(exc)
    code = _finalize(code)
    if interrupted:
        # CPython's own ending after an uncaught Ctrl-C: die by the signal, so that the
        # parent (a shell, the supervisor) sees "killed by SIGINT", not an exit code.
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code != 0:
        raise SystemExit(code)


def _run_file(target: str) -> None:
    """What ``python target`` does with the file: a fresh ``__main__`` module runs it.

    Not ``runpy.run_path``: that sets ``sys.argv[0]`` to the path it is given, and python
    keeps ``sys.argv[0]`` as typed while ``__file__`` is absolute. A directory or a zip
    archive (run by its ``__main__.py``) is left to runpy, as python does.
    """
    path = os.path.abspath(target)
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        argv0 = sys.argv[0]
        try:
            runpy.run_path(target, run_name="__main__")
        finally:
            sys.argv[0] = argv0
        return
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main = _fresh_main()
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _fresh_main() -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    return main


def _print_uncaught(exc: BaseException) -> None:
    """``sys.excepthook`` on the traceback python would show: from the script's frames on.

    The frames of this module come first; a fresh interpreter has none of them (a
    SyntaxError in the script then shows no frame at all, as python shows it).
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _RUNNER_FILES:
        tb = tb.tb_next
    # The default hook prints the exception's own traceback, whatever it is given.
    exc.with_traceback(tb)
    sys.excepthook(type(exc), exc, tb)


def _status(exc: SystemExit) -> int:
    """The exit status of ``sys.exit(exc.code)``, printing a non-int code as python does."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr, flush=True)
    return 1


def _finalize(code: int) -> int:
    """Python's shutdown before exit: join non-daemon threads, run ``atexit`` handlers."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        pass
    # atexit prints an exception raised by a handler and carries on, as at a real exit.
    atexit._run_exitfuncs()
    if not _flush():
        # CPython exits 120 when stdout cannot be flushed at exit.
        return 120 if code == 0 else code
    return code


def _flush() -> bool:
    ok = True
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            ok = False
    return ok


def _unbuffered_stdio() -> None:
    """``python -u``'s streams on fds 1 and 2: write-through text over unbuffered files."""
    sys.stdout = _text_stream(1, sys.__stdout__, "strict")
    sys.stderr = _text_stream(2, sys.__stderr__, "backslashreplace")


def _text_stream(fd: int, like: IO[Any] | None, errors: str) -> io.TextIOWrapper:
    encoding = getattr(like, "encoding", None) or "utf-8"
    errors = getattr(like, "errors", None) or errors
    raw = io.FileIO(fd, "w", closefd=False)
    # No buffer between the text layer and the fd: what ``-u`` makes.
    return io.TextIOWrapper(
        raw,
        encoding=encoding,
        errors=errors,
        line_buffering=False,
        write_through=True,
    )


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run a script in this interpreter as ``__main__`` (the worker side of ``--run-path``).

    Args:
        training_script: the script's absolute path.
        training_script_args: its arguments (``sys.argv[1:]``).
    """
    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")
