"""Binary workers: one self-contained program run as ``python -S -c CODE COMMAND ...``.

``-S`` (no ``site``) and no imports beyond ``os``, ``sys``, ``time``, ``signal`` keep the
interpreter's own start as close to the physical floor (``python -S -c pass``) as a
Python worker gets, so what differs between systems is the supervisor. Commands:

- ``stamp PATH``: write the clock to PATH, exit 0.
- ``fail FIFO COUNT ARMED PATH DELAY``: wait for COUNT siblings to be ready, signal the
  ARMED FIFO (the supervisor's caller learns that the job is fully up), wait DELAY seconds
  (so that the failure falls at a random phase of any polling period), write the clock to
  PATH, exit 1.
- ``sleep FIFO IGNORE_TERM [TERM_PATH]``: ignore SIGTERM if IGNORE_TERM is 1 (else, with
  TERM_PATH, write the clock there when SIGTERM arrives, then die of it), signal ready,
  sleep.
- ``idle FIFO``: print ``ready``, signal ready, sleep.
- ``spam DIR RANK LINES WIDTH``: write LINES numbered lines to stdout as fast as possible,
  stamping ``DIR/spam_start{RANK}`` before and ``DIR/spam_end{RANK}`` after.
- ``ping RANK COUNT INTERVAL``: print COUNT lines ``RANK I STAMP``, one every INTERVAL s.
"""

from __future__ import annotations

import sys

from benchmarks.programs._clock import WORKER_TTL_S

CODE = f"""
import os, sys, time, signal
def now():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)
def stamp(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, str(now()).encode())
    os.close(fd)
def ready(fifo):
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"r")
    os.close(fd)
cmd = sys.argv[1]
if cmd == "stamp":
    stamp(sys.argv[2])
elif cmd == "fail":
    count = int(sys.argv[3])
    if count:
        fd = os.open(sys.argv[2], os.O_RDWR)
        got = 0
        while got < count:
            got += len(os.read(fd, count - got))
    ready(sys.argv[4])
    time.sleep(float(sys.argv[6]))
    stamp(sys.argv[5])
    os._exit(1)
elif cmd == "sleep":
    if sys.argv[3] == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif len(sys.argv) > 4:
        def term(signum, frame, path=sys.argv[4]):
            stamp(path)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        signal.signal(signal.SIGTERM, term)
    ready(sys.argv[2])
    time.sleep({WORKER_TTL_S})
elif cmd == "idle":
    sys.stdout.write("ready\\n")
    sys.stdout.flush()
    ready(sys.argv[2])
    time.sleep({WORKER_TTL_S})
elif cmd == "spam":
    d, rank, lines, width = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    pad = "x" * width
    stamp(os.path.join(d, "spam_start" + rank))
    write = sys.stdout.write
    for i in range(lines):
        write(f"{{rank}} {{i}} {{pad}}\\n")
    sys.stdout.flush()
    stamp(os.path.join(d, "spam_end" + rank))
elif cmd == "ping":
    rank, count, interval = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    for i in range(count):
        time.sleep(interval)
        sys.stdout.write(f"{{rank}} {{i}} {{now()}}\\n")
        sys.stdout.flush()
else:
    sys.exit("unknown command " + cmd)
"""


def argv(command: str, *args: object) -> tuple[str, ...]:
    """Arguments after the executable for a binary worker running ``command``."""
    return ("-S", "-c", CODE, command, *map(str, args))


def executable() -> str:
    """The interpreter binary workers run."""
    return sys.executable
