"""``aioelastic-run``: a drop-in replacement for ``torchrun``.

Usage, exactly as torchrun::

    aioelastic-run --nproc-per-node 4 train.py --epochs 3
    python -m aioelastic.run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint host:29400 train.py

The command line (`._cli._cli_flags`, `._cli._cli_parser`, `._cli._cli_plan`) is
torchrun's; the job is run by the elastic agent (`._elastic.agent._agent`), so workers see
torchrun's environment. What changes is what happens around the workers:

* exit status: 0 on success; the root cause's own exit code when a worker fails (128+N if
  signal N killed it); 128+N when the launcher is stopped by signal N. torchrun exits 1.
* the failure table names the root cause and shows its traceback even for a plain script
  (the last lines of its stderr), no ``@record`` needed;
* a stop signal gives the workers ``--shutdown-timeout`` seconds of grace, a second one
  kills at once, and nothing outlives the launcher, not even when it is SIGKILLed (the
  core's watchdog kills the workers' process groups) or when a worker's child left its
  process group (the launcher is a subreaper, see `aioelastic.enable_subreaper`);
* a run without ``--log-dir`` leaves no temporary directory, unless it holds logs or
  error files the user asked for or needs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import anyio

from ._cli._cli_parser import parse_args, usage_error
from ._core.child._error_file import ERROR_FILE_ENV
from ._core.child._script import run_script_path
from ._core.output import _log_root as log_root
from ._core.output._std import Std
from ._core.process._exit_status import signal_text
from ._core.process._subreaper import enable_subreaper
from ._core.reports._failures import ChildFailedError, ProcessFailure
from ._core.reports._record import record_child_failure
from ._elastic.observe._narrate import LauncherFormatter

if TYPE_CHECKING:
    from ._cli._cli_plan import CommandLine
    from ._elastic.launch._elastic_launch import LaunchConfig

__all__ = ["exit_code_for", "main", "run", "run_script_path"]

logger = logging.getLogger("aioelastic.run")

PROG = "aioelastic-run"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The console script: run the job described by ``argv`` and exit with its status."""
    code = run(argv)
    if "aioelastic._elastic.store._serial_thread" in sys.modules:
        from ._elastic.store._serial_thread import calls_in_flight

        if blocked := calls_in_flight():
            # A rendezvous or store call abandoned on its daemon thread (a store that
            # stopped answering) is still inside torch's C++ code: tearing the interpreter
            # down under it can abort the process (SIGABRT, SIGSEGV) and lose the exit
            # status. Everything of ours is done; leave without the interpreter's teardown.
            logger.info(
                "leaving with %d store call(s) still unanswered (exit status %d)", blocked, code
            )
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the job described by a torchrun command line; return the exit status.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        0 on success; the root cause's exit code (128+N when killed by signal N) when a
        worker failed; 128+N when the launcher was stopped by signal N; 1 when the launcher
        itself failed (e.g. a rendezvous timeout); 2 for a usage error.
    """
    args = parse_args(argv)
    try:
        # Imported once the flags parsed: --help and a bad flag need no agent.
        from ._cli._cli_plan import config_from_args

        # Built here, before anything runs: a value the launch API refuses is a usage
        # error of the command line too (exit 2), not a launcher failure.
        config, command = config_from_args(args)
        if command.preload:
            # Checked now, as a usage error; the import itself runs during the rendezvous.
            from ._core.group._validate import check_preload

            try:
                check_preload(command.preload)
            except ValueError as e:
                raise ValueError(f"argument --preload: {e}") from None
    except (ValueError, TypeError) as e:
        usage_error(str(e))
    _configure_logging()
    if command.preload and config.nproc_per_node > 1:
        # What torchrun does in its own environment, and here before the fork server is
        # started with it: OpenMP reads OMP_NUM_THREADS once, when a preloaded torch loads
        # it, so the workers forked later could not lower it any more.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    for note in command.notes:
        print(f"{PROG}: {note}", file=sys.stderr)
    for warning in command.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    # The launcher owns its supervision: a descendant of a worker that left the worker's
    # process group is re-parented to us instead of init, and swept at each teardown.
    enable_subreaper()
    try:
        return anyio.run(_run_job, config, command)
    except KeyboardInterrupt:
        # Ctrl-C before the agent handled signals (e.g. while connecting to the store):
        # no worker runs yet, so there is nothing to stop.
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def exit_code_for(failure: ProcessFailure) -> int:
    """The launcher's exit status for a root-cause failure: its code, 128+N for signal N."""
    if failure.exitcode < 0:
        return 128 + (-failure.exitcode)
    return failure.exitcode if 0 < failure.exitcode < 256 else 1


