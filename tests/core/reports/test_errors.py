"""Error files, ProcessFailure, ChildFailedError, record, and interop with torch's versions."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import pytest

from aioelastic._core.child._error_file import read_error_file, write_error_file
from aioelastic._core.reports._failures import ChildFailedError, ProcessFailure
from aioelastic._core.reports._record import record
from aioelastic._core.reports._results import RunProcsResult
from tests.children.errors import BAD_FILES, make_bad_error_file, sabotage

CHILD = [sys.executable, "-m", "tests.children.errors"]
REPO_ROOT = str(Path(__file__).resolve().parents[3])


def _run_child(
    *args: str, error_file: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run a child program to completion; return it and the time its exit was seen."""
    env = dict(os.environ)
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    proc = subprocess.run(
        [*CHILD, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    return proc, time.time()


def _raise(exc: BaseException) -> NoReturn:
    raise exc


def _caught(exc: BaseException) -> BaseException:
    """``exc`` with a real traceback, as an except block would see it."""
    try:
        _raise(exc)
    except BaseException as e:
        return e


def _failure(rank: int, timestamp: float, **kw: Any) -> ProcessFailure:
    fields: dict[str, Any] = {
        "local_rank": rank,
        "pid": 1000 + rank,
        "exitcode": 1,
        "error_file": f"/logs/{rank}/error.json",
        "message": f"ValueError: rank {rank}",
        "timestamp": timestamp,
    }
    fields.update(kw)
    return ProcessFailure(**fields)


# --- error files ---------------------------------------------------------------------------


def test_write_then_read_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    before = time.time_ns()
    write_error_file(path, _caught(ValueError("boom")))
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
    write_error_file(path, _caught(ValueError("first")))
    write_error_file(path, _caught(ValueError("second")))
    data = read_error_file(path)
    assert data is not None
    assert data["message"]["message"] == "ValueError: second"
    assert os.listdir(path.parent) == ["error.json"]


def test_write_failure_prints_one_line_and_does_not_raise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    write_error_file(blocker / "error.json", _caught(ValueError("boom")))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "could not write error file" in err
    assert str(blocker / "error.json") in err


def test_write_survives_unprintable_exception(tmp_path: Path) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str for you")

    path = tmp_path / "error.json"
    write_error_file(path, _caught(Unprintable()))
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
            write_error_file(path, _caught(ValueError(f"{i} {big}")))
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


# --- ProcessFailure ------------------------------------------------------------------------


def test_from_exit_with_our_error_file_written_by_a_real_worker(tmp_path: Path) -> None:
    error_file = tmp_path / "0" / "error.json"
    proc, exit_time = _run_child("ours-raise", "boom from ours", error_file=error_file)
    assert proc.returncode == 1
    failure = ProcessFailure.from_exit(
        local_rank=0,
        pid=4242,
        exitcode=proc.returncode,
        error_file=str(error_file),
        exit_time=exit_time,
        stderr_tail=proc.stderr.splitlines(),
    )
    assert failure.message == "ValueError: boom from ours"
    assert failure.error_file == str(error_file)
    assert failure.error_file_data == json.loads(error_file.read_text())
    # The timestamp is the moment of the exception (from timestamp_ns), just before exit.
    assert exit_time - 30 < failure.timestamp <= exit_time
    assert failure.timestamp != int(failure.timestamp)
    report = ChildFailedError("trainer", {0: failure}).format_msg()
    assert "in main" in report
    assert "ValueError: boom from ours" in report


def test_from_exit_with_string_shaped_error_file(tmp_path: Path) -> None:
    # torch's reader also accepts {"message": "<text>", "timestamp": ...}.
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "custom failure text", "timestamp": "1700000000"}))
    failure = ProcessFailure.from_exit(
        local_rank=1, pid=10, exitcode=2, error_file=str(path), exit_time=1700000000.25
    )
    assert failure.message == "custom failure text"
    assert failure.timestamp == 1700000000.25
    assert "custom failure text" in ChildFailedError("t", {1: failure}).format_msg()


def test_from_exit_with_unparseable_error_file_names_the_fault_and_keeps_stderr(
    tmp_path: Path,
) -> None:
    path = tmp_path / "error.json"
    path.write_text('{"message": {"mess')
    failure = ProcessFailure.from_exit(
        local_rank=0,
        pid=10,
        exitcode=1,
        error_file=str(path),
        exit_time=5.5,
        stderr_tail=["Traceback (most recent call last):", "OSError: disk full"],
    )
    assert failure.message == (
        "error file unreadable: not valid JSON (Unterminated string starting at: "
        "line 1 column 14 (char 13))\n"
        "Traceback (most recent call last):\nOSError: disk full"
    )
    assert failure.exitcode == 1
    assert failure.error_file == str(path)
    assert failure.error_file_data == {}
    assert failure.timestamp == 5.5


