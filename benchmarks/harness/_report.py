"""Turns the series into the table and the rows of the JSON document (figures: ``_plots``)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.harness._run import Series
from benchmarks.harness._spec import Claim, Measure, Metric


@dataclass(frozen=True)
class Stats:
    """Summary of one system's values of one metric at one N.

    A repetition that timed out counts as +infinity: it sorts above every finished one,
    so the median is a timeout only when at least half the repetitions timed out.

    Attributes:
        status: ``ok``, ``n/a``, ``error`` or ``skipped`` (then the numbers are None).
        median, minimum, maximum: in the metric's base unit; ``inf`` for a timeout.
        reps: repetitions summarised.
        limit: the timeout limit, when any repetition timed out.
    """

    status: str
    median: float | None = None
    minimum: float | None = None
    maximum: float | None = None
    reps: int = 0
    limit: float | None = None


def summarise(series: Series | None, metric: Metric) -> Stats:
    """Stats of ``metric`` over a series (``skipped`` when there is no series)."""
    if series is None:
        return Stats("skipped")
    if series.status != "ok":
        return Stats(series.status)
    values = [s[metric.name] for s in series.samples if metric.name in s]
    values += [math.inf] * len(series.timeouts)
    if not values:
        return Stats("skipped")
    limit = max(series.timeouts) if series.timeouts else None
    return Stats("ok", statistics.median(values), min(values), max(values), len(values), limit)


def ratio(ours: Stats, theirs: Stats, metric: Metric) -> tuple[float | None, bool]:
    """How many times better ours is (>1: aioelastic better), and whether it is a bound.

    A torch timeout makes the ratio a lower bound (``>``); a zero makes it undefined.
    """
    if ours.median is None or theirs.median is None:
        return None, False
    a, b = ours.median, theirs.median
    if metric.higher_is_better:
        a, b = b, a
    bound = False
    if math.isinf(b) and theirs.limit is not None:
        b, bound = theirs.limit, True
    if math.isinf(a) or a <= 0 or b <= 0:
        return None, False
    return b / a, bound


def _fmt(value: float | None, metric: Metric, limit: float | None = None) -> str:
    if value is None:
        return ""
    if math.isinf(value):
        return f"> {(limit or 0) * metric.scale:.0f}"
    shown = value * metric.scale
    if shown == 0 or (metric.count and shown == round(shown)):
        return f"{shown:.0f}"
    if abs(shown) >= 100:
        return f"{shown:.0f}"
    if abs(shown) >= 10:
        return f"{shown:.1f}"
    return f"{shown:.2f}"


def _cell(stats: Stats, metric: Metric) -> str:
    if stats.status != "ok":
        # "error": every repetition of that system failed (the run lists why).
        return {"n/a": "n/a", "error": "failed", "skipped": "-"}.get(stats.status, stats.status)
    return _fmt(stats.median, metric, stats.limit)


def _range(stats: Stats, metric: Metric) -> str:
    if stats.status != "ok":
        return ""
    return f"{_fmt(stats.minimum, metric, stats.limit)}..{_fmt(stats.maximum, metric, stats.limit)}"


def build_rows(measures: list[Measure], results: list[Series]) -> list[dict[str, Any]]:
    """One dict per table line: measure, case, N, metric, both sides' stats, the ratio."""
    index = {(s.measure, s.group, s.system, s.n): s for s in results}
    rows: list[dict[str, Any]] = []
    for measure in measures:
        for group in measure.groups:
            ns = sorted(
                {s.n for s in results if s.measure == measure.name and s.group == group.name}
            )
            for metric in measure.metrics:
                for row in group.rows:
                    if row.metrics is not None and metric.name not in row.metrics:
                        continue
                    lead = metric.name == (row.metric or measure.metrics[0].name)
                    for n in ns:
                        at_least = _claimed(row.quick_min_ratio, lead, n)
                        at_most = _claimed(row.quick_max, lead, n)
                        ours = summarise(index.get((measure.name, group.name, row.ours, n)), metric)
                        theirs = (
                            summarise(index.get((measure.name, group.name, row.theirs, n)), metric)
                            if row.theirs
                            else None
                        )
                        if (
                            ours.status == "skipped"
                            and (theirs is None or theirs.status == "skipped")
                            and at_most is None  # a claim without a number must show, and fail
                        ):
                            continue
                        value, bound = ratio(ours, theirs, metric) if theirs else (None, False)
                        rows.append(
                            {
                                "measure": measure.name,
                                "letter": measure.letter,
                                "group": group.name,
                                "case": row.case,
                                "n": n,
                                "metric": metric.name,
                                "unit": metric.unit,
                                "scale": metric.scale,
                                "higher_is_better": metric.higher_is_better,
                                "ours_system": row.ours,
                                "ours": asdict(ours),
                                "theirs_system": row.theirs,
                                "theirs": asdict(theirs) if theirs else None,
                                "ratio": value if metric.ratio else None,
                                "ratio_is_lower_bound": bound if metric.ratio else False,
                                "headline": row.headline_n == n and lead,
                                "quick_min_ratio": at_least.at_least() if at_least else None,
                                "quick_max": at_most.at_most() if at_most else None,
                            }
                        )
    return rows


