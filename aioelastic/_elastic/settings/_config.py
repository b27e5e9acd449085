"""The agent's typed configuration: every per-node setting parsed once, then read as is.

`AgentConfig.build` is the one place where the agent's settings are parsed (each by its
parser in `._values`); `LocalElasticAgent` and `elastic_launch` both go through it, and the
agent only reads the frozen result.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..._core.output._std import Std, to_map
from ..._core.process import _values as values
from ..observe._metrics import health_port_from_env
from . import _node_values as node_values

__all__ = ["AgentConfig", "SIGNALS_ENV"]

SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""torch's variable for the signals a run handles (read when none are given)."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How one node's agent runs its workers; built by `build`, never changed.

    Attributes:
        start_method: ``spawn``, ``fork`` or ``forkserver`` for function workers.
        log_dir: the log root given, or None for a fresh temporary one; a path that is
            a file, or under one, is refused.
        redirects: streams written to files, per local rank.
        tee: streams also shown on the console, per local rank.
        shutdown_timeout: seconds between the stop signal and SIGKILL.
        exit_barrier_timeout: seconds a finished node waits for the others.
        log_line_prefix_template: the console prefix template, or None for the default.
        local_ranks_filter: local ranks shown on the console, None for all.
        ranks_filter: global ranks shown on the console, None for all (with
            ``local_ranks_filter`` too, a rank is shown when both allow it).
        collapse_identical_lines: the window identical console lines of several local
            ranks are printed once in, seconds; None: every line as written.
        forkserver_preload: modules the fork server imports once.
        signals: the signals that stop the run.
        exported_signals: the signal list exported to workers as torchrun does, when it
            was given (None: taken from the environment or the default, not exported).
        run_id: the job id of the agent's own single-node rendezvous, None for a fresh one.
        stall_timeout: seconds without output or timer request after which the group is
            stalled (docs/hangs.md); None never.
        metrics_port: where Prometheus metrics and liveness are served; None: not served.
        metrics_host: the address the metrics and health ports bind.
        health_port: ``TORCHELASTIC_HEALTH_CHECK_PORT``, served for liveness; None: unset.
        stop_leader_first: the stop signal goes to each worker alone, and to the rest of
            its process group once it exited (`start_processes`); False: to the group.
    """

    start_method: str
    log_dir: Path | None
    redirects: Mapping[int, Std]
    tee: Mapping[int, Std]
    shutdown_timeout: float
    exit_barrier_timeout: float
    log_line_prefix_template: str | None
    local_ranks_filter: frozenset[int] | None
    forkserver_preload: tuple[str, ...]
    signals: tuple[signal.Signals, ...]
    exported_signals: str | None
    run_id: str | None
    stall_timeout: float | None = None
    ranks_filter: frozenset[int] | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    health_port: int | None = None
    stop_leader_first: bool = False
    collapse_identical_lines: float | None = None

    def __post_init__(self) -> None:
        # log_dir is checked here rather than in build: elastic_launch sets it per run with
        # dataclasses.replace. A look at the path, nothing made: a file where the log root
        # goes is refused before the rendezvous, with the message aioelastic-run's
        # --log-dir and start_processes give, not by mkdir once workers are due.
        if self.log_dir is not None:
            object.__setattr__(
                self, "log_dir", values.field("log_dir", values.log_dir, self.log_dir)
            )

    @classmethod
    def build(
        cls,
        *,
        nprocs: int,
        start_method: str = "spawn",
        log_dir: str | os.PathLike[str] | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        shutdown_timeout: float = 30.0,
        exit_barrier_timeout: float = 300.0,
        log_line_prefix_template: str | None = None,
        local_ranks_filter: Collection[int] | None = None,
        ranks_filter: Collection[int] | str | None = None,
        forkserver_preload: Collection[str] = (),
        signals_to_handle: str | None = None,
        run_id: str | None = None,
        stall_timeout: float | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        stop_leader_first: bool = False,
        collapse_identical_lines: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> AgentConfig:
        """Parse each setting with its parser; the arguments are `LocalElasticAgent`'s.

        Args:
            nprocs: workers on this node (the per-rank settings are checked against it).
            environ: where ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (when ``signals_to_handle``
                is None) and ``TORCHELASTIC_HEALTH_CHECK_PORT`` are read (default
                ``os.environ``).

        Raises:
            ValueError, TypeError: a bad value, with the argument's name.
        """
        if isinstance(forkserver_preload, str):
            raise TypeError(
                f"forkserver_preload must be a collection of module names, got "
                f"{forkserver_preload!r}; wrap one name in a tuple: ({forkserver_preload!r},)"
            )
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"run_id must be a non-empty str or None, got {run_id!r}")
        env = os.environ if environ is None else environ
        signal_text = signals_to_handle
        if signal_text is None:
            signal_text = env.get(SIGNALS_ENV, node_values.DEFAULT_SIGNALS_TO_HANDLE)
        return cls(
            start_method=values.field("start_method", values.start_method, start_method),
            # Made a Path (and checked) by __post_init__.
            log_dir=log_dir,  # type: ignore[arg-type]
            redirects=MappingProxyType(
                values.field("redirects", lambda v: to_map(v, nprocs), redirects)
            ),
            tee=MappingProxyType(values.field("tee", lambda v: to_map(v, nprocs), tee)),
            shutdown_timeout=values.field("shutdown_timeout", values.duration, shutdown_timeout),
            exit_barrier_timeout=values.field(
                "exit_barrier_timeout", values.duration, exit_barrier_timeout
            ),
            log_line_prefix_template=values.field(
                "log_line_prefix_template", values.prefix_template, log_line_prefix_template
            ),
            local_ranks_filter=values.field(
                "local_ranks_filter",
                lambda v: values.rank_filter(v, nprocs),
                local_ranks_filter,
            ),
            ranks_filter=values.field("ranks_filter", values.global_rank_filter, ranks_filter),
            forkserver_preload=values.field(
                "forkserver_preload", values.module_names, tuple(forkserver_preload)
            ),
            signals=values.field("signals_to_handle", node_values.signals, signal_text),
            exported_signals=signals_to_handle,
            run_id=run_id,
            stall_timeout=None
            if stall_timeout is None
            else values.field("stall_timeout", values.positive_duration, stall_timeout),
            metrics_port=None
            if metrics_port is None
            else values.field("metrics_port", values.port, metrics_port),
            metrics_host=values.field("metrics_host", node_values.host, metrics_host),
            health_port=health_port_from_env(env),
            stop_leader_first=values.field("stop_leader_first", values.boolean, stop_leader_first),
            collapse_identical_lines=values.field(
                "collapse_identical_lines", values.collapse_window, collapse_identical_lines
            ),
        )