def test_from_exit_plain_script_shows_its_traceback(tmp_path: Path) -> None:
    proc, exit_time = _run_child("plain-raise", "no decorator here")
    assert proc.returncode == 1
    failure = ProcessFailure.from_exit(
        local_rank=0,
        pid=77,
        exitcode=proc.returncode,
        error_file=str(tmp_path / "error.json"),
        exit_time=exit_time,
        stderr_tail=proc.stderr.splitlines(keepends=True),
    )
    assert failure.error_file == "<N/A>"
    assert failure.error_file_data == {}
    assert failure.timestamp == exit_time
    assert failure.message.startswith("Traceback (most recent call last):")
    assert failure.message.endswith("ValueError: no decorator here")
    assert "\n\n" not in failure.message  # keepends lines are joined without doubling
    report = ChildFailedError("script", {0: failure}).format_msg()
    assert "in inner" in report
    assert "ValueError: no decorator here" in report


def test_from_exit_keeps_only_the_last_50_stderr_lines() -> None:
    lines = [f"line {i}" for i in range(120)]
    failure = ProcessFailure.from_exit(
        local_rank=0,
        pid=1,
        exitcode=1,
        error_file="/nonexistent/e.json",
        exit_time=1.0,
        stderr_tail=lines,
    )
    assert failure.message.split("\n") == [f"line {i}" for i in range(70, 120)]


def test_from_exit_killed_by_signal_without_output() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL
    failure = ProcessFailure.from_exit(
        local_rank=2,
        pid=99,
        exitcode=proc.returncode,
        error_file="/nonexistent/e.json",
        exit_time=time.time(),
        stderr_tail=["", "  "],
    )
    assert failure.signal_name() == "SIGKILL"
    assert failure.message == "killed by SIGKILL (signal 9)"
    report = ChildFailedError("trainer", {2: failure}).format_msg()
    assert "exitcode  : -9 (pid: 99) (SIGKILL)" in report
    assert "killed by SIGKILL (signal 9)" in report


def test_from_exit_segfault_under_record_shows_faulthandler_stack(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    proc, exit_time = _run_child("ours-segv", error_file=error_file)
    assert proc.returncode == -signal.SIGSEGV
    assert not error_file.exists()
    failure = ProcessFailure.from_exit(
        local_rank=0,
        pid=5,
        exitcode=proc.returncode,
        error_file=str(error_file),
        exit_time=exit_time,
        stderr_tail=proc.stderr.splitlines(),
    )
    assert failure.signal_name() == "SIGSEGV"
    assert "about to crash" in failure.message
    assert "Fatal Python error: Segmentation fault" in failure.message
    assert "in main" in failure.message  # record enabled faulthandler, which names the frame


def test_from_exit_plain_exit_code(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    proc, exit_time = _run_child("ours-exit", "3", error_file=error_file)
    assert proc.returncode == 3
    assert not error_file.exists()  # SystemExit is not recorded
    failure = ProcessFailure.from_exit(
        local_rank=0, pid=5, exitcode=3, error_file=str(error_file), exit_time=exit_time
    )
    assert failure.message == "exited with code 3"
    assert failure.signal_name() == "<N/A>"


def test_unknown_signal_number() -> None:
    failure = ProcessFailure.from_exit(
        local_rank=0, pid=5, exitcode=-70, error_file="/nonexistent/e.json", exit_time=1.0
    )
    assert failure.signal_name() == "<N/A>"
    assert failure.message == "killed by signal 70"


def test_timestamps_have_sub_second_resolution(tmp_path: Path) -> None:
    stamps = []
    for i in range(2):
        path = tmp_path / f"{i}.json"
        write_error_file(path, _caught(ValueError(str(i))))
        stamps.append(
            ProcessFailure.from_exit(
                local_rank=i, pid=i, exitcode=1, error_file=str(path), exit_time=time.time() + 60
            ).timestamp
        )
    assert 0 < stamps[1] - stamps[0] < 1  # same second, still ordered
    failure = _failure(0, 1_700_000_000.123456)
    iso = failure.timestamp_isoformat()
    assert ".123456" in iso
    parsed = datetime.fromisoformat(iso)
    assert parsed.utcoffset() is not None  # local time, with its offset
    assert parsed.timestamp() == pytest.approx(1_700_000_000.123456, abs=1e-6)


def test_constructor_with_only_torch_fields_reads_the_error_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    before = time.time()
    write_error_file(path, _caught(ValueError("x")))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message == "ValueError: x"
    assert before - 1 < failure.timestamp <= time.time()
    assert failure.error_file == str(path)
    assert failure.error_file_data == json.loads(path.read_text())


def test_constructor_reads_torch_string_shape_with_whole_second_timestamp(
    tmp_path: Path,
) -> None:
    # As torch's __post_init__: the whole-second "timestamp" is the failure's time.
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "custom failure text", "timestamp": "1700000000"}))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert failure.message == "custom failure text"
    assert failure.timestamp == 1700000000


