"""What the table says: ratios, timeouts as bounds, claims, generated docs, the scale figure."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness._cli import RESULTS as RECORDED
from benchmarks.harness._report import build_rows, check_claims, render_table, summarise
from benchmarks.harness._run import Series
from benchmarks.harness._spec import (
    ALLOWANCE,
    SECONDS,
    Claim,
    Group,
    Measure,
    Metric,
    Row,
    System,
)
from benchmarks.measures import all_measures

# Moved from the suite's torch-marked test module as they were.
pytestmark = pytest.mark.torch


def _series(
    system: str,
    values: list[float],
    timeouts: list[float] | None = None,
    *,
    measure: str = "m",
    group: str = "g",
    n: int = 4,
    metric: str = "seconds",
) -> Series:
    return Series(
        measure,
        group,
        system,
        "torch",
        n,
        samples=[{metric: v} for v in values],
        timeouts=timeouts or [],
    )


def test_timeouts_count_as_infinite_and_make_the_ratio_a_bound() -> None:
    measure = Measure(
        name="m",
        letter="x",
        title="t",
        metrics=(SECONDS,),
        groups=(
            Group(
                name="g",
                systems=(System("ours", "aioelastic", "x:y"), System("theirs", "torch", "x:y")),
                rows=(Row("case", "ours", "theirs"),),
                ns=(4,),
            ),
        ),
    )
    results = [_series("ours", [0.5, 0.6, 0.7]), _series("theirs", [0.9], timeouts=[5.0, 5.0])]
    stats = summarise(results[1], SECONDS)
    assert math.isinf(stats.median or 0.0)
    assert stats.limit == 5.0
    (row,) = build_rows([measure], results)
    assert row["ratio_is_lower_bound"] is True
    assert row["ratio"] == pytest.approx(5.0 / 0.6)
    table = render_table([measure], [row])
    assert "| case | 4 | ms | 600 | > 5000 | theirs | >8.3x |" in table


def test_higher_is_better_inverts_the_ratio() -> None:
    rate = Metric("seconds", "lines/s", higher_is_better=True)
    ours, theirs = _series("a", [300.0]), _series("b", [100.0])
    from benchmarks.harness._report import ratio

    value, bound = ratio(summarise(ours, rate), summarise(theirs, rate), rate)
    assert value == pytest.approx(3.0)
    assert bound is False


def _claim_measure(floor: float) -> Measure:
    return Measure(
        name="m",
        letter="x",
        title="t",
        metrics=(SECONDS, Metric("other", "ms")),
        groups=(
            Group(
                name="g",
                systems=(System("ours", "aioelastic", "x:y"), System("theirs", "torch", "x:y")),
                rows=(Row("case", "ours", "theirs", quick_min_ratio=Claim(4, None, floor)),),
                ns=(4,),
            ),
        ),
    )


def test_check_claims_fails_a_row_behind_its_minimum_ratio_and_one_that_did_not_run() -> None:
    results = [_series("ours", [1.0, 1.1, 1.2]), _series("theirs", [0.8, 0.8, 0.8])]
    for series in results:
        series.samples = [{"seconds": s["seconds"], "other": 1.0} for s in series.samples]
    rows = build_rows([_claim_measure(0.7)], results)
    # Only the headline (first) metric carries the claim.
    assert [r["quick_min_ratio"] for r in rows] == [0.7, None]
    assert check_claims(rows) == []  # 0.8 / 1.1 = 0.73 >= 0.7

    behind = build_rows([_claim_measure(0.75)], results)
    assert check_claims(behind) == [
        "m: case N=4 (ours vs theirs): ratio 0.73 < 0.75",
    ]

    missing = build_rows([_claim_measure(0.5)], [results[0]])
    assert check_claims(missing) == [
        "m: case N=4 (ours vs theirs): no ratio (a side did not run), needs >= 0.5"
    ]


def test_check_claims_fails_a_row_over_its_bound_and_one_without_a_number() -> None:
    measure = Measure(
        name="m",
        letter="x",
        title="t",
        metrics=(SECONDS,),
        groups=(
            Group(
                name="g",
                systems=(System("ours", "aioelastic", "x:y"),),
                rows=(Row("case", "ours", quick_max=Claim(4, None, 0.020)),),
                ns=(4,),
            ),
        ),
    )
    within = build_rows([measure], [_series("ours", [0.010, 0.015, 0.030])])
    assert check_claims(within) == []  # the median, 15 ms, is within 20 ms
    over = build_rows([measure], [_series("ours", [0.010, 0.025, 0.030])])
    assert check_claims(over) == ["m: case N=4 (ours): 25.0 > 20 ms"]
    missing = build_rows([measure], [_series("ours", [])])
    assert check_claims(missing) == ["m: case N=4 (ours): no number, needs <= 20 ms"]


def test_a_claim_is_the_recorded_figure_with_its_allowance_or_the_target_if_looser() -> None:
    assert ALLOWANCE == 1.5
    # A ratio: recorded / 1.5, unless the target is lower.
    assert Claim(8, recorded=1.2, target=1.0).at_least() == pytest.approx(0.8)
    assert Claim(8, recorded=3.0, target=1.0).at_least() == 1.0
    assert Claim(8, recorded=3.0).at_least() == 2.0
    assert Claim(8, recorded=3.0, target=2.5, loaded=1.5).at_least() == 1.5
    # A bound on ours: recorded x 1.5, unless the target is higher.
    assert Claim(1, recorded=0.010, target=0.020).at_most() == 0.020
    assert Claim(1, recorded=0.030, target=0.020).at_most() == pytest.approx(0.045)
    assert Claim(1, recorded=None, target=0.020).at_most() == 0.020
    with pytest.raises(ValueError, match="N=1 needs a recorded figure or a target"):
        Claim(1, recorded=None)


def test_a_claim_is_checked_at_its_n_only() -> None:
    results = [
        _series(system, [value], n=n)
        for n in (4, 8)
        for system, value in (("ours", 1.0), ("theirs", 0.5))
    ]
    rows = build_rows([_claim_measure(0.7)], results)
    assert [(r["n"], r["quick_min_ratio"]) for r in rows if r["metric"] == "seconds"] == [
        (4, 0.7),
        (8, None),
    ]
    assert check_claims(rows) == ["m: case N=4 (ours vs theirs): ratio 0.50 < 0.7"]


def _recorded_rows() -> list[dict[str, Any]]:
    """The rows of the recorded run, built from its samples by today's measures."""
    document = json.loads(RECORDED.read_text())
    return build_rows(all_measures(), [Series(**entry) for entry in document["series"]])


