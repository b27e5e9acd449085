"""``aioelastic-run --preload``: script workers forked from a warm interpreter behave as fresh.

Each case runs the same script twice under ``python -m aioelastic.run``: once as a fresh
interpreter (the default) and once forked from the ``--preload`` fork server, and compares
what the script saw and how it ended: the launcher's exit status, the worker's stderr, the
error file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.support.cli_run import launch, launcher, with_env
from tests.support.paths import CHILDREN, REPO
from tests.support.ports import free_port
from tests.support.waits import wait_all_gone

PROBE = str(CHILDREN / "preload_probe.py")
READY = re.compile(r"ready pid=(\d+)")
TABLE = "=" * 20


def _facts(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in stdout.splitlines() if line.startswith("FACTS ")]


def _worker_stderr(stderr: str) -> str:
    """The workers' own stderr: the launcher's lines and failure table left out."""
    text = stderr.split(TABLE)[0]
    return "".join(
        line for line in text.splitlines(keepends=True) if not line.startswith("[aioelastic-run]")
    )


def _root_cause(stderr: str) -> str:
    """The failure table's root cause, without the lines that differ between runs."""
    if TABLE not in stderr:
        return ""
    table = stderr[stderr.index(TABLE) :]
    return re.sub(r"(time|host)\s+: .*|pid: \d+|error_file: .*", "", table)


CASES = {
    "success": (["argv", "a", "--b"], 0),
    "sys.exit(3)": (["exit", "3"], 3),
    "sys.exit(258)": (["exit", "258"], 2),
    "sys.exit('bye')": (["exit-text"], 1),
    "os._exit(0)": (["os-exit", "0"], 0),
    "os._exit(5)": (["os-exit", "5"], 5),
    "uncaught exception": (["raise"], 1),
    "shutdown: threads joined, atexit run": (["shutdown"], 0),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", [False, True], ids=["script", "-m"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_preloaded_worker_is_indistinguishable_from_a_fresh_interpreter(
    case: str, module: bool
) -> None:
    argv, code = CASES[case]
    script = ["-m", "tests.children.preload_probe"] if module else [PROBE]
    # One worker: with two, which failing rank is the root cause is a race.
    common = [*script, *argv]
    fresh = launch(*common)
    warm = launch("--preload", "json,tests.children", *common)
    assert fresh.proc.returncode == code, fresh.stderr
    assert warm.proc.returncode == code, warm.stderr
    fresh_facts, warm_facts = _facts(fresh.stdout), _facts(warm.stdout)
    assert len(fresh_facts) == 1
    assert warm_facts == fresh_facts
    facts = warm_facts[0]
    assert facts["name"] == "__main__"
    assert facts["main_is_this"] is True
    assert facts["file"] == PROBE
    assert facts["spec"] == ("tests.children.preload_probe" if module else None)
    assert facts["path"][0] == (str(REPO) if module else os.path.dirname(PROBE))  # type: ignore[index]
    assert facts["argv"] == [PROBE, *argv]
    assert facts["env"]["RANK"] == "0"  # type: ignore[index]
    assert warm.stdout == fresh.stdout
    assert _worker_stderr(warm.stderr) == _worker_stderr(fresh.stderr)
    assert _root_cause(warm.stderr) == _root_cause(fresh.stderr)
    if case == "uncaught exception":
        assert "Traceback (most recent call last):" in warm.stderr
        assert "ValueError: probe failure" in warm.stderr
        assert "_script.py" not in warm.stderr
        assert ("runpy" in warm.stderr) is module  # python -m shows runpy's frames too


def _frames(stderr: str) -> list[str]:
    """A traceback as its frames (file, function) and its last line, without line numbers."""
    lines = [line for line in _worker_stderr(stderr).splitlines() if line.strip()]
    frames = [
        f"{m.group(1)}:{m.group(2)}"
        for line in lines
        if (m := re.match(r'\s*File "(.*)", line \d+, in (\S+)', line))
    ]
    return [*frames, lines[-1]]


def _interrupted(*argv: str) -> tuple[int, str]:
    with launcher(*argv) as run:
        (ready,) = run.wait_for(READY, 1)
        os.kill(int(ready.group(1)), signal.SIGINT)
        return run.finish(), run.stderr


@pytest.mark.timeout(120)
def test_sigint_raises_keyboardinterrupt_and_kills_by_sigint_as_in_a_fresh_interpreter() -> None:
    fresh_code, fresh_err = _interrupted(PROBE, "wait")
    warm_code, warm_err = _interrupted("--preload", "json", PROBE, "wait")
    assert fresh_code == warm_code == 128 + signal.SIGINT
    assert "KeyboardInterrupt" in warm_err
    # Which line of the wait loop the signal interrupts is a race: compare the frames.
    assert _frames(warm_err) == _frames(fresh_err)
    assert _frames(warm_err)[-1] == "KeyboardInterrupt"
    for err in (fresh_err, warm_err):
        assert re.search(r"exitcode\s+: -2 ", _root_cause(err)), err
        assert "  KeyboardInterrupt\n" in _root_cause(err)


@pytest.mark.timeout(120)
def test_record_writes_the_error_file_that_the_report_quotes(tmp_path: Path) -> None:
    fresh = launch("--log-dir", str(tmp_path / "fresh"), PROBE, "record")
    warm = launch("--preload", "json", "--log-dir", str(tmp_path / "warm"), PROBE, "record")
    assert fresh.proc.returncode == warm.proc.returncode == 1
    for run, base in ((fresh, "fresh"), (warm, "warm")):
        (error_file,) = (tmp_path / base).glob("*/attempt_0/0/error.json")
        data = json.loads(error_file.read_text())
        assert "recorded probe failure" in data["message"]["message"]
        assert f"error_file: {error_file}" in run.stderr
    assert _root_cause(warm.stderr) == _root_cause(fresh.stderr)


