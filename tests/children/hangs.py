"""Workers that hang in a named function, for the stack, timer and stall tests.

Used as function workers (``stuck(fifo, how)``) and as a plain script
(``python tests/children/hangs.py FIFO HOW [CLIENT]``), where CLIENT arms a timer first:
``torch`` (torch's ``FileTimerClient`` through ``TORCHELASTIC_TIMER_FILE``), ``ours``
(``aioelastic.timer``) or ``none``. Each reports ``ready <pid>`` on FIFO once it is about
to block.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator


def _say(fifo: str, text: str) -> None:
    with open(fifo, "w") as f:
        f.write(text + "\n")


def stuck_in_sleep(fifo: str) -> None:
    _say(fifo, f"ready {os.getpid()}")
    time.sleep(3600)


def stuck_in_event_wait(fifo: str) -> None:
    _say(fifo, f"ready {os.getpid()}")
    threading.Event().wait()


def stuck_in_blocking_read(fifo: str) -> None:
    r, _w = os.pipe()
    _say(fifo, f"ready {os.getpid()}")
    os.read(r, 1)


def stuck_in_helper_thread(fifo: str) -> None:
    """The main thread waits on a thread that is itself stuck in its own function."""

    def helper_thread_stuck_here() -> None:
        threading.Event().wait()

    thread = threading.Thread(target=helper_thread_stuck_here, daemon=True)
    thread.start()
    _say(fifo, f"ready {os.getpid()}")
    thread.join()


HOWS = {
    "sleep": stuck_in_sleep,
    "event": stuck_in_event_wait,
    "read": stuck_in_blocking_read,
    "thread": stuck_in_helper_thread,
}


@contextlib.contextmanager
def _armed(client: str, after: float) -> Iterator[None]:
    if client == "torch":
        from torch.distributed.elastic import timer

        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        with timer.expires(after=after, scope="training_step"):
            yield
    elif client == "ours":
        import aioelastic.timer

        aioelastic.timer.configure()
        with aioelastic.timer.expires(after=after, scope="training_step"):
            yield
    else:
        yield


def stuck(fifo: str, how: str, client: str = "none", after: float = 1.0) -> None:
    """Hang in the function named by ``how``, optionally under an armed timer."""
    with _armed(client, after):
        HOWS[how](fifo)


def armed_but_finishes(fifo: str, client: str, after: float, work: float) -> str:
    """Arm a timer, work (busy) for less than it, release, then stay quiet past it."""
    with _armed(client, after):
        deadline = time.monotonic() + work
        while time.monotonic() < deadline:
            pass
    _say(fifo, f"released {os.getpid()}")
    time.sleep(after * 1.5)
    return "done"


def quiet_but_armed(fifo: str, client: str, after: float, quiet: float) -> str:
    """Stay silent (no output) for ``quiet`` seconds inside a timer that outlasts it."""
    with _armed(client, after):
        _say(fifo, f"ready {os.getpid()}")
        time.sleep(quiet)
    return "done"


def heartbeat(fifo: str, seconds: float, every: float) -> str:
    """Silent, but arm and release a timer (ours) every ``every`` seconds."""
    import aioelastic.timer

    aioelastic.timer.configure()
    _say(fifo, f"ready {os.getpid()}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with aioelastic.timer.expires(after=30, scope="beat"):
            time.sleep(every)
    return "done"


def hang_on_first_attempt(fifo: str) -> str:
    """Attempt 0: rank 1 hangs under a 1 s timer (ours), rank 0 waits. Later: both return."""
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        return "recovered"
    print(f"attempt 0 rank {os.environ['LOCAL_RANK']}", flush=True)
    if os.environ["LOCAL_RANK"] == "1":
        stuck(fifo, "event", "ours", 1.0)
    else:
        stuck_in_sleep(fifo)
    return "unreachable"


def chatty(fifo: str, seconds: float) -> str:
    """Print a line every 0.1 s for ``seconds``: busy, never stalled."""
    _say(fifo, f"ready {os.getpid()}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        print("step", flush=True)
        time.sleep(0.1)
    return "done"


if __name__ == "__main__":
    stuck(
        sys.argv[1],
        sys.argv[2],
        sys.argv[3] if len(sys.argv) > 3 else "none",
        float(sys.argv[4]) if len(sys.argv) > 4 else 1.0,
    )
