"""The trivial training script of the launcher measure: stamp the clock, exit 0.

Run by ``torchrun`` / ``aioelastic-run`` as a script, so it imports nothing from the
project: ``python benchmarks/programs/_trivial.py DIR`` writes ``DIR/start{LOCAL_RANK}``.
"""

import os
import sys
import time


def main() -> None:
    """Write this worker's stamp."""
    stamp = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    path = os.path.join(sys.argv[1], "start" + os.environ["LOCAL_RANK"])
    with open(path, "w") as f:
        f.write(str(stamp))


if __name__ == "__main__":
    main()
