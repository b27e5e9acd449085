"""What a measure is: its metrics, its interleaved groups, the systems in each and the rows.

A *group* is one interleaving unit: every system in it runs the same workload for the same
N, one repetition each in turn (A/B/C, then B/C/A, ...), so a noisy neighbour on this
shared machine hits all systems alike and the ratios of one run stay meaningful. Each
system runs in a long-lived *driver* process (see ``_driver``), so warm state that a real
user keeps between runs (a fork server, imported modules) is kept, and one system's
leftovers (threads, a global fork server with other preload settings) never touch another;
systems that leave a process in the same state may share one (``System.driver``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Kind = Literal["aioelastic", "torch", "floor"]
Scalar = str | int | float | bool
Params = Mapping[str, Scalar]


@dataclass(frozen=True)
class Metric:
    """One number a repetition yields.

    Attributes:
        name: key in the sample dict returned by a system's implementation.
        unit: printed after the values (``s``, ``lines/s``, ...).
        higher_is_better: ``True`` for throughputs; decides which way the ratio goes.
        scale: multiplier applied for display only (``1000`` with unit ``ms``).
        ratio: whether a ratio of the two sides means anything (not for counts of
            lost lines, where both should be zero).
        count: a number of things (ranks, jobs): a whole median is printed without
            decimals.
    """

    name: str
    unit: str
    higher_is_better: bool = False
    scale: float = 1.0
    ratio: bool = True
    count: bool = False


SECONDS = Metric("seconds", "ms", scale=1000.0)


@dataclass(frozen=True)
class System:
    """One contender in a group.

    Attributes:
        label: unique within the group, e.g. ``aioelastic/forkserver+preload``.
        kind: whose code it runs; ``floor`` rows have no torch counterpart.
        impl: ``module:function`` run inside the driver for one repetition.
        params: extra parameters for ``impl`` (merged over the group's).
        max_n: skip N above this (documented cost limits for torch-importing workers).
        quick: whether the system runs in ``--quick`` mode at all.
        reps: repetitions per N in full mode for this system, overriding the group's
            (cheap systems get more repetitions than torch-importing ones).
        driver: name of the driver process that runs it (default: ``label``). Systems
            with the same driver name share one process across groups and measures, so
            they must leave it in the same state (same imports, same fork-server
            preload); that sharing keeps ``--quick`` from importing torch 20 times.
    """

    label: str
    kind: Kind
    impl: str
    params: Params = field(default_factory=dict)
    max_n: int | None = None
    quick: bool = True
    reps: Mapping[int, int] | None = None
    driver: str | None = None

    @property
    def driver_name(self) -> str:
        """The driver process this system runs in."""
        return self.driver or self.label


#: The noise allowance of a ``--quick`` claim: the factor by which a checked figure may be
#: worse than the recorded run's before the check fails (see :class:`Claim`).
ALLOWANCE = 1.5


@dataclass(frozen=True)
class Claim:
    """What ``--quick`` (and ``--check``) hold a row's headline metric to, at one N.

    The rule, stated here only: the bound is the row's figure at ``n`` in the recorded run
    (``benchmarks/results/latest.json``) made :data:`ALLOWANCE` times worse, or the target,
    whichever is looser. A ratio (>1: aioelastic better) must stay at or above
    ``recorded / ALLOWANCE`` or ``target``, whichever is lower; a bound on ours (a row with
    no torch side) at or below ``recorded * ALLOWANCE`` or ``target``, whichever is higher.

    ``--quick`` runs few repetitions (1 to 9) at one N on a shared 2-core CI machine: 1.5x
    allows for that and still fails a regression of 2x. A loaded machine (other jobs'
    tests, a load average of 4-7) slows some rows by more than 1.5x, ours more than
    torch's where ours runs more processes: there ``loaded`` is what quick runs on it
    held, with a margin, the row's comment gives their figures, and it is the bound
    unless the target is looser. A claim that fails under CI's load is worse than a
    looser one.

    Attributes:
        n: the N it is checked at: the N ``--quick`` runs the row at, and one of the
            recorded run's.
        recorded: the row's headline figure at ``n`` in the recorded run (its ratio, or
            ours' median in the metric's base unit); ``None`` where the recorded figure is
            no measurement of what ``--quick`` measures (the row's comment says why).
        target: the claim docs/benchmarks.md makes; ``None``: none.
        loaded: see above; ``None``: the recorded figure's allowance (or the target)
            holds on a loaded machine.
    """

    n: int
    recorded: float | None
    target: float | None = None
    loaded: float | None = None

    def __post_init__(self) -> None:
        if self.recorded is None and self.target is None and self.loaded is None:
            raise ValueError(f"a claim at N={self.n} needs a recorded figure or a target")

    def at_least(self) -> float:
        """The lowest ratio that passes: the loosest of the recorded figure, target, loaded."""
        recorded = None if self.recorded is None else self.recorded / ALLOWANCE
        return min(x for x in (recorded, self.target, self.loaded) if x is not None)

    def at_most(self) -> float:
        """The highest median of ours that passes (the same rule, the other way)."""
        recorded = None if self.recorded is None else self.recorded * ALLOWANCE
        return max(x for x in (recorded, self.target, self.loaded) if x is not None)


@dataclass(frozen=True)
class Row:
    """One line of the results table: an aioelastic system against a torch (or no) system.

    Attributes:
        case: what the line compares, e.g. ``fn spawn`` or ``fn forkserver+preload vs spawn``.
        ours: label of the aioelastic (or floor) system.
        theirs: label of the torch (or floor) system, ``None`` for floor rows.
        quick_min_ratio: the headline check of ``--quick``: the run fails when the ratio
            of the row's headline metric (``metric``; >1: aioelastic better) at the
            claim's N falls below :meth:`Claim.at_least`; ``None``: not checked.
        headline_n: the N at which this row goes into the README's generated table
            (``None``: only in docs/benchmarks.md's full table).
        metric: name of the metric that ``headline_n`` and ``quick_min_ratio`` refer to
            (``None``: the measure's first); for a group whose workload yields only a
            later metric of its measure.
        metrics: the names of the metrics this row shows (``None``: all of its measure's).
        quick_max: the headline check of a row without a torch side: the run fails when
            ours' median of the headline metric (in its base unit, e.g. seconds) at the
            claim's N exceeds :meth:`Claim.at_most`; ``None``: not checked.
    """

    case: str
    ours: str
    theirs: str | None = None
    quick_min_ratio: Claim | None = None
    headline_n: int | None = None
    metric: str | None = None
    metrics: tuple[str, ...] | None = None
    quick_max: Claim | None = None


@dataclass(frozen=True)
class Group:
    """Systems interleaved on one workload.

    Attributes:
        name: short id, unique within the measure.
        systems: the contenders, each run in its driver process (``System.driver``).
        rows: the table lines drawn from this group's samples.
        ns: N values in full mode; ``quick_ns`` in ``--quick`` mode.
        reps: repetitions per N in full mode (N -> count; N missing -> ``default_reps``).
        quick_reps: repetitions per N in ``--quick`` mode.
        params: parameters for every system's ``impl`` (``quick_params`` override in quick).
        warmup: run one discarded repetition per driver first (imports, fork servers).
        quick_warmup: do that in ``--quick`` mode too (groups whose ratios ``--quick``
            checks on warm systems).
        rep_timeout: harness-side limit for one repetition, a safety net only: systems
            that can hang (torch's 30 s teardown) enforce their own shorter limit.
    """

    name: str
    systems: tuple[System, ...]
    rows: tuple[Row, ...]
    ns: tuple[int, ...]
    quick_ns: tuple[int, ...] = (1,)
    reps: Mapping[int, int] = field(default_factory=dict)
    default_reps: int = 5
    quick_reps: int = 1
    params: Params = field(default_factory=dict)
    quick_params: Params = field(default_factory=dict)
    warmup: bool = True
    quick_warmup: bool = False
    rep_timeout: float = 300.0

    def reps_for(self, n: int, quick: bool, system: System | None = None) -> int:
        """Repetitions for ``n`` in the given mode (for ``system`` if it overrides them)."""
        if quick:
            return self.quick_reps
        if system is not None and system.reps is not None and n in system.reps:
            return system.reps[n]
        return self.reps.get(n, self.default_reps)


@dataclass(frozen=True)
class Measure:
    """A named measure of the suite (``startup``, ``failure``, ...).

    Attributes:
        name: what ``--only`` selects.
        letter: the item of issue #7 it answers (``a`` .. ``h``, ``floor``).
        title: one line for the table heading.
        metrics: the numbers each repetition yields; the first is the headline.
        groups: the interleaved groups, run one after another.
        notes: printed under the table heading (what exactly is timed).
    """

    name: str
    letter: str
    title: str
    metrics: tuple[Metric, ...]
    groups: tuple[Group, ...]
    notes: str = ""


@dataclass(frozen=True)
class RepContext:
    """Everything a system's implementation gets for one repetition.

    Attributes:
        n: number of workers.
        params: group parameters merged with the system's.
        workdir: a fresh, empty directory for this repetition's files.
        quick: ``--quick`` mode.
    """

    n: int
    params: Params
    workdir: Path
    quick: bool

    def param(self, key: str) -> Scalar:
        """A required parameter; a missing one is a bug in the measure's definition."""
        return self.params[key]

    def float_param(self, key: str) -> float:
        """A required numeric parameter as float."""
        value = self.params[key]
        if isinstance(value, str):
            raise TypeError(f"parameter {key!r} must be a number, got {value!r}")
        return float(value)

    def int_param(self, key: str) -> int:
        """A required integer parameter."""
        value = self.params[key]
        if isinstance(value, (str, float)):
            raise TypeError(f"parameter {key!r} must be an int, got {value!r}")
        return int(value)

    def str_param(self, key: str) -> str:
        """A required string parameter."""
        value = self.params[key]
        if not isinstance(value, str):
            raise TypeError(f"parameter {key!r} must be a str, got {value!r}")
        return value


class RepTimeout(Exception):
    """A repetition ran over the limit its system enforces; reported as ``> limit``.

    Args:
        limit: the limit in seconds (what the table prints after ``>``).
    """

    def __init__(self, limit: float) -> None:
        super().__init__(f"ran over {limit:g} s")
        self.limit = limit


class NotAvailable(Exception):
    """The system's code is not importable yet (reported as ``n/a``, never a crash)."""
