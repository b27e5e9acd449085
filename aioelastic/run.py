"""``aioelastic-run``: a drop-in replacement for ``torchrun``.

Usage, exactly as torchrun::

    aioelastic-run --nproc-per-node 4 train.py --epochs 3
    python -m aioelastic.run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint host:29400 train.py

The command line (`._cli_args`) is torchrun's; the job is run by the elastic agent
(`._agent`), so workers see torchrun's environment. What changes is what happens around
the workers:

* exit status: 0 on success; the root cause's own exit code when a worker fails (128+N if
  signal N killed it); 128+N when the launcher is stopped by signal N. torchrun exits 1.
* the failure table names the root cause and shows its traceback even for a plain script
  (the last lines of its stderr), no ``@record`` needed;
* a stop signal gives the workers ``--shutdown-timeout`` seconds of grace, a second one
  kills at once, and nothing outlives the launcher, not even when it is SIGKILLed (the
  core's watchdog kills the workers' process groups) or when a worker's child left its
  process group (the launcher is a subreaper, see `aioelastic.enable_subreaper`);
* a single-node run does not import torch in the launcher;
* a run without ``--log-dir`` leaves no temporary directory, unless it holds logs or
  error files the user asked for or needs.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

import anyio

from ._cli_args import LaunchPlan, parse_args, plan_from_args
from ._errors import ERROR_FILE_ENV, ChildFailedError, ProcessFailure, _record_child_failure
from ._std import Std
from ._subreaper import enable_subreaper

__all__ = ["exit_code_for", "main", "run", "run_script_path"]

logger = logging.getLogger("aioelastic.run")

PROG = "aioelastic-run"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The console script: run the job described by ``argv`` and exit with its status."""
    sys.exit(run(argv))


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
        plan = plan_from_args(args)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    _configure_logging()
    for warning in plan.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    # The launcher owns its supervision: a descendant of a worker that left the worker's
    # process group is re-parented to us instead of init, and swept at each teardown.
    enable_subreaper()
    return anyio.run(_launch, plan, args.training_script)


def exit_code_for(failure: ProcessFailure) -> int:
    """The launcher's exit status for a root-cause failure: its code, 128+N for signal N."""
    if failure.exitcode < 0:
        return 128 + (-failure.exitcode)
    return failure.exitcode if 0 < failure.exitcode < 256 else 1


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run a script in this interpreter as ``__main__`` (the worker side of ``--run-path``).

    Args:
        training_script: the script's absolute path.
        training_script_args: its arguments (``sys.argv[1:]``).
    """
    import runpy

    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")


def _configure_logging() -> None:
    """Our loggers to stderr at torch's ``LOGLEVEL`` (default WARNING), like torchrun's."""
    level = os.environ.get("LOGLEVEL", "WARNING").upper()
    root = logging.getLogger("aioelastic")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[{PROG}] %(levelname)s: %(message)s"))
        root.addHandler(handler)
    try:
        root.setLevel(level)
    except ValueError:
        root.setLevel(logging.WARNING)


async def _launch(plan: LaunchPlan, name: str) -> int:
    from ._signals import SignalReceived

    job_dir, temporary = _job_log_dir(plan)
    try:
        agent = await _make_agent(plan, job_dir)
        try:
            result = await agent.run()
        except SignalReceived as e:
            sig = signal.Signals(e.signum)
            print(f"{PROG}: stopped by {sig.name}; workers stopped", file=sys.stderr)
            return e.exit_code
        except Exception as e:
            _report_launcher_error(e)
            return 1
        if not result.is_failed():
            return 0
        error = ChildFailedError(name, dict(result.failures))
        print(error.format_msg(), file=sys.stderr, flush=True)
        if os.environ.get(ERROR_FILE_ENV):
            # Nested under another launcher: hand it our root cause, as torchrun's @record.
            _record_child_failure(error)
        return exit_code_for(error.get_first_failure()[1])
    finally:
        if temporary and not _holds_files(job_dir):
            shutil.rmtree(job_dir, ignore_errors=True)


def _job_log_dir(plan: LaunchPlan) -> tuple[str, bool]:
    """A fresh directory for this run's logs, and whether to delete it at the end.

    With ``--log-dir``, a ``<run_id>_<random>`` sub-directory as torchrun makes, so the same
    base directory serves many runs. Without it, a temporary directory, deleted after the
    run unless a stream was redirected into it (those logs are the user's) or a worker
    left an error file there (the failure report names it).
    """
    if plan.log_dir is not None:
        os.makedirs(plan.log_dir, exist_ok=True)
        job_dir = tempfile.mkdtemp(prefix=f"{plan.run_id}_", dir=plan.log_dir)
        logger.info("logs of this run are in %s", job_dir)
        return job_dir, False
    job_dir = tempfile.mkdtemp(prefix="aioelastic-run_")
    if _redirects_anything(plan):
        print(f"{PROG}: logs of this run are in {job_dir}", file=sys.stderr)
        return job_dir, False
    return job_dir, True


def _redirects_anything(plan: LaunchPlan) -> bool:
    if isinstance(plan.redirects, Std):
        return bool(plan.redirects)
    return any(plan.redirects.values())


async def _make_agent(plan: LaunchPlan, log_dir: str) -> Any:
    """The elastic agent for ``plan``; torch is imported only for a real rendezvous."""
    from ._agent import LocalElasticAgent, RestartBackoff, WorkerSpec

    handler = None
    master_addr: str | None = None
    master_port: int | None = None
    if plan.single_node:
        master_addr, master_port = plan.master_addr, plan.master_port
    else:
        from ._rendezvous import create_rdzv_handler

        configs = {"timeout": 900, **plan.rdzv_configs}
        handler = await create_rdzv_handler(
            plan.rdzv_backend,
            plan.rdzv_endpoint,
            plan.run_id,
            plan.min_nodes,
            plan.max_nodes,
            local_addr=plan.local_addr,
            **configs,
        )
        if plan.rdzv_backend == "static":
            master_addr, master_port = plan.master_addr, plan.master_port
    entrypoint: Any = run_script_path if plan.run_path else plan.entrypoint
    args = (plan.entrypoint, *plan.args) if plan.run_path else plan.args
    backoff = (
        RestartBackoff(
            initial=plan.restart_backoff,
            maximum=max(plan.restart_backoff, plan.restart_backoff_max),
        )
        if plan.restart_backoff > 0
        else None
    )
    spec = WorkerSpec(
        role=plan.role,
        local_world_size=plan.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        rdzv_handler=handler,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=plan.local_addr,
        virtual_local_rank=plan.virtual_local_rank,
        restart_backoff=backoff,
        no_retry_exit_codes=plan.no_retry_exit_codes,
    )
    return LocalElasticAgent(
        spec,
        start_method=plan.start_method,
        log_dir=log_dir,
        redirects=plan.redirects,
        tee=plan.tee,
        shutdown_timeout=plan.shutdown_timeout,
        log_line_prefix_template=plan.log_line_prefix_template,
        local_ranks_filter=plan.local_ranks_filter,
        signals_to_handle=plan.signals_to_handle_text,
    )


def _holds_files(directory: str) -> bool:
    return any(files for _, _, files in os.walk(directory))


def _report_launcher_error(error: Exception) -> None:
    """A failure of the launcher itself (not of a worker): one line, traceback on demand."""
    if logging.getLogger("aioelastic").isEnabledFor(logging.DEBUG):
        traceback.print_exception(error, file=sys.stderr)
    print(f"{PROG}: error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
