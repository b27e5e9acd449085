"""The agent's typed configuration: every per-node setting parsed once, then read as is.

`AgentConfig.build` is the one place where the agent's settings are parsed (each by its
parser in `..._core.process._values` or `._node_values`); `LocalElasticAgent` and
`elastic_launch` both go through it, and the agent only reads the frozen result.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._core.group._options import GroupOptions
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
        options: the options of every attempt's group (`GroupOptions`), checked against
            this node's local ranks.
        exit_barrier_timeout: seconds a finished node waits for the others.
        signals: the signals that stop the run.
        exported_signals: the signal list exported to workers as torchrun does, when it
            was given (None: taken from the environment or the default, not exported).
        run_id: the job id of the agent's own single-node rendezvous, None for a fresh one.
        metrics_port: where Prometheus metrics and liveness are served; None: not served.
        metrics_host: the address the metrics and health ports bind.
        health_port: ``TORCHELASTIC_HEALTH_CHECK_PORT``, served for liveness; None: unset.
        replace_lost_nodes: whether the survivors of a lost node, fewer than the fewest
            nodes the job needs, wait for a node to replace it (torch's way: up to the
            rendezvous' join timeout) or end the job at once, naming it.
    """

    start_method: str
    log_dir: Path | None
    options: GroupOptions
    exit_barrier_timeout: float
    signals: tuple[signal.Signals, ...]
    exported_signals: str | None
    run_id: str | None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    health_port: int | None = None
    replace_lost_nodes: bool = True

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
        exit_barrier_timeout: float = 300.0,
        signals_to_handle: str | None = None,
        run_id: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        environ: Mapping[str, str] | None = None,
        options: GroupOptions | None = None,
        replace_lost_nodes: bool = True,
        **group_options: Any,
    ) -> AgentConfig:
        """Parse each setting with its parser; the arguments are `LocalElasticAgent`'s.

        Args:
            nprocs: workers on this node (the per-rank settings are checked against it).
            environ: where ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (when ``signals_to_handle``
                is None) and ``TORCHELASTIC_HEALTH_CHECK_PORT`` are read (default
                ``os.environ``).
            options: the group's options, with ``group_options`` (by torch's names)
                merged in by `GroupOptions.of`.

        Raises:
            ValueError, TypeError: a bad value, with the argument's name.
        """
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"run_id must be a non-empty str or None, got {run_id!r}")
        env = os.environ if environ is None else environ
        signal_text = signals_to_handle
        if signal_text is None:
            signal_text = env.get(SIGNALS_ENV, node_values.DEFAULT_SIGNALS_TO_HANDLE)
        group = GroupOptions.of(
            group_options, options=options, torch=True, caller="LocalElasticAgent", nprocs=nprocs
        )
        signals = values.field("signals_to_handle", node_values.signals, signal_text)
        _refuse_forwarding_a_stop(signals, group.forward_signals)
        return cls(
            start_method=values.field("start_method", values.start_method, start_method),
            # Made a Path (and checked) by __post_init__.
            log_dir=log_dir,  # type: ignore[arg-type]
            options=group.for_ranks(nprocs),
            exit_barrier_timeout=values.field(
                "exit_barrier_timeout", values.duration, exit_barrier_timeout
            ),
            signals=signals,
            exported_signals=signals_to_handle,
            run_id=run_id,
            metrics_port=None
            if metrics_port is None
            else values.field("metrics_port", values.port, metrics_port),
            metrics_host=values.field("metrics_host", node_values.host, metrics_host),
            health_port=health_port_from_env(env),
            replace_lost_nodes=values.field(
                "replace_lost_nodes", values.boolean, replace_lost_nodes
            ),
        )


def _refuse_forwarding_a_stop(
    stops: tuple[signal.Signals, ...], forwarded: Collection[int]
) -> None:
    """Refuse a signal that would both stop the run and be passed on to the workers."""
    both = set(stops) & set(forwarded)
    if both:
        names = ",".join(sorted(signal.Signals(s).name for s in both))
        raise ValueError(
            f"forward_signals: {names} both stops the run (signals_to_handle) and is "
            "forwarded to the workers (forward_signals): a signal does one or the other; "
            "drop it from one"
        )
