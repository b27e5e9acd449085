"""The benchmark suite works: it runs, prints its table and writes well-formed JSON.

These tests never judge a speed: the numbers of a run on a shared CI machine mean little.
They check the machinery (drivers, interleaving, the table, the JSON) and the pieces of
logic that decide what the table says (ratios, timeouts, broken-line counting).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness._report import build_rows, check_claims, render_table, summarise
from benchmarks.harness._run import Series
from benchmarks.harness._run_dir import filesystem_of
from benchmarks.harness._spec import SECONDS, Group, Measure, Metric, Row, System
from benchmarks.measures._common import Capture, count_lines

# The harness times torch's side of every row: it needs torch.
pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]


def _run(
    *args: str, timeout: float, module: str = "benchmarks"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(90)
def test_quick_floor_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    runs = tmp_path / "runs"
    runs.mkdir()
    proc = _run(
        "--quick",
        "--only",
        "floor",
        "--ns",
        "1,2",
        "--json",
        str(out),
        "--run-dir",
        str(runs),
        timeout=80,
    )
    assert proc.returncode == 0, proc.stderr
    assert list(runs.iterdir()) == []  # the run directory was made there, and removed
    assert "### floor: physical floor" in proc.stdout
    assert "| fork+exec /bin/true, to exit | 2 | ms |" in proc.stdout

    document = json.loads(out.read_text())
    assert document["meta"]["quick"] is True
    assert document["meta"]["command"].startswith("python -m benchmarks --quick")
    assert document["meta"]["leaked_pids"] == []
    assert document["meta"]["files"] == {"dir": str(runs), "fs": filesystem_of(runs)}
    assert filesystem_of(runs) not in ("", "unknown")
    rows = document["rows"]
    assert {(r["case"], r["n"]) for r in rows} == {
        (case, n)
        for case in (
            "fork+exec /bin/true, to exit",
            "fork+exec python -S -c pass, to exit",
            "fork of a torch-loaded process, to user code",
            "SIGTERM to N torch-loaded children, to the last reaped",
        )
        for n in (1, 2)
    }
    for row in rows:
        assert row["theirs"] is None
        ours = row["ours"]
        assert ours["status"] == "ok"
        assert ours["reps"] == 2
        assert 0 < ours["minimum"] <= ours["median"] <= ours["maximum"] < 10
    series = document["series"]
    assert len(series) == 8  # 4 systems x N = 1, 2
    assert all(len(s["samples"]) == 2 for s in series)

    # The JSON holds everything the table needs: re-rendering it prints the same table.
    again = _run("--from-json", str(out), timeout=30)
    assert again.returncode == 0, again.stderr
    assert again.stdout == proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_completion_runs_both_sides_interleaved(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run("--quick", "--only", "b", "--ns", "1", "--json", str(out), timeout=110)
    assert proc.returncode == 0, proc.stderr
    # Progress lines show the interleaving: each system's repetition in turn.
    progress = [
        line.split(" N=1 ")[1].split(":")[0] for line in proc.stderr.splitlines() if " N=1 " in line
    ]
    assert progress[:2] == ["aioelastic/binary", "torch.elastic/binary"]
    document = json.loads(out.read_text())
    rows = {(r["case"], r["theirs_system"]): r for r in document["rows"]}
    assert set(rows) == {
        ("bin /bin/true", "torch.elastic/binary"),
        ("fn no-op forkserver", "torch.elastic/forkserver"),
        ("fn no-op forkserver", "torch.mp/forkserver"),
    }
    for row in rows.values():
        assert row["theirs"]["status"] == "ok"
        assert row["ours"]["status"] in ("ok", "n/a")
        if row["ours"]["status"] == "ok":
            assert row["ratio"] == pytest.approx(row["theirs"]["median"] / row["ours"]["median"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_failure_detection_ends_when_the_first_sibling_is_told_to_stop(tmp_path: Path) -> None:
    # Every sibling stamps its SIGTERM; "detected" is the first stamp after rank 0's
    # failure, for every system, and comes before the caller holds the failure.
    out = tmp_path / "bench.json"
    proc = _run("--quick", "--only", "failure", "--ns", "2", "--json", str(out), timeout=170)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(out.read_text())
    systems = set()
    for series in document["series"]:
        assert series["status"] == "ok", series
        assert series["samples"]
        for sample in series["samples"]:
            assert 0 < sample["detected"] <= sample["seconds"]
        systems.add(series["system"])
    assert systems == {
        "aioelastic/binary",
        "torch.elastic/binary",
        "aioelastic/forkserver",
        "torch.elastic/forkserver",
        "torch.mp/forkserver",
    }
    assert "| bin | 2 | detected, ms |" in proc.stdout


def test_a_run_directory_that_cannot_be_made_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    proc = _run("--only", "floor", "--run-dir", str(tmp_path / "missing"), timeout=30)
    assert proc.returncode != 0
    assert f"--run-dir {tmp_path / 'missing'}: not a writable directory" in proc.stderr
    assert "### floor" not in proc.stdout


def test_unknown_measure_is_refused() -> None:
    proc = _run("--only", "nonsense", timeout=30)
    assert proc.returncode != 0
    assert "unknown measure(s) nonsense" in proc.stderr


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


def _capture(text: bytes) -> Capture:
    capture = Capture()
    capture.data += text
    capture.chunks.append((1, len(text)))
    return capture


def test_count_lines_finds_lost_split_merged_and_duplicated_lines() -> None:
    pad = "x" * 4
    good = "".join(f"[bench{r}]:{r} {i} {pad}\n" for r in range(2) for i in range(3))
    assert count_lines(_capture(good.encode()), n=2, lines=3, width=4).__dict__ == {
        "good": 6,
        "lost": 0,
        "broken": 0,
    }
    damaged = (
        f"[bench0]:0 0 {pad}\n"
        f"[bench0]:0 1 xx\n"  # split: first half ...
        f"[bench0]:xx\n"  # ... and second half
        f"[bench1]:1 0 {pad}[bench1]:1 1 {pad}\n"  # merged
        f"[bench1]:0 2 {pad}\n"  # rank 0's line under rank 1's prefix
        f"[bench0]:0 0 {pad}\n"  # duplicate
        f"[bench1]:1 2 {pad}"  # no final newline
    )
    counted = count_lines(_capture(damaged.encode()), n=2, lines=3, width=4)
    assert counted.good == 1
    assert counted.lost == 5
    assert counted.broken == 6


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


@pytest.mark.timeout(150)
def test_check_exits_non_zero_from_json_when_a_claim_fails(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run("--quick", "--only", "binary", "--ns", "8", "--json", str(out), timeout=140)
    assert proc.returncode in (0, 3), proc.stderr
    document = json.loads(out.read_text())
    checked = [r for r in document["rows"] if r["quick_min_ratio"] is not None]
    assert {r["case"] for r in checked} == {
        "bin, torch period=0.01",
        "bin vs floor (target >= 0.5)",
        "bin tee=3 both, torch period=0.01",
    }
    # The same run with aioelastic 100 times slower: the check must now fail.
    for series in document["series"]:
        if series["kind"] == "aioelastic":
            series["samples"] = [{k: v * 100 for k, v in s.items()} for s in series["samples"]]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(document))
    again = _run("--from-json", str(broken), "--check", timeout=30)
    assert again.returncode == 3, again.stdout + again.stderr
    assert "Behind the claim:" in again.stdout


@pytest.mark.timeout(150)
def test_write_readme_regenerates_the_tables_between_markers_only(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run("--quick", "--only", "binary", "--ns", "8", "--json", str(out), timeout=140)
    assert proc.returncode in (0, 3), proc.stderr
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(
        "# intro\n<!-- benchmarks:readme:start -->\nold\n<!-- benchmarks:readme:end -->\nafter\n"
    )
    docs.write_text("top\n<!-- benchmarks:docs:start -->\nold\n<!-- benchmarks:docs:end -->\n")
    args = ["--from-json", str(out), "--write-readme", "--readme", str(readme), "--docs", str(docs)]
    again = _run(*args, timeout=30)
    assert again.returncode == 0, again.stderr
    text = readme.read_text()
    assert text.startswith(
        "# intro\n<!-- benchmarks:readme:start -->\nFrom `python -m benchmarks --quick"
    )
    assert text.endswith("<!-- benchmarks:readme:end -->\nafter\n")
    assert "old" not in text
    # Headline rows only, each naming torch's configuration.
    assert "| binary: bin, torch period=0.01 | 8 |" in text
    assert "torch.elastic/binary wait(period=0.01) (torch loaded)" in text
    assert "bin vs floor" not in text  # its headline N (256) did not run
    page = docs.read_text()
    assert "#### i. binary:" in page
    assert "| bin vs floor (target >= 0.5) | 8 | per_worker, ms |" in page
    # Idempotent: a second regeneration changes nothing.
    _run(*args, timeout=30)
    assert readme.read_text() == text


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


def test_every_row_names_systems_of_its_group_and_a_metric_of_its_measure() -> None:
    from benchmarks.measures import all_measures

    for measure in all_measures():
        names = {m.name for m in measure.metrics}
        for group in measure.groups:
            labels = {s.label for s in group.systems}
            for row in group.rows:
                where = f"{measure.name}/{group.name}: {row.case}"
                assert row.ours in labels, where
                assert row.theirs is None or row.theirs in labels, where
                assert row.metric is None or row.metric in names, where
                assert row.metrics is None or set(row.metrics) <= names, where
                assert row.metrics is None or (row.metric or measure.metrics[0].name) in (
                    row.metrics
                ), where  # a row shows its own headline metric


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


@pytest.mark.timeout(60)
def test_the_scale_figure_of_the_committed_run_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the plot extra (matplotlib)")
    path = tmp_path / "scale.png"
    proc = _run(
        "--from-json",
        str(ROOT / "benchmarks" / "results" / "latest.json"),
        "--plot-scale",
        str(path),
        timeout=50,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_multinode_is_measure_k_and_quick_runs_only_its_exit_and_sigterm_cases() -> None:
    from benchmarks.harness._run import Plan
    from benchmarks.measures import all_measures, multinode

    letters = [m.letter for m in all_measures()]
    assert len(letters) == len(set(letters))
    assert multinode.MEASURE.letter == "k"
    plan = Plan(measures=[multinode.MEASURE], quick=True)
    quick = {g.name: [s.label for s in plan.systems_for(g, 2)] for g in multinode.MEASURE.groups}
    both = ["aioelastic-run", "torchrun --monitor-interval 0.01"]
    # gloo imports torch in 6 ranks per side and a vanished node takes ours ~8 s: full runs only.
    assert quick == {
        "exit": both,
        "gloo": [],
        "kill": [],
        "store": [],
        "term": both,
        "recover": [],
        "recover-silent": [],
    }
    for group in multinode.MEASURE.groups:
        assert group.params["cap"] == 60.0
        assert group.name.startswith("recover") or group.quick_params["cap"] == 10.0


def test_multinode_finds_every_process_of_a_launchers_session() -> None:
    from benchmarks.measures.multinode import _session

    # A leader and its child in a session of their own, as each node's launcher runs.
    leader = subprocess.Popen(
        ["/bin/sh", "-c", "/bin/sleep 60 & echo $!; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        assert sorted(_session(leader.pid)) == sorted([leader.pid, child])
        assert os.getpid() not in _session(leader.pid)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
        assert leader.stdout is not None
        leader.stdout.close()


def test_multinode_stamps_each_exit_and_gives_up_at_the_deadline() -> None:
    from benchmarks.measures.multinode import _wait_exits
    from benchmarks.programs._clock import now_ns

    quick = subprocess.Popen(["/bin/true"])
    stays = subprocess.Popen(["/bin/sleep", "60"])
    fds = [os.pidfd_open(quick.pid), os.pidfd_open(stays.pid)]
    try:
        before = now_ns()
        ended = _wait_exits(fds[:1], before + 10**10)
        assert ended is not None
        assert before < ended[fds[0]] <= now_ns()
        assert _wait_exits(fds, now_ns() + 50_000_000) is None  # 50 ms: sleep still runs
    finally:
        stays.kill()
        for proc in (quick, stays):
            proc.wait(timeout=10)
        for fd in fds:
            os.close(fd)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_multinode_times_ours_and_stops_torchrun_at_the_cap(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run("--quick", "--only", "multinode", "--json", str(out), timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    document = json.loads(out.read_text())
    # Every launcher, worker and torchrun worker (each in a session of its own) is gone.
    assert document["meta"]["leaked_pids"] == []
    series = {(s["group"], s["system"]): s for s in document["series"]}
    assert set(series) == {
        (group, system)
        for group in ("exit", "term")
        for system in ("aioelastic-run", "torchrun --monitor-interval 0.01")
    }
    for group in ("exit", "term"):
        ours = series[(group, "aioelastic-run")]
        assert ours["status"] == "ok", ours
        (sample,) = ours["samples"]
        assert 0 < sample["stopped"] <= sample["seconds"] < 10.0
        # torchrun's other nodes learn of the failure only through their ranks: never here.
        theirs = series[(group, "torchrun --monitor-interval 0.01")]
        assert (theirs["status"], theirs["samples"], theirs["timeouts"]) == ("ok", [], [10.0])
    assert "| exit, the others wait silently | 2 | seconds, ms to every launcher's exit |" in (
        proc.stdout
    )
    assert "| > 10000 | torchrun --monitor-interval 0.01 | >" in proc.stdout


@pytest.mark.timeout(120)
def test_cpu_split_prints_each_sides_cpu_per_worker() -> None:
    proc = _run("--n", "16", "--reps", "2", timeout=110, module="benchmarks.cpu_split")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    cores = os.cpu_count() or 1
    assert lines[0] == "N=16 x /bin/true, torch loaded; medians of 2, ms per worker:"
    assert lines[3].split() == [
        "side", "wall", "supervisor", "of", "it", "gc", "full", "helper", "workers", "sum", "idle"
    ]  # fmt: skip
    rows = {line[:45].strip(): line[45:].split() for line in lines[4:7]}
    assert set(rows) == {
        "aioelastic run_processes",
        "torch start_processes + wait(period=0.01)",
        "floor: posix_spawn + waitpid",
    }
    floors = {}
    for name, (wall, supervisor, in_gc, full, helper, workers, total, idle) in rows.items():
        assert float(wall) > 0, name
        # /proc counts in 10 ms ticks: at N=16 a share may round to 0, never below.
        assert min(float(supervisor), float(helper), float(workers)) >= 0, name
        assert float(in_gc) >= 0, name
        assert int(full) >= 0, name
        # Medians of sums are not sums of medians; the sum is never below any share.
        assert float(total) >= max(float(supervisor), float(helper), float(workers)), name
        assert idle.endswith("%"), name
        assert 0 <= int(idle[:-1]) <= 100, name
        floors[name.split()[0].rstrip(":")] = float(total) / cores
    prefix = f"CPU-bound floor (sum / {cores} cores), ms per worker: "
    assert lines[7].startswith(prefix)
    shown = dict(part.split() for part in lines[7][len(prefix) :].split(", "))
    assert shown.keys() == floors.keys()
    for side, floor in floors.items():
        assert float(shown[side]) == pytest.approx(floor, abs=0.0011), side
    for name in ("torch start_processes + wait(period=0.01)", "floor: posix_spawn + waitpid"):
        assert float(rows[name][4]) == 0, name  # no helper
