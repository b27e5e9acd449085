"""The child side of a function worker: from a fresh process to ``entrypoint(*args)``.

Every start method ends in :func:`run_call`, which calls the user's function, records an
uncaught exception in the error file (torch's format) and sends the return value back
through the result pipe. What differs is how the process got here:

* spawn: a new interpreter runs :func:`spawn_main`, which reads the pickled call from a
  pipe after re-importing the parent's ``__main__`` the way ``multiprocessing`` does;
* fork / fork server: :func:`forked_worker` runs in the freshly forked child and must
  first undo what it inherited (signal handlers, the event loop's wakeup fd, the
  supervisor's private file descriptors).
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..process import _platform
from ._result_pipe import send_result
from ._script import ScriptRun
from ._stack_hook import install_from_env as install_stack_dumps


@dataclass
class FunctionCall:
    """What a function worker runs: ``fn(*args)`` with ``env`` as its environment."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    env: dict[str, str]
    error_file: str


def run_call(call: FunctionCall, result_fd: int) -> int:
    """Run the call, report its outcome, and return the process exit code."""
    install_stack_dumps()
    if isinstance(call.fn, ScriptRun):
        return _run_script(call.fn, call.args, result_fd)
    try:
        value = call.fn(*call.args)
    except SystemExit as exc:
        code = _exit_code_of(exc)
        if code == 0:
            # sys.exit(0) is a success: the worker's return value is None.
            send_result(result_fd, pickle.dumps(None))
        else:
            os.close(result_fd)
        return code
    except BaseException as exc:
        # Any failure of the user's call is this worker's to record before it exits:
        # KeyboardInterrupt and BaseExceptions of the user's own included.
        os.close(result_fd)
        # Printed as well as recorded: the traceback then also reaches stderr logs.
        traceback.print_exc()
        _record(call.error_file, exc)
        return 1
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        os.close(result_fd)
        message = (
            f"{type(exc).__name__}: the return value of {_describe(call.fn)} "
            f"(of type {type(value).__qualname__}) could not be pickled to send it to the "
            f"supervisor: {exc}"
        )
        print(message, file=sys.stderr, flush=True)
        _record(call.error_file, exc, message=message)
        return 1
    try:
        send_result(result_fd, payload)
    except BrokenPipeError:
        return 1  # the supervisor is gone; the parent-death signal follows
    return 0


def _run_script(script: ScriptRun, args: tuple[Any, ...], result_fd: int) -> int:
    """A script (``--preload``): its outcome is its exit status alone, as for ``python``.

    Its "return value" None is sent before it runs: a script may end with ``os._exit(0)``
    (torch users do, to skip slow destructors), which is a success, and whatever it ends
    with must not write into an fd the script may have reused.
    """
    send_result(result_fd, pickle.dumps(None))
    try:
        script(*args)
    except SystemExit as exc:
        return _exit_code_of(exc)
    return 0


def _record(error_file: str, exc: BaseException, message: str | None = None) -> None:
    # Imported only on failure: a worker that succeeds never loads the error machinery.
    from ._error_file import write_error_file

    write_error_file(error_file, exc, message=message)


def _exit_code_of(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr, flush=True)
    return 1


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def spawn_main(payload_fd: int, result_fd: int, parent_pid: int) -> NoReturn:
    """Entry point of a spawned interpreter (``python -c`` calls it with inherited fds)."""
    _platform.die_with_parent(parent_pid)
    with open(payload_fd, "rb") as f:
        data = f.read()
    payload = io.BytesIO(data)
    # Two pickles, each read by a fresh unpickler: one Unpickler's memo would carry over
    # into the second message and resolve its references to the first one's objects.
    # The preparation data re-imports the parent's __main__ as __mp_main__ first, so
    # that the call's functions defined in the user's script can be unpickled. Marked as
    # multiprocessing marks it: a script without a __main__ guard that starts workers at
    # module level then fails here once, naming the fix, instead of every worker
    # starting workers of its own (see check_not_importing_main). Imported here, not at
    # the top: the supervisor imports this module for FunctionCall, and multiprocessing
    # would cost a service's first start ~3 ms of its event loop for nothing.
    import multiprocessing.process
    import multiprocessing.spawn

    current = multiprocessing.process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        multiprocessing.spawn.prepare(pickle.load(payload))
    finally:
        del current._inheriting  # type: ignore[attr-defined]
    call: FunctionCall = pickle.load(payload)
    adopt_environment(call.env)
    # Line-buffered like a terminal, so tee'd and logged lines appear as they are printed.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    sys.exit(run_call(call, result_fd))


