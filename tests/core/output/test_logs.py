"""Worker logs: redirects, tee, prefixes, rank filters, whole lines, nothing lost.

Console behaviour is checked on a real supervisor process (``tests.children.logs``) whose
stdout and stderr are pipes read here, never through pytest's capture; file and
failure-report behaviour is checked in-process where that is enough.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from aioelastic import ChildFailedError, Std, run_processes
from aioelastic._core.output._logs import StreamPump
from aioelastic._core.process._platform import proc_stat
from tests.children.logs import BAD_BYTES
from tests.support.log_supervisor import by_rank, numbered_bytes
from tests.support.paths import CHILDREN
from tests.support.waits import ReadyFifo, make_fifo

# -- whole lines, nothing lost ----------------------------------------------------------


@pytest.mark.timeout(180)
def test_every_line_reaches_files_and_console_once_whole_and_prefixed(
    supervise: Any, tmp_path: Path
) -> None:
    nprocs, out_lines, err_lines = 4, 200_000, 2_000
    sup = supervise(
        {
            "worker": "numbered",
            "nprocs": nprocs,
            "args": [[rank, out_lines, err_lines] for rank in range(nprocs)],
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    assert summary["failures"] == {}
    out, err = by_rank(stdout, nprocs), by_rank(stderr, nprocs)
    for rank in range(nprocs):
        expected_out = numbered_bytes(rank, out_lines)
        expected_err = numbered_bytes(rank, err_lines)
        assert (tmp_path / "logs" / str(rank) / "stdout.log").read_bytes() == expected_out
        assert (tmp_path / "logs" / str(rank) / "stderr.log").read_bytes() == expected_err
        # Equal lists: every line exactly once, in order, unbroken, with its own prefix.
        assert out[rank] == expected_out.split(b"\n")[:-1]
        assert err[rank] == expected_err.split(b"\n")[:-1]
        assert summary["stdouts"][str(rank)] == str(tmp_path / "logs" / str(rank) / "stdout.log")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["function", "binary"])
def test_block_buffered_writers_get_whole_lines_on_the_console(
    supervise: Any, tmp_path: Path, kind: str
) -> None:
    # 8 KiB writes ending mid-line at ~10,000 lines/s for about three seconds: most
    # reads end in the middle of a line, for many flush delays in a row, and no line
    # may be cut, lost or printed twice on the console (a pipe here).
    nprocs, lines, rate = 4, 30_000, 10_000.0
    args = [[rank, lines, rate] for rank in range(nprocs)]
    config: dict[str, Any] = {"worker": "paced_blocks", "nprocs": nprocs, "args": args}
    if kind == "binary":
        config["binary"] = sys.executable
        config["args"] = [["-m", "tests.children.logs", "paced_blocks", *map(str, a)] for a in args]
    sup = supervise(
        {**config, "tee": Std.ALL, "redirects": Std.ALL, "log_dir": str(tmp_path / "logs")}
    )
    stdout, stderr, summary = sup.finish()
    assert summary["failures"] == {}
    out, err = by_rank(stdout, nprocs), by_rank(stderr, nprocs)
    for rank in range(nprocs):
        expected = numbered_bytes(rank, lines)
        for name, console in (("stdout", out), ("stderr", err)):
            assert (tmp_path / "logs" / str(rank) / f"{name}.log").read_bytes() == expected
            assert console[rank] == expected.split(b"\n")[:-1], f"{name} of rank {rank}"


def test_stdout_and_stderr_on_one_pipe_never_cut_each_others_lines(supervise: Any) -> None:
    nprocs, count = 2, 100_000
    sup = supervise(
        {
            "worker": "numbered",
            "nprocs": nprocs,
            "args": [[rank, count, count] for rank in range(nprocs)],
            "tee": Std.ALL,
        },
        merged=True,  # like `aioelastic-run ... 2>&1 | tee run.log`
    )
    merged, _, summary = sup.finish()
    assert summary["failures"] == {}
    for rank, lines in by_rank(merged, nprocs).items():
        expected = numbered_bytes(rank, count).split(b"\n")[:-1]
        assert sorted(lines) == sorted(expected * 2)


def test_progress_bar_without_newline_is_printed_whole_at_exit(
    supervise: Any, tmp_path: Path
) -> None:
    sup = supervise(
        {
            "worker": "progress_bar_then_exit",
            "nprocs": 2,
            "tee": Std.ALL,
            "redirects": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    written = "".join(f"\rprogress {p:3d}%" for p in range(0, 101, 25)) + " [no newline at exit]"
    # Every piece on the console is a prefixed frame ending in \r or a line ending in
    # \n, so the two bars never splice; the redrawing carriage returns re-print the
    # prefix, so a bar never overwrites it; the bar is not one line per frame.
    matches = list(re.finditer(rb"\r?\[w(\d+)\]:([^\r\n]*[\r\n])", stdout))
    assert b"".join(m.group(0) for m in matches) == stdout
    for rank in range(2):
        mine = b"".join(m.group(2) for m in matches if int(m.group(1)) == rank)
        assert mine == written.encode()[1:] + b"\n"
        log = tmp_path / "logs" / str(rank) / "stdout.log"
        assert log.read_bytes() == written.encode()
    assert stdout.count(b"\n") == 2


def test_a_slow_progress_bar_is_frames_on_a_piped_console_not_a_line_per_flush(
    supervise: Any, tmp_path: Path
) -> None:
    sup = supervise(
        {
            "worker": "bar_over_time",
            "nprocs": 1,
            "args": [[4, 0.3]],
            "tee": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    # Each frame outlived the flush delay: it was shown as a frame (ended by \r, so the
    # next one draws over it), never as a line of its own. The closing \n is written
    # bare after the last frame, which a file or `less` reads as a CRLF line ending.
    frames = b"".join(b"\r[w0]:step %d/4" % i for i in range(1, 5))
    assert stdout == frames + b"\r\n[w0]:done\n"
    log = (tmp_path / "logs" / "0" / "stdout.log").read_bytes()
    assert log == b"".join(b"\rstep %d/4" % i for i in range(1, 5)) + b"\ndone\n"


BAR_THEN_RAISE = """
import sys, time
print("starting", file=sys.stderr, flush=True)
for i in range(1, 5):
    sys.stderr.write(f"\\rtraining {i}/4")
    sys.stderr.flush()
    time.sleep(0.3)  # longer than the flush delay: every frame is held past it
