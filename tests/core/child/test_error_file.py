"""Error files (``child/_error_file.py``): written whole, read back, by torch too, and hostile.

A worker writes its error file; the supervisor reads it. What a report makes of what was
read is in tests/core/reports/test_errors.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import aioelastic
from aioelastic._core.child._error_file import read_error_file, write_error_file
from aioelastic._core.reports._failures import ChildFailedError, ProcessFailure
from tests.children import soak
from tests.children.errors import BAD_FILES, make_bad_error_file, sabotage
from tests.support.failures import ERRORS_CHILD, caught, run_errors_child
from tests.support.paths import REPO
from tests.support.waits import ReadyFifo

# --- written and read back ----------------------------------------------------------------


def test_write_then_read_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    before = time.time_ns()
    write_error_file(path, caught(ValueError("boom")))
    after = time.time_ns()

    data = read_error_file(path)
    assert data is not None
    assert set(data) == {"message"}
    message = data["message"]
    assert message["message"] == "ValueError: boom"
    extra = message["extraInfo"]
    assert set(extra) == {"py_callstack", "timestamp", "timestamp_ns"}
    assert extra["py_callstack"].startswith("Traceback (most recent call last):")
    assert "in _raise" in extra["py_callstack"]
    assert extra["py_callstack"].rstrip().endswith("ValueError: boom")
    ns = int(extra["timestamp_ns"])
    assert before <= ns <= after
    assert int(extra["timestamp"]) == ns // 1_000_000_000
    # Only the final file: no temporary file is left next to it, and it is world-readable.
    assert os.listdir(tmp_path) == ["error.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_write_keeps_chained_exceptions_and_message_override(tmp_path: Path) -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as e:
        exc = e
    path = tmp_path / "error.json"
    write_error_file(str(path), exc, message="worker 3 could not pickle its return value")
    data = read_error_file(str(path))
    assert data is not None
    assert data["message"]["message"] == "worker 3 could not pickle its return value"
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert "KeyError: 'inner'" in callstack
    assert "RuntimeError: outer" in callstack


def test_write_creates_parent_dir_and_replaces_old_file(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "error.json"
    write_error_file(path, caught(ValueError("first")))
    write_error_file(path, caught(ValueError("second")))
    data = read_error_file(path)
    assert data is not None
    assert data["message"]["message"] == "ValueError: second"
    assert os.listdir(path.parent) == ["error.json"]


def test_write_failure_prints_one_line_and_does_not_raise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    write_error_file(blocker / "error.json", caught(ValueError("boom")))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "could not write error file" in err
    assert str(blocker / "error.json") in err


def test_write_survives_unprintable_exception(tmp_path: Path) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str for you")

    path = tmp_path / "error.json"
    write_error_file(path, caught(Unprintable()))
    data = read_error_file(path)
    assert data is not None
    assert data["message"]["message"] == "Unprintable: <unprintable Unprintable object>"


@pytest.mark.timeout(60)
def test_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    # A large message makes a non-atomic writer's truncate-then-write window wide; a
    # concurrent reader must only ever see a missing file or a whole one.
    path = tmp_path / "error.json"
    big = "x" * 400_000  # twice in the file (message and traceback): under the 1 MiB cap
    stop = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            seen.append("whole" if read_error_file(path) is not None else repr(text[:40]))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(40):
            write_error_file(path, caught(ValueError(f"{i} {big}")))
    finally:
        stop.set()
        thread.join()
    assert seen
    assert set(seen) == {"whole"}


@pytest.mark.parametrize(
    "content", [None, b"", b"{", b"not json", b"[1, 2]", b'"str"', b"\xff\xfe{}", b"null"]
)
def test_read_returns_none_for_missing_or_bad_files(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "error.json"
    if content is not None:
        path.write_bytes(content)
    assert read_error_file(path) is None


def test_read_returns_none_for_a_directory(tmp_path: Path) -> None:
    assert read_error_file(tmp_path) is None


# --- torch interop ------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_torch_written_error_file_is_read_by_us(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    error_file = tmp_path / "error.json"
    proc, exit_time = run_errors_child("torch-raise", "boom from torch", error_file=error_file)
    assert proc.returncode == 1, proc.stderr
    failure = ProcessFailure.from_exit(
        local_rank=0, pid=1, exitcode=1, error_file=str(error_file), exit_time=exit_time
    )
    assert failure.message == "ValueError: boom from torch"
    # torch's file has whole seconds only, so the exit time is the more precise timestamp.
    assert failure.timestamp == exit_time
    callstack = failure.error_file_data["message"]["extraInfo"]["py_callstack"]
    assert "ValueError: boom from torch" in callstack
    report = ChildFailedError("trainer", {0: failure}).format_msg()
    assert "in main" in report
    assert "ValueError: boom from torch" in report


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_our_error_file_is_read_by_torch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    error_file = tmp_path / "error.json"
    proc, _ = run_errors_child("ours-raise", "boom from ours", error_file=error_file)
    assert proc.returncode == 1, proc.stderr
    dumped = tmp_path / "parent-error.json"
    read, _ = run_errors_child("torch-read", str(error_file), str(dumped))
    assert read.returncode == 0, read.stderr
    summary = json.loads(read.stdout)
    ours = json.loads(error_file.read_text())
    # torch's ProcessFailure keeps the message dict and parses the int-seconds timestamp.
    assert summary["message"]["message"] == "ValueError: boom from ours"
    assert summary["timestamp"] == int(ours["message"]["extraInfo"]["timestamp"])
    assert "in main" in summary["report"]
    assert "ValueError: boom from ours" in summary["report"]
    # torch's ErrorHandler re-dumps it for its own parent, adding the error code.
    parent = json.loads(dumped.read_text())
    assert parent["message"]["message"] == "ValueError: boom from ours"
    assert parent["message"]["errorCode"] == 1
    assert parent["message"]["extraInfo"] == ours["message"]["extraInfo"]


# --- hostile error files ------------------------------------------------------------------
# A worker (or anything running as its user) controls its error file; the supervisor reads
# it. Each kind of bad file must give a clear message, in bounded time and memory, through
# ProcessFailure directly, through a real failing worker, and through aioelastic-run.

BAD_FILE_MESSAGES = {
    "fifo": "error file unreadable: it is a FIFO (named pipe), not a regular file",
    "dev-zero": "error file unreadable: it is a symbolic link to '/dev/zero', outside its "
    "directory '{dir}'",
    "huge": "error file unreadable: it is 314572800 bytes, over the 1048576-byte (1 MiB) cap, "
    "and its first 1 MiB holds no message",
    "bad-json": "error file unreadable: not valid JSON (Unterminated string starting at: "
    "line 1 column 25 (char 24))",
    "bad-timestamp": "ValueError: from the future",
}


def _expected_message(kind: str, path: Path) -> str:
    return BAD_FILE_MESSAGES[kind].format(dir=os.path.realpath(path.parent))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", BAD_FILES)
def test_bad_error_file_read_directly_is_named_and_bounded(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "0" / "error.json"
    make_bad_error_file(str(path), kind)
    start = time.monotonic()
    failure = ProcessFailure.from_exit(
        local_rank=0,
        pid=10,
        exitcode=3,
        error_file=str(path),
        exit_time=1_700_000_000.5,
        stderr_tail=["last words"],
    )
    direct = ProcessFailure(local_rank=1, pid=11, exitcode=3, error_file=str(path))
    report = ChildFailedError("trainer", {0: failure, 1: direct}).format_msg()
    assert time.monotonic() - start < 2
    expected = _expected_message(kind, path)
    if kind == "bad-timestamp":
        assert failure.message == direct.message == expected
        # Both timestamps are invalid: the supervisor's exit time, and "now" for torch's
        # constructor, stand in for them.
        assert failure.timestamp == 1_700_000_000.5
        assert abs(direct.timestamp - time.time()) < 60
    else:
        assert failure.message == f"{expected}\nlast words"
        assert direct.message == expected
        assert failure.error_file_data == direct.error_file_data == {}
    assert failure.exitcode == direct.exitcode == 3
    assert failure.error_file == direct.error_file == str(path)
    assert expected in report


@pytest.mark.timeout(60)
def test_huge_sparse_error_file_costs_little_time_and_memory(tmp_path: Path) -> None:
    # Measured in a fresh interpreter: this process's peak RSS reflects earlier tests.
    path = tmp_path / "error.json"
    make_bad_error_file(str(path), "huge")
    proc = subprocess.run(
        [*ERRORS_CHILD, "measure-read", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    summary = json.loads(proc.stdout)
    assert summary["message"] == summary["direct"] == _expected_message("huge", path)
    assert summary["seconds"] < 1.0  # reading all 300 MB took ~0.7 s; the cap makes it ~5 ms
    assert summary["rss_growth_kib"] < 16 * 1024  # loading it grew the process by ~600 MB


def test_huge_error_file_keeps_the_message_found_in_its_first_mib(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    body = json.dumps(
        {"message": {"message": "MemoryError: big", "extraInfo": {"py_callstack": "x" * 2**21}}}
    )
    path.write_text(body)
    failure = ProcessFailure.from_exit(
        local_rank=0, pid=1, exitcode=1, error_file=str(path), exit_time=5.0
    )
    assert failure.message == (
        f"MemoryError: big\n[error file cut: it is {len(body)} bytes, over the 1048576-byte "
        "(1 MiB) cap; only its first 1 MiB was read]"
    )
    assert failure.error_file == str(path)


def test_symlink_inside_its_directory_is_followed(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    write_error_file(real, caught(ValueError("via link")))
    link = tmp_path / "error.json"
    link.symlink_to("real.json")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(link))
    assert failure.message == "ValueError: via link"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "it is empty"),
        (b"[1, 2]", "it holds a JSON list, not an object"),
        (b"null", "it holds a JSON NoneType, not an object"),
        (b"\xff\xfe{}", "not valid JSON ("),
        (b"[" * 100_000, "not valid JSON ("),
        (b'{"message": ' + b"9" * 5000 + b"}", "not valid JSON ("),
        (b'{"message": 3}', 'it has no "message" text'),
        (b'{"message": {"message": ["x"]}}', 'it has no "message" text'),
        (b'{"other": 1}', 'it has no "message" text'),
    ],
)
def test_malformed_error_file_is_salvaged_with_its_exit_code(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "error.json"
    path.write_bytes(content)
    failure = ProcessFailure.from_exit(
        local_rank=0, pid=1, exitcode=7, error_file=str(path), exit_time=5.0
    )
    assert failure.message.startswith(f"error file unreadable: {why}")
    assert failure.exitcode == 7
    assert failure.error_file == str(path)
    ChildFailedError("t", {0: failure}).format_msg()


@pytest.mark.parametrize(
    "timestamp_ns",
    [
        '"' + "9" * 400 + '"',
        '"' + "9" * 25 + '"',
        '"-5"',
        "NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        '"12abc"',
        "true",
        "[1]",
    ],
)
def test_bad_timestamps_fall_back_to_the_exit_time(tmp_path: Path, timestamp_ns: str) -> None:
    path = tmp_path / "error.json"
    extra = f'{{"timestamp_ns": {timestamp_ns}, "timestamp": {timestamp_ns}}}'
    path.write_text(f'{{"message": {{"message": "E: x", "extraInfo": {extra}}}}}')
    failure = ProcessFailure.from_exit(
        local_rank=0, pid=1, exitcode=1, error_file=str(path), exit_time=1_700_000_000.25
    )
    assert failure.message == "E: x"
    assert failure.timestamp == 1_700_000_000.25
    direct = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert abs(direct.timestamp - time.time()) < 60
    assert "E: x" in ChildFailedError("t", {0: failure, 1: direct}).format_msg()


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", BAD_FILES)
async def test_worker_that_sabotages_its_error_file_is_reported(tmp_path: Path, kind: str) -> None:
    import aioelastic

    start = time.monotonic()
    result = await aioelastic.run_processes(
        "saboteur", sabotage, {0: (kind, "3")}, {0: {}}, log_dir=str(tmp_path / "logs")
    )
    assert time.monotonic() - start < 60
    failure = result.failures[0]
    assert failure.exitcode == 3
    expected = _expected_message(kind, Path(failure.error_file))
    assert failure.message.startswith(expected)
    assert failure.error_file.endswith("/0/error.json")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", BAD_FILES)
def test_cli_with_a_sabotaged_error_file_exits_with_the_worker_code(
    tmp_path: Path, kind: str
) -> None:
    env = dict(os.environ)
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aioelastic.run",
            "--nproc-per-node",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
            "-m",
            "tests.children.errors",
            "sabotage",
            kind,
            "3",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert time.monotonic() - start < 90
    assert proc.returncode == 3, proc.stderr
    error_files = list((tmp_path / "logs").rglob("error.json"))
    assert len(error_files) == 1
    assert _expected_message(kind, error_files[0]) in proc.stderr
    assert "Traceback" not in proc.stderr.split("FAILED")[0]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_worker_killed_while_writing_its_error_file_leaves_no_temp_file(
    tmp_path: Path,
) -> None:
    """The soak's "temp files" finding, made deterministic.

    Two ways a worker dies while recording an error: the supervisor's SIGTERM/SIGKILL
    of a failed group reaching a sibling that is raising too, or a close() with SIGINT
    (KeyboardInterrupt is recorded) followed by SIGKILL. The worker here stops right
    before it publishes the file, and is SIGKILLed there.
    """
    fifo = ReadyFifo(tmp_path)
    log_dir = tmp_path / "logs"
    try:
        async with aioelastic.start_processes(
            "errfile",
            soak.stop_while_publishing_error_file,
            {0: (str(fifo.path),)},
            {0: {}},
            log_dir=log_dir,
            start_method="fork",
        ) as ctx:
            word, pid = (await fifo.lines(1))[0].split()
            assert word == "publishing"
            os.kill(int(pid), signal.SIGKILL)
            result = await ctx.wait()
    finally:
        fifo.close()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGKILL
    left = sorted(p.name for p in (log_dir / "0").iterdir())
    assert left == [], f"left in the worker's log dir: {left}"
