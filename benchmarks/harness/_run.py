"""Runs the groups: systems in driver processes, repetitions interleaved across systems.

The harness never polls workers: each repetition is one request to a driver, answered with
the numbers the workers' own timestamps gave. Its only timer is a safety net around a
driver's answer (``Group.rep_timeout``); systems that are expected to hang (torch's 30 s
teardown) enforce their own, shorter limit and report a timeout as a result.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from benchmarks.harness._driver import REPLY_FD_ENV
from benchmarks.harness._spec import Group, Measure, System

ROOT = Path(__file__).resolve().parents[2]

#: A group's first repetition waits until the machine's CPUs were at most this busy
#: (a fraction of all of them) over one window: the previous group's processes may still
#: be ending, and this group's drivers are starting their interpreters. In an earlier
#: recorded run the first seconds after a long group ran a side 50-100% slower than later.
QUIET_BUSY = 0.15
QUIET_WINDOW = 0.25
#: Give up waiting (and say so) after this long: a machine that is never quiet still runs.
QUIET_MAX_WAIT = 30.0
#: The same for ``--quick``, whose dozen groups must keep CI well inside its time limit on
#: a machine that other jobs keep busy.
QUICK_QUIET_MAX_WAIT = 3.0


def _cpu_busy_and_total() -> tuple[int, int] | None:
    """Busy and total jiffies of all CPUs since boot (``/proc/stat``); None without it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(value) for value in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_quiet(max_wait: float = QUIET_MAX_WAIT) -> float | None:
    """Block until the CPUs were mostly idle over one window; the seconds waited.

    ``None`` if the machine never got quiet within ``max_wait`` seconds (or has no
    ``/proc/stat``): the group then runs anyway.
    """
    started = time.monotonic()
    before = _cpu_busy_and_total()
    while before is not None and time.monotonic() - started < max_wait:
        time.sleep(QUIET_WINDOW)
        after = _cpu_busy_and_total()
        if after is None:
            break
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total <= QUIET_BUSY:
            return time.monotonic() - started
        before = after
    return None


@dataclass
class Series:
    """All repetitions of one system at one N.

    Attributes:
        measure, group, system, kind, n: what ran.
        samples: one metrics dict per successful repetition.
        timeouts: the limit of each repetition that ran over it.
        warmup: the metrics of the discarded warm-up repetition, if one ran.
        status: ``ok``, ``n/a`` (aioelastic side not importable), ``error`` or ``skipped``.
        reason: why the status is not ``ok``.
    """

    measure: str
    group: str
    system: str
    kind: str
    n: int
    samples: list[dict[str, float]] = field(default_factory=list)
    timeouts: list[float] = field(default_factory=list)
    warmup: dict[str, float] | None = None
    status: str = "ok"
    reason: str = ""

    @property
    def reps(self) -> int:
        """Repetitions that produced a result (a timeout is a result)."""
        return len(self.samples) + len(self.timeouts)


class DriverError(Exception):
    """A driver died or did not answer in time (a bug, not a measurement)."""