sys.stderr.write("\\n")
raise ValueError("diverged")
"""


@pytest.mark.asyncio
async def test_the_failure_report_keeps_the_last_frame_of_a_bar_not_every_frame(
    tmp_path: Path,
) -> None:
    script = tmp_path / "bar.py"
    script.write_text(BAR_THEN_RAISE)
    with anyio.fail_after(60):
        result = await run_processes(
            name="bar",
            entrypoint=sys.executable,
            args={0: (str(script),)},
            envs={0: {}},
            log_dir=tmp_path / "logs",
            redirects=Std.ERR,
        )
    lines = result.failures[0].message.splitlines()
    assert lines[:3] == ["starting", "training 4/4", "Traceback (most recent call last):"]
    assert lines[-1] == "ValueError: diverged"
    assert not any("training 1/4" in line or "training 3/4" in line for line in lines)
    log = (tmp_path / "logs" / "0" / "stderr.log").read_bytes()
    frames = b"".join(b"\rtraining %d/4" % i for i in range(1, 5))
    assert log.startswith(b"starting\n" + frames + b"\nTraceback")


def test_a_growing_partial_line_is_shown_after_the_flush_delay(
    supervise: Any, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    sup = supervise({"worker": "dots_until", "nprocs": 1, "args": [[str(go)]], "tee": Std.OUT})
    # The worker adds a dot every 20 ms and ends the line only once `go` exists, so
    # this line can only come from the flush delay (counted from the line's first byte).
    sup.wait_for("stdout", b"[w0]:dots:.", timeout=30)
    go.touch()
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    lines = by_rank(stdout, 1)[0]
    assert len(lines) >= 2
    assert b"".join(lines) == b"dots:" + b"." * (b"".join(lines).count(b".")) + b"|end"


def test_print_end_empty_is_held_then_printed_whole_without_interleaving(
    supervise: Any, tmp_path: Path
) -> None:
    fifos = [make_fifo(tmp_path, f"fifo{rank}") for rank in range(2)]
    sup = supervise(
        {
            "worker": "split_line",
            "nprocs": 2,
            "args": [[r, str(f)] for r, f in enumerate(fifos)],
            "tee": Std.OUT,
            "redirects": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    for rank in range(2):
        # Both workers now hold a partial line and block: only the flush delay prints it.
        sup.wait_for("stdout", f"[w{rank}]:rank {rank} epoch 1: loss=\n".encode())
    for fifo in fifos:
        with open(fifo, "w"):
            pass
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    for rank, lines in by_rank(stdout, 2).items():
        assert lines == [
            f"rank {rank} epoch 1: loss=".encode(),
            f"0.{rank}5".encode(),
            f"rank {rank} done".encode(),
        ]
        log = tmp_path / "logs" / str(rank) / "stdout.log"
        assert (
            log.read_bytes() == f"rank {rank} epoch 1: loss=0.{rank}5\nrank {rank} done\n".encode()
        )


def test_sigkilled_worker_keeps_its_last_lines(supervise: Any, tmp_path: Path) -> None:
    sup = supervise(
        {
            "worker": "write_then_sigkill",
            "nprocs": 1,
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    assert stdout == b"[w0]:last words before SIGKILL\n[w0]:and a partial one\n"
    assert stderr == b"[w0]:stderr last words\n"
    logs = tmp_path / "logs" / "0"
    assert (logs / "stdout.log").read_bytes() == b"last words before SIGKILL\nand a partial one"
    assert (logs / "stderr.log").read_bytes() == b"stderr last words\n"
    failure = summary["failures"]["0"]
    assert failure["exitcode"] == -signal.SIGKILL
    assert "stderr last words" in failure["message"]
    assert "SIGKILL" in summary["format_msg"]


def test_undecodable_bytes_pass_through_unchanged(supervise: Any, tmp_path: Path) -> None:
    sup = supervise(
        {
            "worker": "undecodable",
            "nprocs": 1,
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    written = BAD_BYTES + b"\n" + b"still fine\n" + BAD_BYTES
    expected_console = b"".join(b"[w0]:" + line + b"\n" for line in written.split(b"\n"))
    assert stdout == expected_console
    assert stderr == expected_console
    for name in ("stdout.log", "stderr.log"):
        assert (tmp_path / "logs" / "0" / name).read_bytes() == written
    failure = summary["failures"]["0"]
    assert failure["exitcode"] == 3
    assert "still fine" in failure["message"]
    assert "\ufffd" in failure["message"]
    assert "caf\u00e9" in failure["message"]


def test_a_one_megabyte_line_passes_whole(supervise: Any, tmp_path: Path) -> None:
    size = 1_000_000
    sup = supervise(
        {
            "worker": "big_line",
            "nprocs": 1,
            "args": [[size]],
            "tee": Std.OUT,
            "redirects": Std.OUT,
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    big = b"<" + b"L" * (size - 2) + b">"
    assert stdout == b"[w0]:" + big + b"\n[w0]:after the big line\n"
    assert (tmp_path / "logs" / "0" / "stdout.log").read_bytes() == big + b"\nafter the big line\n"


def test_a_forked_worker_gets_a_console_of_its_own(supervise: Any, tmp_path: Path) -> None:
    # The supervisor's console writer thread runs before the fork; a forked worker that
    # supervises workers of its own must not inherit a console whose thread it does not
    # have (what it queued would never be written, and its flush would never end).
    sup = supervise(
        {
            "worker": "console_after_fork",
            "nprocs": 1,
            "start_method": "fork",
            "tee": Std.OUT,
            "warm_console": True,
        }
    )
    stdout, _, summary = sup.finish(timeout=60)
    assert summary["failures"] == {}
    assert stdout == b"console warmed up\n[w0]:queued after the fork\n"


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_pump_closed_from_another_task_leaves_no_stale_registration() -> None:
    # The exit path drains and closes a pipe from the exit callback while the pump task
    # sleeps on it; the descriptor number is then free for the next pipe or pidfd.
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pump = StreamPump(read_end, log_path=None, console=None, prefix=b"", keep_tail=True)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump.run)
            await anyio.wait_all_tasks_blocked()
            pump.finish()  # the sleeping pump task must wake up and end
    os.close(write_end)
    reused, writer = os.pipe2(os.O_CLOEXEC)
    assert reused == read_end  # the lowest free number: the case that matters
    again = StreamPump(reused, log_path=None, console=None, prefix=b"", keep_tail=True)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(again.run)
            await anyio.wait_all_tasks_blocked()
            os.write(writer, b"heard\n")
            os.close(writer)
            await again.closed.wait()
    assert again.tail_lines() == ["heard"]


# -- prefixes and the rank filter -------------------------------------------------------


def test_log_line_prefix_template(supervise: Any) -> None:
    sup = supervise(
        {
            "worker": "one_line",
            "nprocs": 2,
            "args": [[0, "hello"], [1, "hello"]],
            "envs": {"0": {"ROLE_NAME": "trainer", "RANK": "10"}, "1": {"RANK": "11"}},
            "tee": Std.OUT,
            "log_line_prefix": "${role_name}/${rank}/${local_rank}@${hostname}> ",
        }
    )
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    host = socket.gethostname()
    assert sorted(stdout.decode().splitlines()) == [
        f"trainer/10/0@{host}> hello from 0",
        # No ROLE_NAME in its environment: the group's name stands in for the role.
        f"w/11/1@{host}> hello from 1",
    ]


def test_identical_lines_are_printed_once_with_the_ranks_the_prefix_shows(
    supervise: Any, tmp_path: Path
) -> None:
    from tests.children import collapse as child

    nprocs = 8
    ready = ReadyFifo(tmp_path)
    go = make_fifo(tmp_path, "go")
    script = str(CHILDREN / "collapse.py")
    sup = supervise(
        {
            "binary": sys.executable,
            "nprocs": nprocs,
            "args": [[script, str(ready.path), str(go), "0", rank] for rank in range(nprocs)],
            # The prefix shows the global rank: so do the collapsed lines.
            "envs": {str(rank): {"RANK": str(10 + rank)} for rank in range(nprocs)},
            "log_line_prefix": "<${rank}> ",
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "log_dir": str(tmp_path / "logs"),
            "collapse_identical_lines": 2.0,
        }
    )
    try:
        anyio.run(ready.lines, nprocs, 60)
    finally:
        ready.close()
    fd = os.open(go, os.O_RDWR)  # every rank writes now (see tests/children/collapse.py)
    try:
        stdout, stderr, summary = sup.finish()
    finally:
        os.close(fd)
    assert summary["failures"] == {}
    own = [f"<{10 + r}> {line}" for r in range(nprocs) for line in child.lines(r)[0][1:-1]]
    shown = stdout.decode().splitlines()
    assert shown[0] == f"[ranks 10-17]: {child.WARNING}"
    assert sorted(shown[1:-1]) == sorted(own)
    assert shown[-1] == f"[ranks 10-17]: {child.LAST}"
    assert stderr.decode().splitlines() == [f"[ranks 10-17]: {child.ERR_WARNING}"]
    for rank in range(nprocs):
        out, err = child.lines(rank)
        logs = tmp_path / "logs" / str(rank)
        assert (logs / "stdout.log").read_text() == "".join(f"{line}\n" for line in out)
        assert (logs / "stderr.log").read_text() == "".join(f"{line}\n" for line in err)


def test_rank_filter_hides_console_output_but_not_files_or_failures(
    supervise: Any, tmp_path: Path
) -> None:
    fifo = make_fifo(tmp_path, "fifo")
    sup = supervise(
        {
            "worker": "fail_after_output",
            "nprocs": 2,
            "args": [[0, str(fifo)], [1, str(fifo)]],
            "tee": Std.ALL,
            "redirects": Std.ALL,
            "local_ranks_filter": [0],
            "log_dir": str(tmp_path / "logs"),
        }
    )
    stdout, stderr, summary = sup.finish()
    assert stdout == b"[w0]:stdout of rank 0\n"
    assert b"[w0]:stderr of rank 0\n" in stderr
    assert b"rank 1" not in stdout + stderr
    logs = tmp_path / "logs" / "1"
    assert (logs / "stdout.log").read_bytes() == b"stdout of rank 1\n"
    assert (logs / "stderr.log").read_bytes().startswith(b"stderr of rank 1\n")
    assert list(summary["failures"]) == ["1"]
    assert "RuntimeError: rank 1 blew up" in summary["format_msg"]


# -- the last stderr lines of a plain script --------------------------------------------

PLAIN_SCRIPT = """\
import sys
print("output before the crash")
def deep_inside():
    raise ValueError("plain script failed: marker-42")