def test_every_claim_states_the_recorded_figure_at_an_n_quick_runs() -> None:
    # A claim derives from the recorded run: a run recorded again must restate them.
    recorded = {
        (r["measure"], r["group"], r["case"], r["n"], r["metric"]): r for r in _recorded_rows()
    }
    seen = 0
    for measure in all_measures():
        for group in measure.groups:
            for row in group.rows:
                metric = row.metric or measure.metrics[0].name
                for claim, figure in ((row.quick_min_ratio, "ratio"), (row.quick_max, "ours")):
                    if claim is None:
                        continue
                    seen += 1
                    where = f"{measure.name}/{group.name}: {row.case} N={claim.n}"
                    assert claim.n in group.quick_ns, where
                    assert claim.n in group.ns, where
                    if claim.recorded is None:
                        continue
                    line = recorded[(measure.name, group.name, row.case, claim.n, metric)]
                    value = line["ratio"] if figure == "ratio" else line["ours"]["median"]
                    assert claim.recorded == pytest.approx(value, rel=0.005), where
    assert seen == 12


def test_the_recorded_run_passes_its_own_claims() -> None:
    assert check_claims(_recorded_rows()) == []


def test_write_readme_refuses_a_file_without_markers(tmp_path: Path) -> None:
    from benchmarks.harness._report import replace_between_markers

    with pytest.raises(
        ValueError, match=re.escape("markers <!-- x:start --> ... <!-- x:end --> not")
    ):
        replace_between_markers("no markers here", "x", "table")


def test_a_row_can_carry_its_headline_and_claim_on_a_later_metric() -> None:
    measure = Measure(
        name="m",
        letter="x",
        title="t",
        metrics=(SECONDS, Metric("other", "ms")),
        groups=(
            Group(
                name="g",
                systems=(System("ours", "aioelastic", "x:y"), System("theirs", "torch", "x:y")),
                rows=(
                    Row(
                        "case",
                        "ours",
                        "theirs",
                        quick_min_ratio=Claim(4, None, 3.0),
                        headline_n=4,
                        metric="other",
                    ),
                ),
                ns=(4,),
            ),
        ),
    )
    # A workload that yields only the later metric: no row for the first one.
    results = [_series("ours", []), _series("theirs", [])]
    results[0].samples = [{"other": 1.0}]
    results[1].samples = [{"other": 2.0}]
    (row,) = build_rows([measure], results)
    assert (row["metric"], row["headline"], row["quick_min_ratio"]) == ("other", True, 3.0)
    assert check_claims([row]) == ["m: case N=4 (ours vs theirs): ratio 2.00 < 3"]


@pytest.mark.timeout(30)
def test_the_scale_figure_reads_each_panel_from_its_own_measure_and_metric() -> None:
    from benchmarks.harness._plots import _curves

    results = [
        _series(
            "ours", [5.0, 3.0, 4.0], measure="scale", group="memory", n=32, metric="kb_per_worker"
        ),
        _series("ours", [2.0], measure="scale", group="memory", n=8, metric="kb_per_worker"),
        # Another group of the same measure: not in the curve.
        _series("ours", [9.0], measure="scale", group="cost", n=8, metric="per_worker"),
        Series("scale", "memory", "broken", "aioelastic", 8, status="error"),
    ]
    assert _curves(results, "scale", "memory", "kb_per_worker") == {
        "ours": [(8, 2.0, 2.0, 2.0), (32, 4.0, 3.0, 5.0)]
    }


@pytest.mark.timeout(30)
def test_no_scale_figure_is_drawn_from_a_run_without_the_scale_measures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.harness._plots import plot_scale

    path = tmp_path / "scale.png"
    startup_only = [
        _series("aioelastic/fork", [0.01], measure="startup", group="fn", n=8, metric="seconds")
    ]
    assert plot_scale(startup_only, path) is False
    assert not path.exists()
    assert "neither binary (i) nor scale (j)" in capsys.readouterr().err


def test_a_whole_count_is_printed_without_decimals() -> None:
    from benchmarks.harness._report import _fmt

    ranks = Metric("ranks", "ranks", ratio=False, count=True)
    assert [_fmt(v, ranks) for v in (6.0, 0.0, 4.5)] == ["6", "0", "4.50"]
    # Not a count: the same figure keeps its decimals.
    assert _fmt(6.0, Metric("x", "x", ratio=False)) == "6.00"
