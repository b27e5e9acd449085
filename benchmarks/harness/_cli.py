"""Command line of the suite: ``python -m benchmarks [--quick] [--only ...] [--ns ...] ...``.

Progress goes to stderr as it happens; the table goes to stdout at the end. The exit
status is 1 when a system broke (a bug in the suite or in the code under test), 0
otherwise, also when the aioelastic side of a measure is not available yet (``n/a``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness._plots import plot, plot_scale
from benchmarks.harness._reaper import become_subreaper, reap_all
from benchmarks.harness._report import (
    build_rows,
    check_claims,
    render_headlines,
    render_problems,
    render_table,
    replace_between_markers,
    run_line,
)
from benchmarks.harness._run import ROOT, Harness, Plan, Series
from benchmarks.harness._run_dir import SHM, filesystem_of, run_parent
from benchmarks.harness._spec import Measure


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,2,4, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4, got {text!r}")
    return values


def _parser(measures: list[Measure]) -> argparse.ArgumentParser:
    names = ", ".join(f"{m.name} ({m.letter})" for m in measures)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "Run aioelastic and its torch equivalents on the same workloads, repetitions "
            "interleaved, and print per measure and N: medians, ratio, min..max, repetitions."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI run: small N, few repetitions, short idle times; checks that the suite "
        "works and, like --check, that every headline ratio holds within its noise margin",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit with status 3 when a headline ratio falls below its row's minimum "
        "(implied by --quick; works with --from-json)",
    )
    parser.add_argument("--only", metavar="MEASURE[,..]", help=f"run only these measures: {names}")
    parser.add_argument(
        "--ns", type=_int_list, metavar="1,2,4", help="run these N instead of each measure's"
    )
    parser.add_argument(
        "--reps", type=int, metavar="K", help="repetitions per N instead of each measure's"
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="write every sample and the table rows as JSON"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw startup latency against N (needs matplotlib)",
    )
    parser.add_argument(
        "--plot-scale",
        type=Path,
        metavar="FILE.png",
        help="draw per-worker cost and memory against N, 64 groups of 4 and the event "
        "loop's lateness (the binary and scale measures; needs matplotlib)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="make the run directory (every system's log directories and TMPDIR) in DIR; "
        f"default: {SHM} when it is a writable tmpfs, else the system's temporary directory",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the run directory (drivers' logs) and print its path",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="print the table (and draw --plot/--plot-scale) of an earlier run's --json FILE; "
        "runs nothing",
    )
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help="write the headline table into README.md and the full table into "
        "docs/benchmarks.md, between their <!-- benchmarks:readme/docs:start/end --> markers",
    )
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help=argparse.SUPPRESS)
    parser.add_argument(
        "--docs", type=Path, default=ROOT / "docs" / "benchmarks.md", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"the full run whose results are kept: same as --json {RESULTS.relative_to(ROOT)} "
        f"--plot {PLOT.relative_to(ROOT)} --plot-scale {SCALE_PLOT.relative_to(ROOT)} "
        "--write-readme",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run (systems, N, repetitions) and exit",
    )
    return parser


#: Where ``--record`` keeps the run (committed) and its plots.
RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
PLOT = ROOT / "benchmarks" / "startup-latency.png"
SCALE_PLOT = ROOT / "benchmarks" / "scale.png"


def _select(measures: list[Measure], only: str | None) -> list[Measure]:
    if not only:
        return measures
    wanted = [x.strip() for x in only.split(",") if x.strip()]
    by_name = {m.name: m for m in measures} | {m.letter: m for m in measures}
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise SystemExit(
            f"--only: unknown measure(s) {', '.join(unknown)}; choose from "
            + ", ".join(m.name for m in measures)
        )
    chosen = {by_name[w].name for w in wanted}
    return [m for m in measures if m.name in chosen]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine() -> str:
    """CPU model and memory, from /proc (empty where it cannot be read)."""
    model = memory = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
        with open("/proc/meminfo") as f:
            kib = next((int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")), 0)
        memory = f"{kib / 2**20:.0f} GiB" if kib else ""
    except OSError:
        pass
    return ", ".join(x for x in (model, memory) if x)


def _meta(argv: list[str], quick: bool) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks " + shlex.join(argv),
        "quick": quick,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "aioelastic": _version("aioelastic"),
        "platform": platform.platform(),
        "machine": _machine(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }


def main(measures: list[Measure], argv: list[str] | None = None) -> int:
    """Run the suite of ``measures``; see ``python -m benchmarks --help``."""
    args_list = sys.argv[1:] if argv is None else argv
    args = _parser(measures).parse_args(args_list)
    if args.record:
        if args.quick or args.from_json or args.only or args.ns or args.reps:
            raise SystemExit(
                "--record is the full run of every measure; drop --quick/--from-json/--only/"
                "--ns/--reps, or use --json FILE for a partial run"
            )
        args.json, args.plot, args.plot_scale, args.write_readme = RESULTS, PLOT, SCALE_PLOT, True
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
    selected = _select(measures, args.only)
    if args.from_json:
        document = json.loads(args.from_json.read_text())
        results = [Series(**entry) for entry in document["series"]]
        ran = {s.measure for s in results}
        shown = [m for m in selected if m.name in ran]
        rows = _report(document["meta"], shown, results, args.plot, args.plot_scale)
        if args.write_readme:
            _write_docs(args.readme, args.docs, document["meta"], shown, rows)
        return 3 if args.check and _failed_claims(rows) else 0
    meta = _meta(args_list, args.quick)
    plan = Plan(measures=selected, quick=args.quick, ns=args.ns, reps=args.reps)
    if args.dry_run:
        print(_describe(plan))
        return 0
    parent = run_parent(args.run_dir)
    meta["files"] = {"dir": str(parent), "fs": filesystem_of(parent)}
    run_dir = Path(tempfile.mkdtemp(prefix="aioelastic-bench-", dir=parent))
    started = time.monotonic()
    become_subreaper()
    try:
        results = Harness(plan, run_dir, sys.stderr).run()
    finally:
        leaked = reap_all()
        if leaked:
            print(f"processes left behind by a driver, killed: {leaked}", file=sys.stderr)
        meta["leaked_pids"] = leaked
        if args.keep:
            print(f"run directory kept: {run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    meta["duration_s"] = round(time.monotonic() - started, 1)
    meta["loadavg_end"] = os.getloadavg()
    rows = _report(meta, selected, results, args.plot, args.plot_scale)
    if args.json:
        _write_json(args.json, meta, results, rows)
    if args.write_readme:
        _write_docs(args.readme, args.docs, meta, selected, rows)
    if any(s.status == "error" for s in results):
        return 1
    return 3 if (args.quick or args.check) and _failed_claims(rows) else 0


def _write_docs(
    readme: Path,
    docs: Path,
    meta: dict[str, Any],
    measures: list[Measure],
    rows: list[dict[str, Any]],
) -> None:
    """Regenerate the README's headline table and docs/benchmarks.md's full table."""
    source = f"From {run_line(meta)}; regenerate with `python -m benchmarks --from-json "
    source += f"{RESULTS.relative_to(ROOT)} --write-readme --plot {PLOT.relative_to(ROOT)} "
    source += f"--plot-scale {SCALE_PLOT.relative_to(ROOT)}`."
    readme.write_text(
        replace_between_markers(
            readme.read_text(),
            "benchmarks:readme",
            source + "\n\n" + render_headlines(measures, rows),
        )
    )
    # The docs page nests the tables one level deeper than the printed report.
    docs.write_text(
        replace_between_markers(
            docs.read_text(),
            "benchmarks:docs",
            source + "\n\n" + ("\n" + render_table(measures, rows)).replace("\n### ", "\n#### "),
        )
    )


def _failed_claims(rows: list[dict[str, Any]]) -> bool:
    failures = check_claims(rows)
    if failures:
        print("Behind the claim:\n" + "\n".join(f"- {f}" for f in failures))
    return bool(failures)


def _report(
    meta: dict[str, Any],
    selected: list[Measure],
    results: list[Series],
    plot_path: Path | None,
    scale_plot_path: Path | None,
) -> list[dict[str, Any]]:
    """Print the run's header line and table (and draw the plots); return the table rows."""
    rows = build_rows(selected, results)
    print(
        f"<!-- {meta['command']} | {meta['date']} | commit {meta['git_commit']} | "
        f"torch {meta['torch']} | {meta['cpus']} CPUs | {meta['duration_s']} s -->"
    )
    print(render_table(selected, rows))
    problems = render_problems(results)
    if problems:
        print("Not measured:\n" + problems)
    if plot_path:
        plot(results, plot_path)
    if scale_plot_path:
        plot_scale(results, scale_plot_path)
    return rows


def _describe(plan: Plan) -> str:
    lines = []
    for measure in plan.measures:
        for group in measure.groups:
            lines.append(f"{measure.letter}. {measure.name}/{group.name}:")
            for n in plan.ns_for(group):
                runs = ", ".join(
                    f"{s.label} x{plan.reps_for(group, n, s)}" for s in plan.systems_for(group, n)
                )
                warm = (
                    " (+1 warm-up each)"
                    if group.warmup
                    and (group.quick_warmup or not plan.quick)
                    and n == plan.ns_for(group)[0]
                    else ""
                )
                lines.append(f"  N={n}: {runs}{warm}")
    return "\n".join(lines)


def _write_json(
    path: Path, meta: dict[str, Any], results: list[Series], rows: list[dict[str, Any]]
) -> None:
    def clean(value: Any) -> Any:
        # JSON has no infinity: a timed-out median is written as null with its limit beside it.
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    document = {
        "meta": meta,
        "rows": clean(rows),
        "series": [clean(vars(s)) for s in results],
    }
    path.write_text(json.dumps(document, indent=1) + "\n")