if sys.argv[1] == "fail":
    deep_inside()
"""


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("redirects", "tee", "ranks_filter"),
    [
        pytest.param(Std.NONE, Std.NONE, None, id="not-redirected-not-teed"),
        pytest.param(Std.ERR, Std.NONE, None, id="redirected"),
        pytest.param(Std.ALL, Std.ALL, {1}, id="teed-but-filtered-out"),
        pytest.param(Std.NONE, Std.ALL, {1}, id="teed-not-redirected-filtered-out"),
    ],
)
async def test_plain_script_traceback_is_reported_without_a_decorator(
    tmp_path: Path, redirects: Std, tee: Std, ranks_filter: set[int] | None
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    result = await run_processes(
        name="plain",
        entrypoint=sys.executable,
        args={0: (str(script), "fail"), 1: (str(script), "ok")},
        envs={0: {}, 1: {}},
        log_dir=tmp_path / "logs",
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ranks_filter,
    )
    assert list(result.failures) == [0]
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert failure.message.startswith("Traceback (most recent call last):")
    assert failure.message.endswith("ValueError: plain script failed: marker-42")
    report = ChildFailedError("plain", result.failures).format_msg()
    assert "in deep_inside" in report
    assert "ValueError: plain script failed: marker-42" in report
    if Std.ERR in redirects:
        assert "marker-42" in (tmp_path / "logs" / "0" / "stderr.log").read_text()


# -- back-pressure and idle cost --------------------------------------------------------


def test_worker_is_not_blocked_by_a_stalled_console_below_the_high_water_mark(
    supervise: Any,
) -> None:
    lines = 120_000  # about 4 MB, far more than the pipe to the stalled reader holds
    sup = supervise(
        {"worker": "numbered", "nprocs": 1, "args": [[0, lines, 0]], "tee": Std.OUT},
        read_stdout=False,
    )
    # Nobody reads the supervisor's stdout, yet the worker finishes and is reaped.
    sup.wait_for("stderr", b"@@WAITED", timeout=60)
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    assert by_rank(stdout, 1)[0] == numbered_bytes(0, lines).split(b"\n")[:-1]


def test_beyond_the_high_water_mark_the_worker_waits_and_nothing_is_dropped(
    supervise: Any,
) -> None:
    lines = 120_000
    sup = supervise(
        {
            "worker": "numbered",
            "nprocs": 1,
            "args": [[0, lines, 0]],
            "tee": Std.OUT,
            "high_water": 256 * 1024,
        },
        read_stdout=False,
    )
    sup.wait_for("stderr", b"@@PIDS")
    # An observation window, not a synchronisation: with the console stalled and the
    # queue full, the worker must still be blocked in its write when it ends.
    time.sleep(1.5)
    assert not sup.seen("stderr", b"@@WAITED")
    stdout, _, summary = sup.finish()
    assert summary["failures"] == {}
    assert by_rank(stdout, 1)[0] == numbered_bytes(0, lines).split(b"\n")[:-1]


def _task_stats(pid: int) -> tuple[int, float, int]:
    """Threads, CPU seconds and context switches (all threads) of process ``pid``."""
    tasks = os.listdir(f"/proc/{pid}/task")
    fields = proc_stat(pid)
    assert fields is not None
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt")):
                        switches += int(line.split()[1])
        except FileNotFoundError:
            continue
    return len(tasks), cpu, switches


@pytest.mark.timeout(90)
def test_idle_teed_workers_cost_no_threads_and_no_wakeups(supervise: Any) -> None:
    nprocs = 8
    sup = supervise(
        {"worker": "idle_ready", "nprocs": nprocs, "tee": Std.ALL, "stop_on_stdin": True}
    )
    sup.wait_for("stdout", b"]:ready\n", count=nprocs)
    pid = sup.proc.pid
    threads, cpu_before, switches_before = _task_stats(pid)
    time.sleep(2.0)  # the measurement window
    threads_after, cpu_after, switches_after = _task_stats(pid)
    print(
        f"idle 2 s: {threads} threads, {cpu_after - cpu_before:.3f} s CPU, "
        f"{switches_after - switches_before} context switches"
    )
    sup.send_stop()
    sup.wait_for("stderr", b"@@THREADS")
    names = json.loads(sup.tail("stderr").split(b"@@THREADS ")[1].split(b"\n")[0])
    stdout, _, summary = sup.finish()
    assert summary["finished"] is False  # still running when stopped, as intended
    assert sorted(by_rank(stdout, nprocs).items()) == [(r, [b"ready"]) for r in range(nprocs)]
    # The main thread, the console writer (one per console stream used) and the
    # launcher pool (capped, shared by every group) — never a thread per stream (torch's
    # tee: one per tee'd file, 16 here).
    others = [n for n in names if not n.startswith("aioelastic-launch")]
    assert sorted(others) == ["MainThread", "aioelastic-stdout"]
    assert threads == threads_after == len(names) <= 3 + 8
    # No polling: an idle supervisor sleeps in epoll_wait and condition waits.
    assert switches_after - switches_before <= 10
    assert cpu_after - cpu_before <= 0.05