def _claimed(claim: Claim | None, lead: bool, n: int) -> Claim | None:
    """The row's claim where it applies: on its headline metric, at the claim's N."""
    return claim if lead and claim is not None and claim.n == n else None


def check_claims(rows: list[dict[str, Any]]) -> list[str]:
    """One line per checked row behind its claim, or whose number is missing.

    The claim is a ratio (``quick_min_ratio``) or, for a row without a torch side, a bound
    on ours (``quick_max``), each derived from the recorded run by
    :class:`~benchmarks.harness._spec.Claim`, and checked at the claim's N. A row whose
    side did not produce a number fails too: a claim that cannot be checked must not pass
    silently.
    """
    failures = []
    for r in rows:
        most = r.get("quick_max")
        if most is not None:
            median = r["ours"]["median"]
            where = f"{r['measure']}: {r['case']} N={r['n']} ({r['ours_system']})"
            shown = f"{most * r['scale']:g} {r['unit']}"
            if median is None:
                failures.append(f"{where}: no number, needs <= {shown}")
            elif median > most:
                failures.append(f"{where}: {median * r['scale']:.1f} > {shown}")
        floor = r.get("quick_min_ratio")
        if floor is None:
            continue
        where = (
            f"{r['measure']}: {r['case']} N={r['n']} ({r['ours_system']} vs {r['theirs_system']})"
        )
        if r["ratio"] is None:
            failures.append(f"{where}: no ratio (a side did not run), needs >= {floor:g}")
        elif r["ratio"] < floor:
            failures.append(f"{where}: ratio {r['ratio']:.2f} < {floor:g}")
    return failures


def run_line(meta: dict[str, Any]) -> str:
    """Where the numbers come from: command, date, commit, machine, torch."""
    machine = meta.get("machine") or meta.get("platform")
    return (
        f"`{meta['command']}` on {meta['date']}, commit `{meta['git_commit']}`, "
        f"{meta['cpus']} CPUs ({machine}), torch {meta['torch']}, Python {meta['python']}, "
        f"{meta['duration_s']} s{_files(meta)}"
    )


def _files(meta: dict[str, Any]) -> str:
    """Where the run's files were (runs recorded before this was kept say nothing)."""
    files = meta.get("files")
    return f", files on {files['fs']} ({files['dir']})" if files else ""