class Driver:
    """A ``python -m benchmarks.harness._driver`` process serving the systems of one driver name.

    It runs in its own session so that the harness can stop it and everything it started
    in one ``killpg`` if it stops answering; its stdout and stderr go to a log file.
    """

    def __init__(self, name: str, run_dir: Path, index: int) -> None:
        self.name = name
        safe = "".join(c if c.isalnum() else "_" for c in name)
        self.log_path = run_dir / f"driver-{index:02d}-{safe}.log"
        tmp = run_dir / "tmp" / f"{index:02d}"
        tmp.mkdir(parents=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        # torch's DefaultLogsSpecs and torchrun make /tmp/torchelastic_* directories that
        # they never remove; pointing TMPDIR into the run directory cleans them up.
        env["TMPDIR"] = str(tmp)
        read_fd, write_fd = os.pipe()
        env[REPLY_FD_ENV] = str(write_fd)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.harness._driver"],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        os.close(write_fd)
        self._reply_fd = read_fd
        self._buffer = b""
        self.alive = True

    def rep(
        self, impl: str, n: int, params: dict[str, Any], workdir: Path, quick: bool, timeout: float
    ) -> dict[str, Any]:
        """Run one repetition of ``impl`` and return the driver's answer.

        Raises:
            DriverError: the driver died or ran over ``timeout``; it has been stopped.
        """
        command = {
            "op": "rep",
            "impl": impl,
            "n": n,
            "params": params,
            "workdir": str(workdir),
            "quick": quick,
        }
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write((json.dumps(command) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError as exc:
            self.kill()
            raise DriverError(f"driver for {self.name} died; see {self.log_path}") from exc
        line = self._readline(timeout)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _readline(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise DriverError(
                    f"driver for {self.name} gave no answer in {timeout:g} s; "
                    f"stopped it (see {self.log_path})"
                )
            readable, _, _ = select.select([self._reply_fd], [], [], remaining)
            if not readable:
                continue
            data = os.read(self._reply_fd, 1 << 16)
            if not data:
                self.kill()
                raise DriverError(
                    f"driver for {self.name} exited; see {self.log_path}:\n" + _tail(self.log_path)
                )
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def close(self) -> None:
        """Ask the driver to exit; stop it if it does not within 30 s."""
        if self.alive:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(b'{"op": "exit"}\n')
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        """Stop the driver's whole session (itself and every worker it left behind)."""
        if self.alive:
            self.alive = False
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                try:
                    self._proc.stdin.close()
                except BrokenPipeError:
                    pass
            os.close(self._reply_fd)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Plan:
    """What the harness runs: the selected measures, N values and mode."""

    measures: list[Measure]
    quick: bool
    ns: tuple[int, ...] | None = None
    reps: int | None = None

    def ns_for(self, group: Group) -> tuple[int, ...]:
        """N values for a group: ``--ns`` if given, else the group's for the mode."""
        if self.ns is not None:
            return self.ns
        return group.quick_ns if self.quick else group.ns

    def reps_for(self, group: Group, n: int, system: System) -> int:
        """Repetitions of a system at N: ``--reps`` if given, else the measure's."""
        return self.reps if self.reps is not None else group.reps_for(n, self.quick, system)

    def systems_for(self, group: Group, n: int) -> list[System]:
        """The systems of a group that run at N in this mode."""
        return [
            s
            for s in group.systems
            if (s.max_n is None or n <= s.max_n) and (s.quick or not self.quick)
        ]


def _params(group: Group, system: System, quick: bool) -> dict[str, Any]:
    params: dict[str, Any] = dict(group.params)
    if quick:
        params.update(group.quick_params)
    params.update(system.params)
    return params


class Harness:
    """Runs a :class:`Plan`, printing progress to ``log``."""

    def __init__(self, plan: Plan, run_dir: Path, log: TextIO) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.log = log
        self._rep_index = 0
        self._drivers: dict[str, Driver] = {}

    def run(self) -> list[Series]:
        """Every selected measure, group by group; every driver is stopped at the end."""
        results: list[Series] = []
        try:
            for measure in self.plan.measures:
                for group in measure.groups:
                    started = time.monotonic()
                    results.extend(self._run_group(measure, group))
                    elapsed = time.monotonic() - started
                    self._print(f"== {measure.name}/{group.name}: {elapsed:.1f} s")
        finally:
            for driver in self._drivers.values():
                driver.close()
        return results

    def _driver(self, system: System) -> Driver:
        """The (shared) driver process of a system, started on first use."""
        name = system.driver_name
        driver = self._drivers.get(name)
        if driver is None or not driver.alive:
            driver = Driver(name, self.run_dir, len(self._drivers) + 1)
            self._drivers[name] = driver
        return driver

    def _workdir(self) -> Path:
        self._rep_index += 1
        return self.run_dir / "reps" / f"{self._rep_index:05d}"

    def _run_group(self, measure: Measure, group: Group) -> list[Series]:
        ns = self.plan.ns_for(group)
        systems = {s.label: s for n in ns for s in self.plan.systems_for(group, n)}
        series: dict[tuple[str, int], Series] = {
            (label, n): Series(measure.name, group.name, label, s.kind, n)
            for n in ns
            for label, s in systems.items()
        }
        dead: dict[str, tuple[str, str]] = {}  # label -> (status, reason)
        # Start every driver of the group before its first repetition, so that no
        # interpreter start-up runs beside a measured repetition.
        for system in systems.values():
            self._driver(system)
        waited = wait_until_quiet(QUICK_QUIET_MAX_WAIT if self.plan.quick else QUIET_MAX_WAIT)
        if waited is None:
            self._print(f"-- {measure.name}/{group.name}: the machine was never quiet; running")
        elif waited > 1.0:
            self._print(
                f"-- {measure.name}/{group.name}: waited {waited:.1f} s for a quiet machine"
            )
        for n in ns:
            active = self.plan.systems_for(group, n)
            warm = group.warmup and (group.quick_warmup or not self.plan.quick) and n == ns[0]
            if warm:
                for system in active:
                    self._one(measure, group, system, n, dead, series, warmup=True)
            reps = {s.label: self.plan.reps_for(group, n, s) for s in active}
            for rep in range(max(reps.values(), default=0)):
                # Rotate the order each round so that no system always runs right after
                # the same other one (page cache, CPU frequency, a neighbour's burst).
                due = [s for s in active if reps[s.label] > rep]
                shift = rep % len(due) if due else 0
                for system in due[shift:] + due[:shift]:
                    self._one(measure, group, system, n, dead, series)
        for (label, _), entry in series.items():
            if entry.status != "ok" or entry.reps > 0:
                continue
            if label in dead:
                entry.status, entry.reason = dead[label]
            else:
                entry.status, entry.reason = "skipped", "not run at this N in this mode"
        return list(series.values())

    def _one(
        self,
        measure: Measure,
        group: Group,
        system: System,
        n: int,
        dead: dict[str, tuple[str, str]],
        series: dict[tuple[str, int], Series],
        warmup: bool = False,
    ) -> None:
        label = system.label
        if label in dead:
            return
        workdir = self._workdir()
        what = f"{measure.name}/{group.name} N={n} {label}" + (" (warm-up)" if warmup else "")
        try:
            answer = self._driver(system).rep(
                system.impl,
                n,
                _params(group, system, self.plan.quick),
                workdir,
                self.plan.quick,
                group.rep_timeout,
            )
        except DriverError as exc:
            dead[label] = ("error", str(exc))
            series[(label, n)].status, series[(label, n)].reason = dead[label]
            self._print(f"{what}: ERROR {exc}")
            return
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        entry = series[(label, n)]
        status = answer["status"]
        if status == "ok":
            metrics: dict[str, float] = answer["metrics"]
            if warmup:
                entry.warmup = metrics
            else:
                entry.samples.append(metrics)
            shown = ", ".join(
                _show(metrics[m.name], m.scale, m.unit)
                for m in measure.metrics
                if m.name in metrics
            )
            self._print(f"{what}: {shown}")
        elif status == "timeout":
            if not warmup:
                entry.timeouts.append(float(answer["limit"]))
            self._print(f"{what}: > {answer['limit']:g} s (timeout)")
        elif status == "n/a":
            dead[label] = ("n/a", answer["reason"])
            entry.status, entry.reason = dead[label]
            self._print(f"{what}: n/a ({answer['reason']})")
        else:
            dead[label] = ("error", answer.get("error", "?"))
            entry.status, entry.reason = dead[label]
            self._print(f"{what}: ERROR\n{answer.get('error', '?')}")

    def _print(self, text: str) -> None:
        print(text, file=self.log, flush=True)


def _show(value: float, scale: float, unit: str) -> str:
    return f"{value * scale:.4g} {unit}"
