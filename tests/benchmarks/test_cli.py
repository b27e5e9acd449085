"""The benchmark suite works: it runs, prints its table and writes well-formed JSON.

These tests never judge a speed: the numbers of a run on a shared CI machine mean little.
They check the machinery (drivers, interleaving, the table, the JSON) end to end, through
``python -m benchmarks`` and ``python -m benchmarks.cpu_split``; the pieces of logic that
decide what the table says are in ``test_report.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness._run_dir import filesystem_of

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


#: N of the split's test: enough workers that /proc's 10 ms ticks are a few per cent of a
#: side's CPU (256 workers of ~0.6 ms each), and each side still runs in about 0.2 s.
SPLIT_N = 256


@pytest.mark.timeout(120)
def test_cpu_split_accounts_for_no_more_cpu_than_the_cores_had() -> None:
    # One repetition: each printed figure is that run's own, so they must add up.
    proc = _run("--n", str(SPLIT_N), "--reps", "1", timeout=110, module="benchmarks.cpu_split")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    cores = os.cpu_count() or 1
    assert lines[0] == f"N={SPLIT_N} x /bin/true, torch loaded; medians of 1, ms per worker:"
    assert lines[3].split() == [
        "side", "wall", "supervisor", "of", "it", "gc", "full", "helper", "workers", "sum", "idle"
    ]  # fmt: skip
    rows = {line[:45].strip(): line[45:].split() for line in lines[4:7]}
    assert set(rows) == {
        "aioelastic run_processes",
        "torch start_processes + wait(period=0.01)",
        "floor: posix_spawn + waitpid",
    }
    # What /proc's clock ticks may misstate, per worker: the idle time of each core and
    # the watchdog's four counters, each read twice and truncated to a tick.
    tick = 1000 / os.sysconf("SC_CLK_TCK") / SPLIT_N
    slack = (cores + 4) * tick
    floors = {}
    for name, cells in rows.items():
        wall, supervisor, in_gc, full, helper, workers, total = map(float, cells[:7])
        idle = float(cells[7].rstrip("%")) / 100
        assert total == pytest.approx(supervisor + helper + workers, abs=0.0025), name
        # The cores' time in the run is what the three used, what stayed idle and what
        # other processes used: the first two never exceed it.
        assert total + idle * wall * cores <= wall * cores * 1.005 + slack, (name, cells)
        # Every side does some work in the supervisor, and each worker's exec and exit
        # costs the kernel well over 0.1 ms.
        assert supervisor >= 0.01, (name, cells)
        assert 0 <= in_gc <= wall, (name, cells)  # the collector's wall time in the run
        assert int(full) >= 0, name
        assert workers >= 0.1, (name, cells)
        assert 0 <= idle <= 1, (name, cells)
        floors[name.split()[0].rstrip(":")] = total / cores
    assert float(rows["aioelastic run_processes"][4]) >= 0.01  # the watchdog spawned them
    # The same /bin/true on every side: its exec and exit cost about the same whoever
    # reaps it, read from /proc for ours and from getrusage for the others (the bound
    # above loosens as a loaded machine stretches the wall time; this does not).
    floor_workers = float(rows["floor: posix_spawn + waitpid"][5])
    for name, cells in rows.items():
        assert 0.5 <= float(cells[5]) / floor_workers <= 2, (name, cells)
    for name in ("torch start_processes + wait(period=0.01)", "floor: posix_spawn + waitpid"):
        assert float(rows[name][4]) == 0, name  # no helper
    prefix = f"CPU-bound floor (sum / {cores} cores), ms per worker: "
    assert lines[7].startswith(prefix)
    shown = dict(part.split() for part in lines[7][len(prefix) :].split(", "))
    assert shown.keys() == floors.keys()
    for side, floor in floors.items():
        assert float(shown[side]) == pytest.approx(floor, abs=0.0011), side