def render_headlines(measures: list[Measure], rows: list[dict[str, Any]]) -> str:
    """The README's table: each headline row at its N, with torch's configuration named."""
    metrics = {(m.name, x.name): x for m in measures for x in m.metrics}
    out = [
        "| measure | N | aioelastic | torch (configuration) | torch | ratio |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if not r.get("headline"):
            continue
        metric = metrics[(r["measure"], r["metric"])]
        ours = Stats(**r["ours"])
        theirs = Stats(**r["theirs"]) if r["theirs"] else Stats("skipped")
        ratio_text = ""
        if r["ratio"] is not None:
            ratio_text = (">" if r["ratio_is_lower_bound"] else "") + f"{r['ratio']:.2f}x"

        def shown(stats: Stats, metric: Metric = metric) -> str:
            return _cell(stats, metric) + (f" {metric.unit}" if stats.status == "ok" else "")

        out.append(
            "| "
            + " | ".join(
                [
                    f"{r['measure']}: {r['case']}",
                    str(r["n"]),
                    shown(ours),
                    r["theirs_system"] or "",
                    shown(theirs),
                    ratio_text,
                ]
            )
            + " |"
        )
    return "\n".join(out)


def replace_between_markers(text: str, name: str, content: str) -> str:
    """``text`` with what lies between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` replaced.

    Raises:
        ValueError: the markers are missing or out of order (the message names them).
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, found, rest = text.partition(start)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"markers {start} ... {end} not found; add them where the table goes")
    return f"{head}{start}\n{content.strip()}\n{end}{tail}"


def _metric_label(measure: Measure, metric: Metric) -> str:
    """A table's metric cell: the unit, and the metric's name where the measure has several
    ("ms" alone would not say which: a burst's lateness or its whole duration)."""
    return metric.unit if len(measure.metrics) == 1 else f"{metric.name}, {metric.unit}"


def render_table(measures: list[Measure], rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table per measure."""
    metrics = {(m.name, x.name): x for m in measures for x in m.metrics}
    out: list[str] = []
    for measure in measures:
        mine = [r for r in rows if r["measure"] == measure.name]
        if not mine:
            continue
        head = "" if measure.letter == measure.name else f"{measure.letter}. "
        out.append(f"### {head}{measure.name}: {measure.title}")
        out.append("")
        if measure.notes:
            out.append(measure.notes)
            out.append("")
        if all(r["theirs"] is None for r in mine):
            out.extend(_floor_table(mine, metrics, measure))
            continue
        out.append(
            "| case | N | metric | aioelastic | torch | torch system | ratio "
            "| aioelastic min..max | torch min..max | reps |"
        )
        out.append("|---|---:|---|---:|---:|---|---:|---:|---:|---:|")
        for r in mine:
            metric = metrics[(measure.name, r["metric"])]
            ours = Stats(**r["ours"])
            theirs = Stats(**r["theirs"]) if r["theirs"] else None
            ratio_text = ""
            if r["ratio"] is not None:
                ratio_text = (">" if r["ratio_is_lower_bound"] else "") + f"{r['ratio']:.1f}x"
            reps = str(ours.reps) if theirs is None else f"{ours.reps}/{theirs.reps}"
            out.append(
                "| "
                + " | ".join(
                    [
                        r["case"],
                        str(r["n"]),
                        _metric_label(measure, metric),
                        _cell(ours, metric),
                        _cell(theirs, metric) if theirs else "",
                        r["theirs_system"] or "",
                        ratio_text,
                        _range(ours, metric),
                        _range(theirs, metric) if theirs else "",
                        reps,
                    ]
                )
                + " |"
            )
        out.append("")
    return "\n".join(out)


def _floor_table(
    rows: list[dict[str, Any]], metrics: dict[tuple[str, str], Metric], measure: Measure
) -> list[str]:
    out = ["| case | N | metric | median | min..max | reps |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        metric = metrics[(measure.name, r["metric"])]
        stats = Stats(**r["ours"])
        cells = [
            r["case"],
            str(r["n"]),
            _metric_label(measure, metric),
            _cell(stats, metric),
            _range(stats, metric),
            str(stats.reps),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    return out


def render_problems(results: list[Series]) -> str:
    """One line per system that was not available or broke, with the reason."""
    seen: set[tuple[str, str, str]] = set()
    lines = []
    for s in results:
        key = (s.measure, s.group, s.system)
        if s.status in ("n/a", "error") and key not in seen:
            seen.add(key)
            reason = s.reason.strip().splitlines()[-1] if s.reason.strip() else ""
            lines.append(f"- {s.measure}/{s.group} {s.system}: {s.status}: {reason}")
    return "\n".join(lines)