def test_constructor_without_error_file_describes_the_exit(tmp_path: Path) -> None:
    before = time.time()
    failure = ProcessFailure(0, 7, -9, str(tmp_path / "missing.json"))
    assert failure.error_file == "<N/A>"
    assert failure.message == "killed by SIGKILL (signal 9)"
    assert failure.error_file_data == {}
    assert before <= failure.timestamp <= time.time()


def test_constructor_given_any_derived_field_does_no_io(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_error_file(path, _caught(ValueError("x")))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path), message="m")
    assert failure.message == "m"
    assert failure.timestamp == 0.0
    assert failure.error_file_data == {}


# --- ChildFailedError ----------------------------------------------------------------------


def test_empty_failures_rejected() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        ChildFailedError("trainer", {})


def test_get_first_failure_is_the_earliest() -> None:
    failures = {
        0: _failure(0, 100.30),
        5: _failure(1, 100.10),
        3: _failure(2, 100.20),
    }
    assert ChildFailedError("t", failures).get_first_failure() == (5, failures[5])
    # Ties go to the lowest rank, whatever the dict order.
    tied = {7: _failure(1, 5.0), 2: _failure(0, 5.0), 9: _failure(2, 6.0)}
    assert ChildFailedError("t", tied).get_first_failure()[0] == 2


def test_format_msg_contents(tmp_path: Path) -> None:
    path = tmp_path / "1" / "error.json"
    write_error_file(path, _caught(ValueError("the root cause")))
    root = ProcessFailure.from_exit(
        local_rank=1, pid=4321, exitcode=1, error_file=str(path), exit_time=time.time() + 1
    )
    killed = ProcessFailure.from_exit(
        local_rank=0,
        pid=999,
        exitcode=-15,
        error_file="/nonexistent",
        exit_time=root.timestamp + 0.5,
    )
    later = _failure(2, root.timestamp + 1.0, exitcode=3, pid=555, message="exited with code 3")
    exc = ChildFailedError("trainer", {10: killed, 11: root, 12: later})
    msg = exc.format_msg()
    assert str(exc) == msg

    lines = msg.split("\n")
    assert lines[0] == ""
    assert lines[1] == "=" * len(lines[1])
    assert lines[2] == "trainer FAILED"
    failures_at = lines.index("Failures:")
    root_at = lines.index("Root Cause (first observed failure):")
    others, root_section = "\n".join(lines[failures_at:root_at]), "\n".join(lines[root_at:])

    host = socket.getfqdn()
    assert f"  host      : {host}" in root_section
    assert "  rank      : 11 (local_rank: 1)" in root_section
    assert "  exitcode  : 1 (pid: 4321)" in root_section
    assert f"  error_file: {path}" in root_section
    assert "  traceback : Traceback (most recent call last):" in root_section
    assert "in _raise" in root_section
    assert "  ValueError: the root cause" in root_section
    assert root.timestamp_isoformat() in root_section

    assert "  rank      : 10 (local_rank: 0)" in others
    assert "  exitcode  : -15 (pid: 999) (SIGTERM)" in others
    assert "killed by SIGTERM (signal 15)" in others
    assert "  rank      : 12 (local_rank: 2)" in others
    assert "  exitcode  : 3 (pid: 555)\n" in others
    # Other failures are listed in the order they happened.
    assert others.index("rank      : 10") < others.index("rank      : 12")
    assert "rank      : 11" not in others

    border = "=" * 60
    assert lines[1] == border
    assert lines[-1] == border
    assert exc.format_msg("#", "~").split("\n")[3] == "~" * 60


def test_format_msg_single_failure_has_no_other_failures() -> None:
    msg = ChildFailedError("w", {0: _failure(0, 1.0)}).format_msg()
    assert "Failures:\n  <NO_OTHER_FAILURES>\n" in msg
    assert "w FAILED" in msg
    assert "  traceback : ValueError: rank 0" in msg