def _configure_logging() -> None:
    """Our loggers to stderr at torch's ``LOGLEVEL`` (default WARNING), like torchrun's."""
    level = os.environ.get("LOGLEVEL", "WARNING").upper()
    root = logging.getLogger("aioelastic")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(LauncherFormatter(PROG, sys.stderr))
        root.addHandler(handler)
    try:
        root.setLevel(level)
    except ValueError:
        root.setLevel(logging.WARNING)


async def _run_job(config: LaunchConfig, command: CommandLine) -> int:
    from ._core.aio._signals import SignalReceived
    from ._elastic.launch._elastic_launch import elastic_launch

    job_dir, temporary = _job_log_dir(config, command)
    entrypoint, args = command.target()
    try:
        try:
            config.log_dir = job_dir
            failure: Exception | None = None
            async with anyio.create_task_group() as warm_up:
                if command.preload:
                    # The preload import (seconds for torch) overlaps the rendezvous; the
                    # first worker start then finds the server warm, or waits for it.
                    warm_up.start_soon(_warm_up, command.preload)
                try:
                    await elastic_launch(config, entrypoint)(*args)
                except Exception as e:
                    failure = e  # raised below, not wrapped in the task group's group
                warm_up.cancel_scope.cancel()
            if failure is not None:
                raise failure
        except ChildFailedError as error:
            print(error.format_msg(), file=sys.stderr, flush=True)
            if os.environ.get(ERROR_FILE_ENV):
                # Nested under another launcher: hand it our root cause, as torchrun's @record.
                record_child_failure(error)
            return exit_code_for(error.get_first_failure()[1])
        except SignalReceived as e:
            print(f"{PROG}: stopped by {signal_text(e.signum)}; workers stopped", file=sys.stderr)
            return e.exit_code
        except Exception as e:
            _report_launcher_error(e)
            return 1
        return 0
    finally:
        if temporary:
            log_root.remove_if_empty(Path(job_dir), "this run")


async def _warm_up(preload: tuple[str, ...]) -> None:
    from ._core.start._forkserver import ForkServerError, fork_server

    try:
        await fork_server(preload).warm_up()
    except ForkServerError:
        pass  # the first worker start reports it, as part of the launch


def _job_log_dir(config: LaunchConfig, command: CommandLine) -> tuple[str, bool]:
    """A fresh directory for this run's logs, and whether to delete it at the end.

    With ``--log-dir``, a ``<run_id>_<random>`` sub-directory as torchrun makes, so the same
    base directory serves many runs. Without it, a temporary directory, deleted after the
    run unless a stream was redirected into it (those logs are the user's) or a worker
    left an error file there (the failure report names it).
    """
    if command.log_dir is not None:
        os.makedirs(command.log_dir, exist_ok=True)
        job_dir = tempfile.mkdtemp(prefix=f"{config.run_id}_", dir=command.log_dir)
        logger.info("logs of this run are in %s", job_dir)
        return job_dir, False
    job_dir = str(log_root.make_temporary("run"))
    if _redirects_anything(config.redirects):
        print(f"{PROG}: logs of this run are in {job_dir}", file=sys.stderr)
        return job_dir, False
    return job_dir, True


def _redirects_anything(redirects: Std | Mapping[int, Std]) -> bool:
    if isinstance(redirects, Std):
        return bool(redirects)
    return any(redirects.values())


def _report_launcher_error(error: Exception) -> None:
    """A failure of the launcher itself (not of a worker): one line, traceback on demand."""
    if logging.getLogger("aioelastic").isEnabledFor(logging.DEBUG):
        traceback.print_exception(error, file=sys.stderr)
    print(f"{PROG}: error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
