"""The child side of spawned workers: a script without a ``__main__`` guard."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.paths import REPO

UNGUARDED = textwrap.dedent(
    """
    import os, anyio, aioelastic

    def work(i):
        return i

    print(f"module body pid={os.getpid()}", flush=True)
    {call}
    print("parent got", result, flush=True)
    """
)

CALLS = {
    "run_processes": (
        "result = anyio.run(aioelastic.run_processes, 'g', work, {0: (0,), 1: (1,)}, "
        "{0: {}, 1: {}})"
    ),
    "spawn": (
        "try:\n"
        "    result = anyio.run(lambda: aioelastic.spawn(work, nprocs=2))\n"
        "except aioelastic.ProcessExitedException as e:\n"
        "    result = e\n"
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_script_without_a_main_guard_fails_once_per_worker_naming_the_fix(
    tmp_path: Path, call: str
) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.replace("{call}", CALLS[call]))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=90,
    )
    out = done.stdout + done.stderr
    # The parent and each of the two workers ran the module body at most once (the first
    # failure stops the other worker, perhaps before it got there); no worker started
    # workers of its own.
    assert 2 <= out.count("module body pid=") <= 3, out
    assert "parent got" in out, out
    expected = (
        "RuntimeError: start_processes() was called while a spawned worker was importing "
        f"{script} to find the function it runs: the script starts workers at module "
        "level. Put that code under 'if __name__ == \"__main__\":'"
    )
    # At least the first failing worker's own traceback; the other may have been stopped.
    assert expected in done.stderr, out
    assert "Can't get attribute" not in out


@pytest.mark.timeout(30)
def test_a_fresh_interpreter_is_given_the_directory_that_holds_the_package() -> None:
    from aioelastic._core.start._launchers import python_command

    code = python_command("pass")[-1]
    appended = code.split("sys.path.append(", 1)[1].split(")", 1)[0]
    directory = Path(ast.literal_eval(appended))
    assert (directory / "aioelastic" / "__init__.py").is_file()
