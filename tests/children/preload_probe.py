"""A script that reports how it was started, then ends as asked (``--preload`` tests).

``python preload_probe.py ACTION [ARG]`` prints one ``FACTS {...}`` line (what a script can
see of its interpreter: ``__file__``, ``__name__``, ``__spec__``, ``sys.argv``, ``sys.path``,
signal dispositions, stdio buffering, the torchrun variables), then:

* ``exit N``: ``sys.exit(N)``; ``os-exit N``: ``os._exit(N)``; ``exit-text``: ``sys.exit("bye")``;
* ``raise``: an uncaught ValueError;
* ``record``: an uncaught ValueError through ``aioelastic.record`` (writes the error file);
* ``wait``: prints ``ready pid=<pid>`` and waits for a signal (SIGINT: KeyboardInterrupt);
* ``shutdown``: a non-daemon thread and an ``atexit`` handler that print at exit;
* ``restart``: prints ``parent=<ppid> count=<restart count>``, exits 3 before restart 2;
* ``torch``: prints ``torch threads=<torch.get_num_threads()>``;
* ``argv A B``: nothing more.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading


def _disposition(sig: signal.Signals) -> str:
    handler = signal.getsignal(sig)
    return getattr(handler, "__name__", str(handler))


def facts() -> dict[str, object]:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    return {
        "name": __name__,
        "file": __file__,
        "spec": None if spec is None else spec.name,
        "main_is_this": main.__dict__ is globals(),
        "argv": sys.argv,
        "path": sys.path,
        "cwd": os.getcwd(),
        "signals": {s.name: _disposition(s) for s in signal.Signals if s not in (9, 19)},
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "stdout_write_through": sys.stdout.write_through,  # type: ignore[attr-defined]
        "stderr_write_through": sys.stderr.write_through,  # type: ignore[attr-defined]
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("RANK", "LOCAL_", "GROUP_", "ROLE_", "WORLD_", "TORCHELASTIC_"))
            and k not in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")
        },
    }


def main() -> None:
    action = sys.argv[1]
    print("FACTS " + json.dumps(facts(), sort_keys=True), flush=True)
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "os-exit":
        os._exit(int(sys.argv[2]))
    if action == "exit-text":
        sys.exit("bye")
    if action == "raise":
        raise ValueError("probe failure")
    if action == "record":
        from aioelastic import record

        @record
        def fail() -> None:
            raise ValueError("recorded probe failure")

        fail()
    if action == "wait":
        print(f"ready pid={os.getpid()}", flush=True)
        while True:
            signal.pause()
    if action == "restart":
        count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"parent={os.getppid()} count={count}", flush=True)
        sys.exit(0 if count == 2 else 3)
    if action == "torch":
        import torch

        print(f"torch threads={torch.get_num_threads()}", flush=True)
    if action == "shutdown":
        started = threading.Event()

        def late() -> None:
            started.set()
            print("thread done", flush=True)

        atexit.register(print, "atexit ran", flush=True)
        threading.Thread(target=late).start()


if __name__ == "__main__":
    main()