@pytest.mark.timeout(120)
def test_restarts_fork_from_the_same_warm_server() -> None:
    # Set through the environment, as every flag can be.
    run = launch("--max-restarts", "2", PROBE, "restart", env=with_env(PET_PRELOAD="json"))
    assert run.proc.returncode == 0, run.stderr
    seen = re.findall(r"parent=(\d+) count=(\d)", run.stdout)
    assert sorted(count for _, count in seen) == ["0", "1", "2"]
    parents = {int(parent) for parent, _ in seen}
    assert len(parents) == 1, seen  # one fork server for every attempt
    assert parents != {run.proc.pid}


@pytest.mark.torch  # a two-node c10d rendezvous
@pytest.mark.timeout(120)
def test_the_warm_up_runs_while_the_rendezvous_waits_for_other_nodes() -> None:
    port = free_port()
    argv = [
        "--nnodes", "2", "--node-rank", "0", "--master-port", str(port),
        "--preload", "tests.children.preload_marker", PROBE, "argv",
    ]  # fmt: skip
    with launcher(*argv) as run:
        # Node 1 never comes: no worker can start, yet the server imports the preload.
        (line,) = run.wait_for(re.compile(r"preloaded pid=(\d+)"), 1)
        server = int(line.group(1))
        assert server != run.proc.pid
        assert run.proc.poll() is None
        assert _facts(run.stdout) == []
        run.proc.send_signal(signal.SIGINT)
        assert run.finish() == 128 + signal.SIGINT, run.stderr
    assert wait_all_gone([server], timeout=30) == []


@pytest.mark.timeout(120)
def test_a_preload_that_starts_threads_is_refused_naming_the_module() -> None:
    start = time.monotonic()
    run = launch("--preload", "json,tests.children.preload_threads", PROBE, "argv")
    assert time.monotonic() - start < 60
    assert run.proc.returncode == 1, run.stderr
    assert (
        "preloading 'tests.children.preload_threads' started 1 thread(s) (poller); forked "
        "workers would inherit their locks in whatever state they are in: drop "
        "'tests.children.preload_threads' from --preload"
    ) in run.stderr
    assert _facts(run.stdout) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "env", "fragment"),
    [
        (["--preload", "json", "--no-python", "true"], {}, "--preload and --no-python cannot"),
        (["--preload", "json,3d", PROBE], {}, "argument --preload: '3d' is not a module name"),
        ([PROBE], {"PET_PRELOAD": "a..b"}, "PET_PRELOAD='a..b' (for --preload): 'a..b' is not"),
        (["--preload", "no_such_module_x", PROBE], {}, "'no_such_module_x' is not installed"),
    ],
)
def test_preload_usage_errors_exit_2(argv: list[str], env: dict[str, str], fragment: str) -> None:
    run = launch(*argv, env=with_env(**env))
    assert run.proc.returncode == 2, run.stderr
    assert fragment in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.timeout(120)
def test_a_preload_that_initialised_cuda_is_refused_naming_the_module(tmp_path: Path) -> None:
    # No GPU here: a stand-in ``torch`` whose CUDA reports itself initialised, imported by
    # the preloaded module as a real one would be.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_initialized():\n        return True\n"
    )
    (tmp_path / "uses_cuda.py").write_text("import torch\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    run = launch("--preload", "uses_cuda", PROBE, "argv", env=with_env(PYTHONPATH=path))
    assert run.proc.returncode == 1, run.stderr
    assert (
        "preloading 'uses_cuda' initialised CUDA, which a forked worker cannot use: drop "
        "'uses_cuda' from --preload"
    ) in run.stderr
    assert _facts(run.stdout) == []


@pytest.mark.timeout(120)
def test_a_syntax_error_reads_as_in_a_fresh_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("x = (\n")
    fresh = launch(str(script))
    warm = launch("--preload", "json", str(script))
    assert fresh.proc.returncode == warm.proc.returncode == 1
    assert "SyntaxError: '(' was never closed" in warm.stderr
    assert _worker_stderr(warm.stderr) == _worker_stderr(fresh.stderr)
    assert _root_cause(warm.stderr) == _root_cause(fresh.stderr)


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_a_preloaded_torch_uses_the_thread_count_of_a_fresh_worker() -> None:
    # OpenMP reads OMP_NUM_THREADS when torch loads it: in the server, not in the worker.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    fresh = launch("--nproc-per-node", "2", PROBE, "torch", env=env)
    warm = launch("--nproc-per-node", "2", "--preload", "torch", PROBE, "torch", env=env)
    assert fresh.proc.returncode == warm.proc.returncode == 0, warm.stderr
    assert re.findall(r"torch threads=\d+", warm.stdout) == ["torch threads=1"] * 2
    assert re.findall(r"torch threads=\d+", fresh.stdout) == ["torch threads=1"] * 2


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(300)
def test_ddp_under_a_preloaded_torch_gives_the_same_parameters(tmp_path: Path) -> None:
    cli = str(CHILDREN / "cli.py")
    outs = {}
    for name, extra in (("fresh", []), ("warm", ["--preload", "torch,torch.distributed"])):
        out = tmp_path / f"{name}.json"
        run = launch("--nproc-per-node", "2", *extra, cli, "ddp", "--out", str(out), timeout=240)
        assert run.proc.returncode == 0, run.stderr
        outs[name] = json.loads(out.read_text())
    assert outs["warm"]["world_size"] == 2
    assert outs["warm"] == outs["fresh"]
