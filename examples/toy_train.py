"""A stand-in training script for the examples: log lines, a progress bar, an optional failure.

Run by a launcher with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``)::

    python examples/toy_train.py --steps 20 --step-time 0.05 [--fail-at 7 --fail-rank 1]

It needs no torch, so the examples start in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--fail-at", type=int, default=-1, help="step at which to fail")
    parser.add_argument("--fail-rank", type=int, default=0)
    opts = parser.parse_args()
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    print(f"rank {rank}/{world}: starting {opts.steps} steps", flush=True)
    for step in range(1, opts.steps + 1):
        if step == opts.fail_at and rank == opts.fail_rank:
            print(f"rank {rank}: loss is NaN at step {step}", file=sys.stderr, flush=True)
            return 3
        time.sleep(opts.step_time)
        # A progress bar: one frame per step, redrawn in place with a carriage return.
        done = step * 20 // opts.steps
        bar = "#" * done + "." * (20 - done)
        sys.stderr.write(f"[{bar}] {step}/{opts.steps}\r")
        sys.stderr.flush()
        if step % 10 == 0:
            print(f"rank {rank}: step {step} loss {1.0 / step:.4f}", flush=True)
    sys.stderr.write("\n")
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
