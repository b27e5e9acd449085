"""Child programs for tests/test_errors.py, run as ``python -m tests.children.errors CMD ...``.

Commands:
    ours-raise MSG      raise ValueError(MSG) inside a function decorated with our ``record``
    ours-exit CODE      call sys.exit(CODE) inside our ``record`` (must not be recorded)
    ours-segv           kill itself with SIGSEGV inside our ``record`` (faulthandler output)
    torch-raise MSG     raise ValueError(MSG) inside torch's own ``record``
    plain-raise MSG     raise ValueError(MSG) with no decorator at all
    torch-read PATH OUT read PATH with torch's ProcessFailure / ChildFailedError /
                        ErrorHandler; print a JSON summary and dump PATH to OUT via ErrorHandler
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable


def _ours_raise(msg: str) -> None:
    from aioelastic._errors import record

    @record
    def main() -> None:
        raise ValueError(msg)

    main()


def _ours_exit(code: str) -> None:
    from aioelastic._errors import record

    @record
    def main() -> None:
        sys.exit(int(code))

    main()


def _ours_segv() -> None:
    from aioelastic._errors import record

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
    }
    commands[cmd](*rest)


if __name__ == "__main__":
    main(sys.argv[1:])