def check_not_importing_main(what: str) -> None:
    """Refuse to start workers from a spawned worker still importing its parent's ``__main__``.

    Args:
        what: The call being refused, for the message (``"start_processes()"``).

    Raises:
        RuntimeError: This process is a spawned worker (ours or ``multiprocessing``'s)
            re-importing the main script, whose module level starts workers: without a
            ``__main__`` guard every worker would start workers of its own.
    """
    # A process that never imported multiprocessing is no spawned child importing main.
    process = sys.modules.get("multiprocessing.process")
    if process is not None and getattr(process.current_process(), "_inheriting", False):
        main = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main script"
        raise RuntimeError(
            f"{what} was called while a spawned worker was importing {main} to find the "
            "function it runs: the script starts workers at module level. Put that code "
            "under 'if __name__ == \"__main__\":' (as multiprocessing and "
            "torch.multiprocessing.spawn require), or use start_method='fork'."
        )


def forked_worker(
    *,
    parent_pid: int,
    stdout_fd: int | None,
    stderr_fd: int,
    result_fd: int,
    close_fds: Iterable[int],
    call: FunctionCall | None = None,
    payload: bytes | None = None,
    payload_fd: int | None = None,
    signals_reset: bool = False,
    stdin_fd: int | None = None,
) -> NoReturn:
    """Body of a child made by ``fork()``; never returns.

    ``call`` is given directly for the fork start method (nothing is pickled, as with
    ``multiprocessing``'s fork); a fork server passes the pickled call as ``payload``
    (received with the start request), or ``payload_fd`` to read a large one from.
    ``signals_reset``: the child ran :func:`reset_inherited_signal_state` already (a
    spare does, while it waits for its call). ``stdin_fd``: the worker's stdin (a
    terminal's pty); ``None``: ``/dev/null``.
    """
    code = 1
    try:
        os.setpgid(0, 0)
        _platform.die_with_parent(parent_pid)
        if not signals_reset:
            reset_inherited_signal_state()
        keep = {stderr_fd, result_fd}
        if stdout_fd is not None:
            keep.add(stdout_fd)
        if payload_fd is not None:
            keep.add(payload_fd)
        if stdin_fd is not None:
            keep.add(stdin_fd)
        for fd in close_fds:
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        _redirect_stdio(stdout_fd, stderr_fd, stdin_fd)
        if call is None and payload is not None:
            call = pickle.loads(payload)
        elif call is None:
            assert payload_fd is not None
            with open(payload_fd, "rb") as f:
                call = pickle.load(f)
        assert call is not None
        adopt_environment(call.env)
        code = run_call(call, result_fd)
    except SystemExit as exc:
        code = _exit_code_of(exc)
    except BaseException:
        # Anything, KeyboardInterrupt included: the os._exit below ends this child
        # without unwinding, and would otherwise end it without a word of why.
        traceback.print_exc()
    finally:
        # Never run the parent's atexit handlers or unwind into its code. os._exit has a
        # finally of its own: an exception while flushing (a KeyboardInterrupt from the
        # supervisor's SIGINT arriving just then) must not skip it, or this child would
        # carry on as a copy of the launcher thread or of the fork server's loop.
        try:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
        finally:
            os._exit(code)


def reset_inherited_signal_state(held: Collection[int] = ()) -> None:
    """A forked child's signals as a fresh interpreter has them (and no wakeup fd).

    ``held``: signals left blocked (see `_platform.default_signal_state`).
    """
    # The parent's event loop set a wakeup fd; left in place, a signal to this child
    # would be written into the *parent's* loop and run the parent's handlers.
    signal.set_wakeup_fd(-1)
    _platform.default_signal_state(python=True, held=held)


def adopt_environment(env: dict[str, str]) -> None:
    """Make ``os.environ`` exactly ``env``, changing only what differs.

    A worker inherits nearly all of its environment already (the supervisor's, through
    the fork or the fork server): clearing and refilling it cost a third of a forked
    worker's way to its function, an ``unsetenv`` and a ``putenv`` per variable.
    """
    environ = os.environ
    for key in [key for key in environ if key not in env]:
        del environ[key]
    for key, value in env.items():
        if environ.get(key) != value:
            environ[key] = value


def _redirect_stdio(stdout_fd: int | None, stderr_fd: int, stdin_fd: int | None) -> None:
    if stdin_fd is None:
        stdin_fd = os.open(os.devnull, os.O_RDONLY)
    moves = ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2))
    for fd, target in moves:
        if fd is not None and fd != target:
            os.dup2(fd, target)
    # One fd may be two streams (a pty that is both stdin and stdout): closed once.
    for fd in {fd for fd, _ in moves if fd is not None and fd > 2}:
        os.close(fd)
    # Fresh stream objects on the new fds: the inherited ones may be replaced objects
    # (a test runner's capture) or hold the parent's unflushed buffer.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
