"""What the fork server imports and hands on: the preload, the main script, the calls.

A preload that fails is imported once for all ranks; the preload imports without automatic
collections and workers have them back; the supervisor's main script is imported only for
a call that refers to it, and a script the server cannot import fails only those calls;
a call reaches its worker whole, in the start request or through a pipe.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import aioelastic
from aioelastic._core.start._forkserver import INLINE_CALL_MAX, ForkServerError, fork_server
from tests.children import core, preload_gc
from tests.support.fork_server import add_on_server, stop_fork_server as _stop
from tests.support.groups import envs
from tests.support.paths import CHILDREN, REPO


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_preload_that_fails_is_imported_once_for_all_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preload = ("tests.children.forkserver_fails",)
    imports = tmp_path / "imports"
    monkeypatch.setenv("AIOELASTIC_TEST_IMPORTS", str(imports))
    start = time.monotonic()
    with pytest.raises(ForkServerError) as caught:
        await add_on_server("fails", preload, *[(1, 1)] * 4)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert message.startswith(
        "the fork server could not import "
        "forkserver_preload=['tests.children.forkserver_fails']: Traceback"
    )
    assert message.endswith("ImportError: this preload fails to import on purpose")
    assert len(imports.read_text().splitlines()) == 1
    assert fork_server(preload).pid is None


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_calls_reach_the_worker_whole_in_the_request_and_through_a_pipe() -> None:
    # Around the size where the pickled call stops travelling inside the start request
    # and goes through a pipe the supervisor feeds.
    sizes = [10, INLINE_CALL_MAX - 200, INLINE_CALL_MAX + 1, 4 * INLINE_CALL_MAX]
    values = {rank: os.urandom(size) for rank, size in enumerate(sizes)}
    result = await aioelastic.run_processes(
        "calls",
        core.identity,
        {rank: (value,) for rank, value in values.items()},
        envs(len(sizes)),
        start_method="forkserver",
    )
    assert not result.is_failed(), result.failures
    assert result.return_values == values


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_thresholds", [False, True], ids=["default", "preload-sets-its-own"])
async def test_the_preload_imports_without_automatic_collections_and_workers_have_them(
    own_thresholds: bool,
) -> None:
    # Paused during the import (it made a tenth of a cold start with torch), then frozen
    # and given back: a worker collects as a fresh interpreter would, unless the preload
    # chose thresholds of its own, which it keeps.
    # Not imported here: it would set its thresholds in this process.
    own = "tests.children.preload_gc_own"
    preload = (own if own_thresholds else preload_gc.__name__,)
    try:
        result = await aioelastic.run_processes(
            "collector",
            preload_gc.collector_state,
            {0: ()},
            envs(1),
            start_method="forkserver",
            forkserver_preload=preload,
        )
    finally:
        _stop(preload)
    assert not result.is_failed(), result.failures
    state = result.return_values[0]
    expected = [5000, 20, 20] if own_thresholds else list(gc.get_threshold())
    assert state["threshold_at_import"][0] == 0
    assert state["threshold"] == expected
    assert state["enabled"] is True
    assert state["frozen"] > 0


def _script_report(script: str, *args: str) -> Any:
    """Run ``tests/children/SCRIPT ARGS`` as a main script (bounded, exit 0); its JSON."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(CHILDREN / script), *args],
        cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert time.monotonic() - start < 50
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.timeout(60)
def test_the_server_imports_the_main_script_only_for_a_call_that_refers_to_it(
    tmp_path: Path,
) -> None:
    # A call to a module's function never runs the supervisor's script in the server
    # (that import would lengthen every cold start); a function of the script still works.
    report = _script_report("lazy_main.py", str(tmp_path / "marks"))
    assert report["module_call"] == {"0": 3}
    assert report["after_module_call"] == ["__main__"]
    assert report["script_call"] == {"0": 42}
    assert report["after_script_call"] == ["__main__", "__mp_main__"]


@pytest.mark.timeout(60)
def test_a_main_script_the_server_cannot_import_fails_only_the_calls_that_need_it(
    tmp_path: Path,
) -> None:
    # The script raises when imported as anything but __main__: a call to one of its own
    # functions fails with the import's traceback named, a module's function still runs,
    # and the supervising process ends with nothing left behind.
    report = _script_report("main_fails_in_server.py")
    assert report["script_call"].startswith(
        "the fork server could not import the supervisor's main module, which the call "
        "refers to: Traceback"
    )
    assert "this script refuses to be imported" in report["script_call"]
    assert report["module_call"] == {"0": 3}
