"""ProcessFailure, ChildFailedError, record and results: what a report makes of a failure.

The error files they read (written whole, by torch too, and hostile ones) are tested in
tests/core/child/test_error_file.py.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

import pytest

from aioelastic._core.child._error_file import read_error_file, write_error_file
from aioelastic._core.reports._failures import ChildFailedError, ProcessFailure
from aioelastic._core.reports._record import record
from aioelastic._core.reports._results import RunProcsResult
from tests.support.failures import caught, make_failure, run_errors_child
from tests.support.paths import REPO

# --- ProcessFailure -----------------------------------------------------------------------


def test_from_exit_with_our_error_file_written_by_a_real_worker(tmp_path: Path) -> None:
    error_file = tmp_path / "0" / "error.json"
    proc, exit_time = run_errors_child("ours-raise", "boom from ours", error_file=error_file)
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
    proc, exit_time = run_errors_child("plain-raise", "no decorator here")
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
    proc, exit_time = run_errors_child("ours-segv", error_file=error_file)
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
    proc, exit_time = run_errors_child("ours-exit", "3", error_file=error_file)
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
        write_error_file(path, caught(ValueError(str(i))))
        stamps.append(
            ProcessFailure.from_exit(
                local_rank=i, pid=i, exitcode=1, error_file=str(path), exit_time=time.time() + 60
            ).timestamp
        )
    assert 0 < stamps[1] - stamps[0] < 1  # same second, still ordered
    failure = make_failure(0, 1_700_000_000.123456)
    iso = failure.timestamp_isoformat()
    assert ".123456" in iso
    parsed = datetime.fromisoformat(iso)
    assert parsed.utcoffset() is not None  # local time, with its offset
    assert parsed.timestamp() == pytest.approx(1_700_000_000.123456, abs=1e-6)


def test_constructor_with_only_torch_fields_reads_the_error_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    before = time.time()
    write_error_file(path, caught(ValueError("x")))
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
    write_error_file(path, caught(ValueError("x")))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path), message="m")
    assert failure.message == "m"
    assert failure.timestamp == 0.0
    assert failure.error_file_data == {}


# --- ChildFailedError ---------------------------------------------------------------------


def test_empty_failures_rejected() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        ChildFailedError("trainer", {})


def test_get_first_failure_is_the_earliest() -> None:
    failures = {
        0: make_failure(0, 100.30),
        5: make_failure(1, 100.10),
        3: make_failure(2, 100.20),
    }
    assert ChildFailedError("t", failures).get_first_failure() == (5, failures[5])
    # Ties go to the lowest rank, whatever the dict order.
    tied = {7: make_failure(1, 5.0), 2: make_failure(0, 5.0), 9: make_failure(2, 6.0)}
    assert ChildFailedError("t", tied).get_first_failure()[0] == 2


def test_format_msg_contents(tmp_path: Path) -> None:
    path = tmp_path / "1" / "error.json"
    write_error_file(path, caught(ValueError("the root cause")))
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
    later = make_failure(2, root.timestamp + 1.0, exitcode=3, pid=555, message="exited with code 3")
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
    msg = ChildFailedError("w", {0: make_failure(0, 1.0)}).format_msg()
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
    msg = ChildFailedError("w", {-1: node_end, 0: make_failure(0, 3.0)}).format_msg()
    root = msg[msg.index("Root Cause") :]
    assert "  rank      : none (a node's end, not a worker's: see traceback)" in root
    assert "  exitcode  : none (no process)" in root
    assert "  host      : 10.0.0.3" in root
    assert "-1" not in root
    assert "  rank      : 0 (local_rank: 0)" in msg[: msg.index("Root Cause")]


def test_child_failed_error_pickles(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_error_file(path, caught(ValueError("pickled")))
    root = ProcessFailure.from_exit(
        local_rank=0, pid=1, exitcode=1, error_file=str(path), exit_time=time.time()
    )
    exc = ChildFailedError("trainer", {0: root, 1: make_failure(1, root.timestamp + 1)})
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
    exc = caught(ChildFailedError("trainer", {0: make_failure(0, 1.0)}))

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert "Root Cause (first observed failure):" in text


# --- record -------------------------------------------------------------------------------


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
    write_error_file(inner_file, caught(ZeroDivisionError("deep down")))
    root = ProcessFailure.from_exit(
        local_rank=1, pid=2, exitcode=-6, error_file=str(inner_file), exit_time=time.time()
    )
    nested = ChildFailedError("inner", {0: make_failure(0, root.timestamp + 1), 1: root})
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


# --- results ------------------------------------------------------------------------------


def test_run_procs_result() -> None:
    ok = RunProcsResult(return_values={0: 1}, stdouts={0: ""}, stderrs={0: "/l/0/stderr.log"})
    assert not ok.is_failed()
    assert RunProcsResult().failures == {}
    assert RunProcsResult().failures is not RunProcsResult().failures
    failed = RunProcsResult(failures={1: make_failure(1, 1.0)})
    assert failed.is_failed()


# --- torch independence -------------------------------------------------------------------


def test_importing_errors_does_not_import_torch() -> None:
    code = (
        "import sys, aioelastic._core.reports._errors, aioelastic._core.child._error_file; "
        "import aioelastic._core.reports._failures, aioelastic._core.reports._record; "
        "import aioelastic._core.reports._results, aioelastic._core.output._std; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


# --- timestamps set by hand (hostile error files: tests/core/child/test_error_file.py) ----


@pytest.mark.parametrize("timestamp", [float("9" * 25), float("nan"), float("inf"), -1e300])
def test_a_report_renders_whatever_timestamp_was_set_by_hand(timestamp: float) -> None:
    failure = make_failure(0, timestamp)
    assert failure.timestamp_isoformat() == f"<invalid timestamp {timestamp!r}>"
    assert f"<invalid timestamp {timestamp!r}>" in ChildFailedError("t", {0: failure}).format_msg()


# --- return values ------------------------------------------------------------------------


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
    nested = ChildFailedError("inner", {0: make_failure(0, float("nan"), message="boom")})

    @record
    def main() -> None:
        raise nested

    before = time.time()
    with pytest.raises(ChildFailedError):
        main()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message == "boom"
    assert before - 1 <= failure.timestamp <= time.time()