def test_a_nodes_end_is_reported_without_a_made_up_rank_or_exit() -> None:
    # Another node's end that is not a worker's (its launcher got a signal, it vanished,
    # the store was lost) leads a report with no rank and no process of its own.
    node_end = ProcessFailure(
        local_rank=-1,
        pid=-1,
        exitcode=-1,
        error_file="<N/A>",
        message="stopped: node 2 (10.0.0.3) vanished: no heartbeat for 5 s",
        timestamp=2.0,
        host="10.0.0.3",
    )
    msg = ChildFailedError("w", {-1: node_end, 0: _failure(0, 3.0)}).format_msg()
    root = msg[msg.index("Root Cause") :]
    assert "  rank      : none (a node's end, not a worker's: see traceback)" in root
    assert "  exitcode  : none (no process)" in root
    assert "  host      : 10.0.0.3" in root
    assert "-1" not in root
    assert "  rank      : 0 (local_rank: 0)" in msg[: msg.index("Root Cause")]


def test_child_failed_error_pickles(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_error_file(path, _caught(ValueError("pickled")))
    root = ProcessFailure.from_exit(
        local_rank=0, pid=1, exitcode=1, error_file=str(path), exit_time=time.time()
    )
    exc = ChildFailedError("trainer", {0: root, 1: _failure(1, root.timestamp + 1)})
    exc._host = "node-7.example"  # the report names the host the workers ran on
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is ChildFailedError
    assert copy.name == "trainer"
    assert copy.failures == exc.failures
    assert copy.get_first_failure() == exc.get_first_failure()
    assert str(copy) == str(exc)
    assert "node-7.example" in str(copy)

    # An unresolved host is resolved before pickling, keeping the origin's name.
    fresh = pickle.loads(pickle.dumps(ChildFailedError("x", {0: root})))
    assert fresh.host == socket.getfqdn()


def test_child_failed_error_traceback_print_shows_report() -> None:
    exc = _caught(ChildFailedError("trainer", {0: _failure(0, 1.0)}))

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert "Root Cause (first observed failure):" in text


# --- record --------------------------------------------------------------------------------


def test_record_writes_error_file_and_reraises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main(a: int, *, b: int) -> int:
        """Doc."""
        if a == b:
            raise ValueError(f"equal {a}")
        return a + b

    assert main.__name__ == "main"
    assert main.__doc__ == "Doc."
    assert main.__wrapped__ is not None  # type: ignore[attr-defined]
    assert main(1, b=2) == 3
    assert not path.exists()
    with pytest.raises(ValueError, match="equal 4"):
        main(4, b=4)
    data = read_error_file(path)
    assert data is not None
    assert data["message"]["message"] == "ValueError: equal 4"
    assert "in main" in data["message"]["extraInfo"]["py_callstack"]


@pytest.mark.parametrize("exc", [SystemExit(3), SystemExit(0), KeyboardInterrupt()])
def test_record_passes_system_exit_and_interrupt_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main() -> None:
        raise exc

    with pytest.raises(type(exc)) as info:
        main()
    assert info.value is exc
    assert not path.exists()


def test_record_without_error_file_env_warns_once_and_reraises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)

    @record
    def main() -> None:
        raise OSError("nope")

    with (
        caplog.at_level(logging.WARNING, logger="aioelastic.errors"),
        pytest.raises(OSError, match="nope"),
    ):
        main()
    warnings = [r for r in caplog.records if r.name == "aioelastic.errors"]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "\n" not in text
    assert "TORCHELASTIC_ERROR_FILE is not set" in text
    assert "OSError" in text


def test_record_of_nested_failure_records_the_root_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner_file = tmp_path / "inner" / "error.json"
    write_error_file(inner_file, _caught(ZeroDivisionError("deep down")))
    root = ProcessFailure.from_exit(
        local_rank=1, pid=2, exitcode=-6, error_file=str(inner_file), exit_time=time.time()
    )
    nested = ChildFailedError("inner", {0: _failure(0, root.timestamp + 1), 1: root})
    outer_file = tmp_path / "outer" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(outer_file))

    @record
    def main() -> None:
        raise nested

    with pytest.raises(ChildFailedError):
        main()
    outer = read_error_file(outer_file)
    assert outer is not None
    assert outer["message"]["message"] == "ZeroDivisionError: deep down"
    assert outer["message"]["extraInfo"] == root.error_file_data["message"]["extraInfo"]
    assert outer["message"]["errorCode"] == -6
    assert "errorCode" not in root.error_file_data["message"]  # the source is not mutated

    # The outer supervisor then reports the inner root cause, with its original time.
    outer_failure = ProcessFailure.from_exit(
        local_rank=0, pid=3, exitcode=1, error_file=str(outer_file), exit_time=time.time() + 5
    )
    assert outer_failure.message == "ZeroDivisionError: deep down"
    assert outer_failure.timestamp == root.timestamp


