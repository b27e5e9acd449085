"""The worker of PyTorch's launcher tests (``test/distributed/launcher/bin/test_script.py``).

Its contract, rewritten: every variable torchrun gives a worker must be set (and the
parent's ``TEST_SENTINEL_PARENT`` passed through), else it fails on the missing one; with
``--fail`` it raises RuntimeError; otherwise it touches a file named after its global rank
in ``--touch-file-dir``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

NEEDED = [
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
    "TEST_SENTINEL_PARENT",
    "TORCHELASTIC_ERROR_FILE",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--touch-file-dir", "--touch_file_dir")
    args = parser.parse_args()
    for name in NEEDED:
        print(f"{name} = {os.environ[name]}", flush=True)
    if args.fail:
        raise RuntimeError("raising exception since --fail flag was set")
    Path(args.touch_file_dir, os.environ["RANK"]).touch()


if __name__ == "__main__":
    main()
