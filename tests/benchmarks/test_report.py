"""What the table says: ratios, timeouts as bounds, claims, generated docs, the scale figure."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from benchmarks.harness._report import build_rows, check_claims, render_table, summarise
from benchmarks.harness._run import Series
from benchmarks.harness._spec import SECONDS, Group, Measure, Metric, Row, System

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
                rows=(Row("case", "ours", "theirs", quick_min_ratio=floor),),
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
                rows=(Row("case", "ours", quick_max=0.020),),
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
                        "case", "ours", "theirs", quick_min_ratio=3.0, headline_n=4, metric="other"
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