def test_record_of_nested_failure_without_error_file_carries_stderr_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = ProcessFailure.from_exit(
        local_rank=0,
        pid=2,
        exitcode=1,
        error_file=str(tmp_path / "missing.json"),
        exit_time=1_700_000_000.5,
        stderr_tail=["Traceback (most recent call last):", '  File "x.py"', "KeyError: 'k'"],
    )
    outer_file = tmp_path / "outer.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(outer_file))

    @record
    def main() -> None:
        raise ChildFailedError("inner", {0: root})

    with pytest.raises(ChildFailedError):
        main()
    outer_failure = ProcessFailure.from_exit(
        local_rank=0, pid=3, exitcode=1, error_file=str(outer_file), exit_time=1_800_000_000.0
    )
    assert outer_failure.message == "KeyError: 'k'"
    assert outer_failure.timestamp == 1_700_000_000.5
    report = ChildFailedError("outer", {0: outer_failure}).format_msg()
    assert "Traceback (most recent call last):\n    File \"x.py\"\n  KeyError: 'k'" in report


# --- results -------------------------------------------------------------------------------


def test_run_procs_result() -> None:
    ok = RunProcsResult(return_values={0: 1}, stdouts={0: ""}, stderrs={0: "/l/0/stderr.log"})
    assert not ok.is_failed()
    assert RunProcsResult().failures == {}
    assert RunProcsResult().failures is not RunProcsResult().failures
    failed = RunProcsResult(failures={1: _failure(1, 1.0)})
    assert failed.is_failed()


# --- torch independence and interop --------------------------------------------------------


def test_importing_errors_does_not_import_torch() -> None:
    code = (
        "import sys, aioelastic._core.reports._errors, aioelastic._core.child._error_file; "
        "import aioelastic._core.reports._failures, aioelastic._core.reports._record; "
        "import aioelastic._core.reports._results, aioelastic._core.output._std; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_torch_written_error_file_is_read_by_us(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    error_file = tmp_path / "error.json"
    proc, exit_time = _run_child("torch-raise", "boom from torch", error_file=error_file)
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
    proc, _ = _run_child("ours-raise", "boom from ours", error_file=error_file)
    assert proc.returncode == 1, proc.stderr
    dumped = tmp_path / "parent-error.json"
    read, _ = _run_child("torch-read", str(error_file), str(dumped))
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


# --- hostile error files ---------------------------------------------------------------------
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
        [*CHILD, "measure-read", str(path)],
        cwd=REPO_ROOT,
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
    write_error_file(real, _caught(ValueError("via link")))
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


@pytest.mark.parametrize("timestamp", [float("9" * 25), float("nan"), float("inf"), -1e300])
def test_a_report_renders_whatever_timestamp_was_set_by_hand(timestamp: float) -> None:
    failure = _failure(0, timestamp)
    assert failure.timestamp_isoformat() == f"<invalid timestamp {timestamp!r}>"
    assert f"<invalid timestamp {timestamp!r}>" in ChildFailedError("t", {0: failure}).format_msg()


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
        cwd=REPO_ROOT,
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


# --- return values -------------------------------------------------------------------------


def test_a_truncated_return_value_says_how_much_arrived() -> None:
    from aioelastic._core.child._result_pipe import ResultReceiver

    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    receiver = ResultReceiver(read_end)
    try:
        assert receiver.incomplete_reason() == (
            "exited with code 0 but sent no return value (did it call os._exit(0)?)"
        )
        os.write(write_end, (100).to_bytes(8, sys.byteorder) + b"x" * 10)
        os.close(write_end)
        assert receiver.drain()  # end-of-file
        assert not receiver.complete
        assert receiver.incomplete_reason() == (
            "exited with code 0 but sent only 10 of the 100 bytes of its pickled return value "
            "(did something end it, or close its result pipe, while it was sending?)"
        )
    finally:
        receiver.close()


def test_record_of_nested_failure_with_an_invalid_timestamp_still_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    nested = ChildFailedError("inner", {0: _failure(0, float("nan"), message="boom")})

    @record
    def main() -> None:
        raise nested

    before = time.time()
    with pytest.raises(ChildFailedError):
        main()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message == "boom"
    assert before - 1 <= failure.timestamp <= time.time()
