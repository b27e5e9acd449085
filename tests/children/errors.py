"""Child programs for tests/core/child/test_error_file.py and tests/core/reports/test_errors.py.

Run as ``python -m tests.children.errors CMD ...``.

Commands:
    ours-raise MSG      raise ValueError(MSG) inside a function decorated with our ``record``
    ours-exit CODE      call sys.exit(CODE) inside our ``record`` (must not be recorded)
    ours-segv           kill itself with SIGSEGV inside our ``record`` (faulthandler output)
    torch-raise MSG     raise ValueError(MSG) inside torch's own ``record``
    plain-raise MSG     raise ValueError(MSG) with no decorator at all
    torch-read PATH OUT read PATH with torch's ProcessFailure / ChildFailedError /
                        ErrorHandler; print a JSON summary and dump PATH to OUT via ErrorHandler
    sabotage KIND CODE  replace $TORCHELASTIC_ERROR_FILE by a bad file (see `sabotage`), exit CODE
    measure-read PATH   build ProcessFailure.from_exit on PATH; print a JSON summary with the
                        seconds it took and how much the peak RSS grew (KiB)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable


def _ours_raise(msg: str) -> None:
    from aioelastic._core.reports._record import record

    @record
    def main() -> None:
        raise ValueError(msg)

    main()


def _ours_exit(code: str) -> None:
    from aioelastic._core.reports._record import record

    @record
    def main() -> None:
        sys.exit(int(code))

    main()


def _ours_segv() -> None:
    from aioelastic._core.reports._record import record

    @record
    def main() -> None:
        print("about to crash", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)

    main()


def _torch_raise(msg: str) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        raise ValueError(msg)

    main()


def _plain_raise(msg: str) -> None:
    def inner() -> None:
        raise ValueError(msg)

    inner()


def _torch_read(path: str, out: str) -> None:
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ErrorHandler,
        ProcessFailure,
    )

    failure = ProcessFailure(local_rank=0, pid=1234, exitcode=1, error_file=path)
    report = ChildFailedError("trainer", {0: failure}).format_msg()  # type: ignore[no-untyped-call]
    os.environ["TORCHELASTIC_ERROR_FILE"] = out
    ErrorHandler().dump_error_file(path, error_code=1)
    json.dump(
        {"message": failure.message, "timestamp": failure.timestamp, "report": report},
        sys.stdout,
    )


BAD_FILES = ("fifo", "dev-zero", "huge", "bad-json", "bad-timestamp")
"""The kinds of bad error file `sabotage` can leave behind."""


def make_bad_error_file(path: str, kind: str) -> None:
    """Leave a bad error file of ``kind`` (one of `BAD_FILES`) at ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(300 * 1024 * 1024)  # sparse: 300 MB of zeros, no disk used
    elif kind == "bad-json":
        with open(path, "w") as f:
            f.write('{"message": {"message": "ValueError: cut sh')
    elif kind == "bad-timestamp":
        with open(path, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": "ValueError: from the future",
                        "extraInfo": {"timestamp": "9" * 25, "timestamp_ns": "9" * 400},
                    }
                },
                f,
            )
    else:
        raise ValueError(f"unknown bad error file kind {kind!r}, expected one of {BAD_FILES}")


def sabotage(kind: str, code: str) -> None:
    """A worker that replaces its own error file by a bad one and exits ``code``."""
    print(f"sabotaging the error file with {kind}", file=sys.stderr, flush=True)
    make_bad_error_file(os.environ["TORCHELASTIC_ERROR_FILE"], kind)
    os._exit(int(code))


def _measure_read(path: str) -> None:
    import resource
    import time

    from aioelastic._core.reports._failures import ChildFailedError, ProcessFailure

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    failure = ProcessFailure.from_exit(
        local_rank=0, pid=1, exitcode=1, error_file=path, exit_time=time.time()
    )
    direct = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=path)
    ChildFailedError("t", {0: failure, 1: direct}).format_msg()
    seconds = time.monotonic() - start
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    json.dump(
        {
            "message": failure.message,
            "direct": direct.message,
            "seconds": seconds,
            "rss_growth_kib": growth,
        },
        sys.stdout,
    )


def main(argv: list[str]) -> None:
    """Dispatch one command (see the module docstring)."""
    cmd, *rest = argv
    commands: dict[str, Callable[..., None]] = {
        "ours-raise": _ours_raise,
        "ours-exit": _ours_exit,
        "ours-segv": _ours_segv,
        "torch-raise": _torch_raise,
        "plain-raise": _plain_raise,
        "torch-read": _torch_read,
        "sabotage": sabotage,
        "measure-read": _measure_read,
    }
    commands[cmd](*rest)


if __name__ == "__main__":
    main(sys.argv[1:])
